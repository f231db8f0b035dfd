"""What ranks a prompt's tokens for a token policy (`kvq_lab.cache.policies`): one score per token of one layer, the
higher the more worth keeping, summed over heads (every head of a layer keeps the same tokens).

- `knorm`: minus the L2 norm of the token's key (Devoto et al. 2024: low-norm keys draw attention; kvpress's
  KnormPress), read from the keys alone.
- `attention`: the attention the token receives from every query of the prompt (H2O's accumulated attention).
- `normalized`: the same divided by the number of queries that can see the token (ZipCache's normalized score: the
  first token is not favoured for being seen by every query).
- `snapkv`: the attention the token receives from the prompt's last `window` queries (SnapKV's observation window),
  smoothed by an average pool of 5 tokens along the sequence (SnapKV's clustering).

The attention scores recompute the prompt's score matrix from the queries and keys the model's attention was given
(`kvq_lab.cache.routing.attention` hands them over after the prefill's SDPA), in blocks of queries so that memory stays
O(block x T); no second forward pass.
"""

from __future__ import annotations

import torch

POOL = 5  # SnapKV's smoothing kernel (tokens)
BLOCK = 256  # queries per block of the score matrix


def knorm(keys: torch.Tensor) -> torch.Tensor:
    """keys [B, Hkv, T, D] -> [B, T]."""
    return -keys.float().norm(dim=-1).sum(1)


def received(query: torch.Tensor, keys: torch.Tensor, scaling: float, first: int = 0) -> torch.Tensor:
    """Attention each key receives from queries [first, T) (causal), summed over queries and heads: query [B, Hq, T,
    D], keys [B, Hkv, T, D] (Hq a multiple of Hkv) -> [B, T]."""
    B, Hq, T, D = query.shape
    k = keys.float().repeat_interleave(Hq // keys.shape[1], dim=1)
    out = torch.zeros(B, T, dtype=torch.float32, device=query.device)
    cols = torch.arange(T, device=query.device)
    for a in range(first, T, BLOCK):
        b = min(a + BLOCK, T)
        logits = (query[:, :, a:b].float() @ k.transpose(-1, -2)) * scaling  # [B, Hq, b - a, T]
        rows = torch.arange(a, b, device=query.device)
        logits = logits.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        out += logits.softmax(-1).sum((1, 2))
    return out


def attention(query, keys, scaling):
    return received(query, keys, scaling)


def normalized(query, keys, scaling):
    T = keys.shape[2]
    seen_by = torch.arange(T, 0, -1, device=keys.device, dtype=torch.float32)  # queries at or after each token
    return received(query, keys, scaling) / seen_by


def snapkv(query, keys, scaling, window: int):
    T = keys.shape[2]
    s = received(query, keys, scaling, first=max(T - window, 0))
    return torch.nn.functional.avg_pool1d(s[:, None], POOL, stride=1, padding=POOL // 2, count_include_pad=False)[:, 0]


def score(name: str, keys: torch.Tensor, query: torch.Tensor | None, scaling: float | None, window: int):
    """The score `name` of every token [B, T]; `query` is needed by all but knorm."""
    if name == "knorm":
        return knorm(keys)
    if query is None:
        raise ValueError(f"score={name} reads the prompt's queries, and none reached the cache")
    if name == "snapkv":
        return snapkv(query, keys, scaling, window)
    return {"attention": attention, "normalized": normalized}[name](query, keys, scaling)
