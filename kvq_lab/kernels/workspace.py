"""Reused scratch memory for decode steps, small constants built once per device, and the version check that lets a
step's answer be given again for an unmodified tensor."""

from __future__ import annotations

import torch

_WORKSPACE: dict = {}
_CONST: dict = {}


def workspace(name: str, numel: int, device, dtype=torch.float32, sliced: bool = True) -> torch.Tensor:
    """A flat scratch buffer [numel] reused by every layer and step (decode working memory, not cache storage: one
    layer's K or V at a time, overwritten by the next layer; reusing it spares a fresh multi-MB allocation, and its
    page faults, per layer per step). Grows by doubling; callers own it until their next call with the same name.
    sliced=False: the whole buffer (>= numel), for a caller that only needs its address (no view made per call)."""
    buf = _WORKSPACE.get((name, device, dtype))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: a buffer born in a task's inference mode would refuse
            # the in-place writes of a later step outside it (one process, several runs or tests)
            buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), device=device, dtype=dtype)
        _WORKSPACE[(name, device, dtype)] = buf
    return buf[:numel] if sliced else buf


def const(name: str, device, make) -> torch.Tensor:
    """Small constant tensors, built once per device by `make()` (avoids an allocation per decode step)."""
    key = (name, device)
    if key not in _CONST:
        with torch.inference_mode(False):  # as workspace: usable in and out of inference mode
            _CONST[key] = make().to(device)
    return _CONST[key]


def version_of(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by in-place writes), or None for an inference tensor, which keeps none: what an
    answer kept for a tensor is checked against before it is given again (an answer for a tensor without a version
    is not given again on identity alone)."""
    try:
        return t._version
    except RuntimeError:
        return None
