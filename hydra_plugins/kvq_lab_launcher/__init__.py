"""kvq_lab's SLURM launcher (`hydra/launcher=slurm`): Hydra's submitit launcher that checks its settings against
the partition, skips rows with completed records before asking for an allocation, and waits for every row whatever
SLURM did to it. The logic lives in kvq_lab.run.slurm (the host) and kvq_lab.run.slurm_job (the job); Hydra
finds launchers only under `hydra_plugins`."""
