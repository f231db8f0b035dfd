"""kvq_lab entry point.

python run.py key_axis=channel value_axis=token            # one run (defaults: conf/config.yaml)
python run.py -m key_axis=channel,token value_axis=channel,token   # grid sweep, 4 runs
python run.py -m experiment=kivi_axis_table                # a saved study (conf/experiment/)
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")  # no network by default; `wandb sync` uploads later
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from kvq_lab.run.config import ConfigError, register_schema  # noqa: E402

register_schema()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvq_lab.run import slurm_job, sweep
    from kvq_lab.run.runner import RecordNotWritten, RunFailed, RunInterrupted, run

    logging.getLogger("kvq_lab").setLevel(logging.INFO)
    if cfg.get("frontier"):  # experiment=frontier: one driver runs its stages, each row an ordinary run
        from kvq_lab.frontier.driver import main as frontier

        if HydraConfig.get().mode == RunMode.MULTIRUN:
            print("error: experiment=frontier runs its own stages; run it without -m", file=sys.stderr)
            sys.exit(2)
        sys.exit(frontier(cfg))
    for noisy in ("lm_eval", "lm_eval.models.huggingface", "lm_eval.tasks._index", "lm_eval.api.task"):
        logging.getLogger(noisy).setLevel(logging.ERROR)  # progress bars remain; config chatter goes
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    # a sweep's id (its start time): groups its rows in W&B when no experiment_name names them
    sweep_id = f"sweep-{os.path.basename(str(hc.sweep.dir))}" if multirun else None
    outcome = {}  # what this row ended as, for the sweep's summary (kvq_lab.run.sweep)
    try:
        metrics = run(cfg, sweep=sweep_id, outcome=outcome)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        sweep.note(outcome.get("row_key", ""), "rejected", str(e))
        return None  # validated with the whole sweep before it started; only the loaded model can still reject
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        if not multirun:  # a sweep goes on; its failed row has a record saying why
            sys.exit(1)
        if isinstance(e, RecordNotWritten):
            sweep.note(outcome.get("row_key", ""), "failed", str(e))
        return None
    except RunInterrupted as e:  # a stop signal: this row's record says so; a sweep stops here
        where = f" after {e.progress}" if e.progress else ""
        why = f" ({e.reason})" if e.reason else ""
        rec = f" (record: {e.record})" if e.record else ""
        print(f"interrupted: {e.signame}{why}{where}; stopping{rec}", file=sys.stderr)
        if slurm_job.in_submitit_job():  # one row per job: submitit requeues it, or the job ends with a result
            slurm_job.end_interrupted(e.signum, e.previous)
            return None
        sys.exit(e.exit_code)
    if outcome.get("status"):
        sweep.note(outcome["row_key"], outcome["status"], outcome.get("detail", ""))
    # the first metric is the sweep objective, for Hydra sweepers that optimise one (none: another process has
    # this row's claim)
    return next((v for v in metrics.values() if isinstance(v, float)), None)


def entry() -> None:
    """main(), then a sweep's summary: one line per row, exit status 1 when a row failed or was rejected (printed
    also when a row's interruption ends the sweep, whose exit status stays 128 + the signal)."""
    from kvq_lab.preflight import check_overrides
    from kvq_lab.run import sweep
    from kvq_lab.run.overrides import check_composition

    try:
        check_overrides(sys.argv[1:])  # a renamed knob's old spelling: one line naming the new one, before Hydra
        check_composition(sys.argv[1:], Path(__file__).resolve().parent / "conf")  # unknown keys and options
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except SystemExit as e:
        if e.code not in (0, None):
            sweep.finish()
        raise
    sys.exit(sweep.finish())


if __name__ == "__main__":
    entry()
