"""Run records: one immutable `record.json` per run, a summary over all runs, and the W&B mirror.

Layout: `<results_dir>/runs/<run name>/record.json` (+ any artifacts the task wrote beside it). A record holds
`config` (resolved), `config_hash`, `metrics` (flat, e.g. `coqa_turns/f1`), `env` (versions, git hash,
device), `timings` and `status` (`ok` | `failed`, with `error`). Records are written atomically (temp file +
rename) and a run never reuses another run's folder.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

RECORD = "record.json"


def git_hash() -> str:
    """Commit of the kvq_lab checkout, with `-dirty` when tracked files differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        h = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if h.returncode:
            return "unknown"
        d = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True, timeout=10
        )
        return h.stdout.strip() + ("-dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str = "cpu") -> dict[str, Any]:
    import torch

    versions = {}
    for pkg in ("kvq_lab", "torch", "transformers", "lm_eval", "hydra-core", "triton", "datasets", "wandb"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "versions": versions,
        "python": platform.python_version(),
        "git": git_hash(),
        "device": device if device != "cuda" else torch.cuda.get_device_name(0),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "platform": platform.platform(),
    }


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; records are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def new_run_dir(results_dir: Path, name: str) -> Path:
    """A fresh folder `<results_dir>/runs/<timestamp>_<name>[_k]`: created exclusively, never shared."""
    runs = results_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        d = runs / (f"{stamp}_{name}" + (f"_{k}" if k else ""))
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run folder under {runs}")


def load_records(results_dir: Path) -> list[dict]:
    """Every record under `<results_dir>/runs`, oldest first; unreadable files are skipped with a note."""
    out = []
    for p in sorted((Path(results_dir) / "runs").glob(f"*/{RECORD}")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping unreadable record {p}: {e}")
            continue
        rec["_path"] = str(p.parent)
        out.append(rec)
    return out


def find_completed(results_dir: Path, config_hash: str) -> dict | None:
    """The newest successful record with this config hash, if any (used to skip finished sweep rows)."""
    done = [r for r in load_records(results_dir) if r.get("config_hash") == config_hash and r.get("status") == "ok"]
    return done[-1] if done else None


class Timer:
    """`with timer("task_s"): ...` records the block's wall time (seconds) in `timer.t`, even if it raises."""

    def __init__(self):
        self.t = {}

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] = round(time.perf_counter() - t0, 3)


class WandbMirror:
    """Mirror of a run in W&B; offline unless `mode` says otherwise. Never the only copy: record.json is."""

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
