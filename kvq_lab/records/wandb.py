"""The W&B copy of a run: offline unless configured, opened once the run has ended; record.json stays the source."""

from __future__ import annotations

import os
from pathlib import Path


class WandbMirror:
    """Mirror of a run in W&B; offline unless `mode` says otherwise. Never the only copy: record.json is.

    The runner opens it only once the run has ended (it logs final metrics, tables and figures), so W&B's service
    process lives for seconds, and a run killed mid-way leaves none behind."""

    def __init__(self, logger_cfg: dict, run_name: str, config: dict, run_dir: Path, group: str | None = None):
        import wandb

        mode = logger_cfg.get("mode") or os.environ.get("WANDB_MODE") or "offline"
        self.wandb = wandb
        self.run = wandb.init(
            project=logger_cfg.get("project", "kvq_lab"),
            entity=logger_cfg.get("entity"),
            name=run_name,
            group=group,
            config=config,
            dir=str(run_dir),
            mode=mode,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: dict, tables: dict | None = None, images: dict | None = None) -> None:
        payload = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for name, (columns, rows) in (tables or {}).items():
            payload[name] = self.wandb.Table(columns=columns, data=rows)
        for name, path in (images or {}).items():
            payload[name] = self.wandb.Image(str(path))
        self.run.log(payload)
        self.run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def finish(self, failed: bool = False) -> str:
        path = self.run.dir
        self.run.finish(exit_code=1 if failed else 0)
        return str(Path(path).parent)
