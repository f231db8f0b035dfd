"""The launcher class Hydra instantiates for `hydra/launcher=slurm` (see kvq_lab.run.slurm)."""

from __future__ import annotations

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class KvqSlurmLauncher(SlurmLauncher):
    """Submits the rows that have no completed record, one job array; every row ends in a record and the sweep's
    summary line (kvq_lab.run.sweep)."""

    def launch(self, job_overrides, initial_job_idx):
        from kvq_lab.run.slurm import launch_rows

        return launch_rows(self, job_overrides, initial_job_idx)
