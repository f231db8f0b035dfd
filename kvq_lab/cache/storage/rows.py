"""Rows of a left-padded prefill: how many padding positions each row has, and its exact sink tokens.

The packed and recompute layers lay a prefill out the same way (row b: `p_b` padding positions, then its real tokens;
its first `sink_tokens` real tokens kept exact); this is that layout, written once.
"""

from __future__ import annotations

import torch


def left_padded_sinks(padding, sink_tokens: int, *xs: torch.Tensor, what: str) -> tuple[list[int], list[torch.Tensor]]:
    """xs: tensors [B, H, N, D] of one prefill (any H and D: K and V, or the recompute cache's Z [B, 1, N, r]) ->
    (pads, sinks): pads[b] = row b's padding positions (all 0 when `padding` is None or nothing is padded); sinks:
    for each x, its first `sink_tokens` real tokens of every row [B, H, S, D] (a row shorter than S repeats its last
    position; the layer fills the rest as decode steps arrive).

    padding: the cache's `PaddingState` (or None); `what` names the layer in the error a non-left padding raises."""
    B, _, N, _ = xs[0].shape
    real = padding.valid(B, N) if padding is not None else None  # [B, N] bool, or None
    if real is not None:
        if not bool((real[:, 1:] >= real[:, :-1]).all()):
            raise ValueError(f"{what} supports left padding only (attention mask 0...0 1...1 per row)")
        pads = (N - real.sum(1)).tolist()
    else:
        pads = [0] * B
    device = xs[0].device
    idx = (torch.tensor(pads, device=device)[:, None] + torch.arange(sink_tokens, device=device)).clamp(max=N - 1)
    sinks = [x.gather(2, idx[:, None, :, None].expand(B, x.shape[1], sink_tokens, x.shape[3])) for x in xs]
    return pads, sinks
