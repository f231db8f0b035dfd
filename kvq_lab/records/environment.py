"""What a record says about where it was made: library versions, the git commit (with `-dirty`), device, host."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

CODE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".cu", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini"}
CODE_DIRS = ("kvq_lab/", "conf/", "hydra_plugins/")  # every file under these counts, whatever its suffix


def counts_as_code(path: str) -> bool:
    """Whether a change to this tracked file can change what a run computes: anything under the package, conf/ or
    hydra_plugins/, and source files (by suffix, or a Makefile) elsewhere. A study's outputs (its tables, plans,
    figures, logs, READMEs) do not: a study that rewrites its own plan.json while it runs stays clean."""
    return path.startswith(CODE_DIRS) or Path(path).suffix in CODE_SUFFIXES or Path(path).name == "Makefile"


def git_hash() -> str:
    """Commit of the kvq_lab checkout, with `-dirty` when a tracked file that counts as code (`counts_as_code`)
    differs from it."""
    root = Path(__file__).resolve().parents[2]  # the checkout: kvq_lab/records/environment.py -> ../..
    try:
        h = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if h.returncode:
            return "unknown"
        d = subprocess.run(
            ["git", "status", "--porcelain", "-uno", "-z"], cwd=root, capture_output=True, text=True, timeout=10
        )
        changed = _porcelain_paths(d.stdout)
        return h.stdout.strip() + ("-dirty" if any(counts_as_code(p) for p in changed) else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _porcelain_paths(z: str) -> list[str]:
    """The paths of `git status --porcelain -z`: "XY path" entries, a rename's or copy's source in the next entry."""
    out, parts, i = [], z.split("\0"), 0
    while i < len(parts):
        entry = parts[i]
        i += 1
        if len(entry) < 4:
            continue
        out.append(entry[3:])
        if entry[0] in "RC":  # the source path follows as its own entry
            out.append(parts[i])
            i += 1
    return out


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
