"""The 16-bit reference a task compares caches against, computed once per model, text and protocol and kept on disk.

`task=fidelity` compares every row's next-token distributions with the 16-bit model's over the same tokens. A sweep
runs its rows in separate processes (and a SLURM array on separate hosts), so the reference lives in
`~/.cache/kvq_lab/reference/<key>.pt` ($KVQ_REFERENCE_CACHE), written with its digest beside it and verified on
every read (`kvq_lab.common.integrity`: a changed or truncated file is named, removed and computed again).

The key (`reference_key`) is a hash over everything the reference depends on, so that a different text or model
never reuses one: the model's weights themselves (their bytes, dtypes and shapes: a hub id whose `main` moved, or a
re-converted GGUF, is a different model), the token ids, the protocol and its settings, the device type, torch and
transformers versions, the attention implementation, and kvq_lab's code version.

What is stored: the log-probabilities at the scored positions only, in float32. float16 would halve the file but
move the 16-bit row off an exact KL of 0 (its log-probs round differently from the fp32 ones the cache's rows
produce); the scored positions are what compactness can take without touching a number. The folder is kept under
$KVQ_REFERENCE_CACHE_GB (default 8) by removing the least recently used files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = 1  # what a file holds; bump when it changes
_MEMO: dict[str, Any] = {}  # one entry: key -> log-probs (a sweep's rows in one process share one text)
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its weights' digest


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_REFERENCE_CACHE", Path.home() / ".cache" / "kvq_lab" / "reference"))


def budget_bytes() -> int:
    return int(float(os.environ.get("KVQ_REFERENCE_CACHE_GB", "8")) * 2**30)


def weights_digest(model) -> str:
    """sha256 (16 hex) over the model's parameters and buffers: names, dtypes, shapes and bytes (once per model
    object in a process)."""
    import torch

    if model in _WEIGHTS:
        return _WEIGHTS[model]
    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    digest = h.hexdigest()[:16]
    _WEIGHTS[model] = digest
    return digest


def reference_key(model, ids: torch.Tensor, protocol: dict[str, Any]) -> str:
    """Hash of what the reference over `ids` depends on (see the module doc); 16 hex."""
    import torch
    import transformers

    from kvq_lab.records.provenance import code_version

    what = {
        "format": FORMAT,
        "weights": weights_digest(model),
        "ids": hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest(),
        "ids_shape": list(ids.shape),
        "protocol": protocol,
        "device": model.device.type,
        "dtype": str(next(model.parameters()).dtype),
        "attention": getattr(model.config, "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": code_version(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read(path: Path) -> torch.Tensor | None:
    import torch

    from kvq_lab.common import integrity

    if not path.is_file():
        return None
    try:
        saved = torch.load(io.BytesIO(integrity.read_verified(path)), weights_only=True)
    except integrity.Corrupt as e:
        integrity.note_rebuild(e, "computing the 16-bit reference again")
        integrity.remove(path)
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:
        pass
    return saved["logprobs"]


def _prune(keep: Path) -> None:
    """Remove the least recently used references until the folder is under its budget (never `keep`)."""
    from kvq_lab.common import integrity

    files = sorted(cache_dir().glob("*.pt"), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    for p in files:
        if total <= budget_bytes():
            break
        if p != keep:
            total -= p.stat().st_size
            integrity.remove(p)


def _write(path: Path, logprobs: torch.Tensor, protocol: dict[str, Any]) -> None:
    import sys

    import torch

    from kvq_lab.common import integrity

    buf = io.BytesIO()
    torch.save({"logprobs": logprobs.contiguous().cpu(), "protocol": protocol}, buf)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        integrity.write_verified(path, buf.getvalue())
        _prune(keep=path)
    except OSError as e:  # a read-only or full disk costs only the reuse across processes
        print(f"note: the 16-bit reference is not kept on disk ({e}); set KVQ_REFERENCE_CACHE", file=sys.stderr)


def stored_reference(
    model, ids: torch.Tensor, protocol: dict[str, Any], compute: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The 16-bit reference log-probs over `ids` under `protocol`: from this process's memo, else from the disk
    cache, else `compute()` (then kept in both). On the model's device."""
    key = reference_key(model, ids, protocol)
    if key in _MEMO:
        return _MEMO[key]
    _MEMO.clear()  # one text at a time: fp32 log-probs over the vocabulary are hundreds of MB
    path = cache_dir() / f"{key}.pt"
    logprobs = _read(path)
    if logprobs is None:
        logprobs = compute()
        _write(path, logprobs, protocol)
    _MEMO[key] = logprobs.to(model.device)
    return _MEMO[key]
