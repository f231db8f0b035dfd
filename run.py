"""kvq_lab entry point.

python run.py key_axis=channel value_axis=token            # one run (defaults: conf/config.yaml)
python run.py -m key_axis=channel,token value_axis=channel,token   # grid sweep, 4 runs
python run.py -m experiment=kivi_axis_table                # a saved study (conf/experiment/)
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("WANDB_MODE", "offline")  # no network by default; `wandb sync` uploads later
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from kvq_lab.config import ConfigError, register_schema  # noqa: E402

register_schema()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvq_lab.runner import RunFailed, RunInterrupted, run

    logging.getLogger("kvq_lab").setLevel(logging.INFO)
    for noisy in ("lm_eval", "lm_eval.models.huggingface", "lm_eval.tasks._index", "lm_eval.api.task"):
        logging.getLogger(noisy).setLevel(logging.ERROR)  # progress bars remain; config chatter goes
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    # a sweep's id (its start time): groups its rows in W&B when no experiment_name names them
    sweep = f"sweep-{os.path.basename(str(hc.sweep.dir))}" if multirun else None
    try:
        metrics = run(cfg, sweep=sweep)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        return None  # one invalid row (e.g. group_size=128 on head_dim 64) does not end the sweep
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        if not multirun:  # a sweep goes on; its failed row has a record saying why
            sys.exit(1)
        return None
    except RunInterrupted as e:  # SIGINT/SIGTERM: this row's record says so; a sweep stops here
        where = f" after {e.progress}" if e.progress else ""
        rec = f" (record: {e.record})" if e.record else ""
        print(f"interrupted: {e.signame}{where}; stopping{rec}", file=sys.stderr)
        sys.exit(e.exit_code)
    # the first metric is the sweep objective, for Hydra sweepers that optimise one (none: another process has
    # this row's claim)
    return next((v for v in metrics.values() if isinstance(v, float)), None)


if __name__ == "__main__":
    main()
