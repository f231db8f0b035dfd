"""What a record says about where it was made: library versions, the git commit (with `-dirty`), device, host."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def git_hash() -> str:
    """Commit of the kvq_lab checkout, with `-dirty` when tracked files differ from it."""
    root = Path(__file__).resolve().parents[2]  # the checkout: kvq_lab/records/environment.py -> ../..
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
        "pid": os.getpid(),
        "platform": platform.platform(),
    }
