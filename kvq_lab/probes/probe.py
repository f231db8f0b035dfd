"""Run the probes over prompts: capture once per prompt (exact forward pass), measure every layer offline.

`probe_model(...) -> ProbeResult`: per-layer/head tables averaged over prompts (each prompt weighs the same).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.routing.rope import RopeHelper

from .capture import capture_qkv
from .errors import layer_errors
from .settings import ProbeSettings

log = logging.getLogger("kvq_lab")


@dataclass
class ProbeResult:
    """tables[quantity][definition]: tensor [L, heads] (mean over prompts). heads = H_kv for key/value, else H."""

    tables: dict[str, dict[str, torch.Tensor]]
    n_prompts: int
    tokens: list[int] = field(default_factory=list)  # length of each measured prompt
    num_heads: int = 0
    num_kv_heads: int = 0
    windows: list[int | None] = field(default_factory=list)  # per layer: its sliding window, None = global

    def attention_kind(self, layer: int) -> str:
        """`sliding <window>` or `global`: what the layer's queries attend to."""
        w = self.windows[layer] if layer < len(self.windows) else None
        return "global" if w is None else f"sliding {w}"

    def mean(self, quantity: str, definition: str) -> float:
        """Mean over layers and heads (KIVI Table 2's average)."""
        return float(self.tables[quantity][definition].mean())


def tokenize(tokenizer, prompts: list[str], max_tokens: int, keep: str = "head") -> list[torch.Tensor]:
    """Token ids [1, T] per prompt, truncated to max_tokens (keep the `head` or the `tail` of a long prompt)."""
    out = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        if ids.shape[-1] > max_tokens:
            ids = ids[:, :max_tokens] if keep == "head" else ids[:, -max_tokens:]
        if ids.shape[-1] >= 2:
            out.append(ids)
    return out


def probe_model(
    model, input_ids: list[torch.Tensor], cache: CacheConfig, settings: ProbeSettings | None = None
) -> ProbeResult:
    """Measure the cache config's key/value quantizers on each prompt [1, T] at every layer of `model`."""
    settings = settings or ProbeSettings()
    if not input_ids:
        raise ValueError("no prompts to probe")
    text_cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    cache.check_head_dim(head_dim)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    rope = RopeHelper(rotary) if rotary is not None else None
    device = next(model.parameters()).device

    sums: dict[str, dict[str, torch.Tensor]] = {}
    tokens: list[int] = []
    windows: list[int | None] = []
    for i, ids in enumerate(input_ids):
        caps = capture_qkv(model, ids.to(device))
        per_layer = [layer_errors(c, cache.for_layer(i), settings, rope) for i, c in enumerate(caps)]  # per-layer specs
        windows = [c.window for c in caps]
        del caps
        for qname in per_layer[0]:
            for d in per_layer[0][qname]:
                t = torch.stack([pl[qname][d] for pl in per_layer]).cpu()  # [L, heads]
                acc = sums.setdefault(qname, {})
                acc[d] = t if d not in acc else acc[d] + t
        tokens.append(int(ids.shape[-1]))
        log.info("probe %d/%d: %d tokens", i + 1, len(input_ids), ids.shape[-1])
    n = len(input_ids)
    tables = {q: {d: t / n for d, t in ds.items()} for q, ds in sums.items()}
    return ProbeResult(tables, n, tokens, text_cfg.num_attention_heads, text_cfg.num_key_value_heads, windows)
