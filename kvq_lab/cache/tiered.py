"""The cache layer of token policies (`kvq_lab.cache.policies.TokenPolicy`): the prompt split into tiers once it has
been through the model, each tier stored by the mode's own layer.

Until the prompt's forward is over the layer holds its exact K/V and hands them to attention (the prefill reads what
the model computed, as SnapKV and MiKV do). Then it splits them (`split`): the first `sink_tokens` and the last
`policy.window` tokens go to the main layer, a layer of the cache's mode with the policy `kivi` (exact sinks, and in
packed mode its streaming window), which also takes every later token; the tokens between them are ranked by the
policy's score (`kvq_lab.cache.policies.scores`) and dealt to the policy's tiers in rank order, the top `share` to
the first tier, and so on. A tier is one more layer of the cache's mode at the tier's quantizer (no sinks, no
window, its tokens in their original order), filled once and never updated again, so what attention reads of it is
made once; a tier whose config is None is dropped (eviction). Scores that read queries (`attention`, `snapkv`,
`normalized`) get them from the routed attention function (`kvq_lab.cache.attention.kvq_sdpa_attention`), which
hands the layer the prompt's queries and keys right after its SDPA; `knorm` splits at once.

What attention reads afterwards: the tiers' K/V, then the main layer's, concatenated along tokens. Keys are stored
after RoPE (token policies refuse rope=pre), so a token's position lives in its key and the order of the columns
does not matter to attention; the layer reports its columns to the mask with an offset (`get_mask_sizes`) so that
new tokens keep their causal order while every kept token stays visible, and `get_seq_length` counts positions
(dropped tokens included), so position ids go on where the prompt ended.

One prompt at a time (batch 1, unpadded); no prefix checkpoints (`prefix_boundary` 0).
"""

from __future__ import annotations

import weakref

import torch

from .base import LAYERS, PaddingState, QuantizedLayerBase
from .policies import deal
from .policies.scores import score


class TieredLayer(QuantizedLayerBase):
    """One attention layer under a token policy (module docstring). `N`: positions seen, dropped tokens included."""

    stackable = False

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self.policy = cfg.token_policy()
        self.tier_specs = cfg.tiers()
        self.main_cfg = _main_config(cfg)
        self.main = None  # the mode's layer: sinks, the prompt's last window tokens, every later token
        self.tier_layers: list = []  # one filled layer per stored tier
        self.frozen: tuple[torch.Tensor, torch.Tensor] | None = None  # what attention reads of the tiers
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the prompt's exact K/V until it is split
        self.N = 0
        self.split_sizes: list[int] = []  # tokens per tier of the latest split (dropped ones included)

    # -- hooks ---------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_model(model, cache) -> None:
        """Route an `sdpa` model's attention through `kvq_sdpa` and have each attention module hand its layer the
        prompt's queries (only scores that read queries need them)."""
        from .attention import route_model

        tiered = [layer for layer in cache.layers if isinstance(layer, TieredLayer)]
        if not any(layer.policy.needs_queries for layer in tiered):
            return
        if not route_model(model, []):
            return  # another attention implementation: the split says the queries never came
        for layer in tiered:
            module = model.model.layers[layer.layer_idx].self_attn
            module.kvq_observer = weakref.ref(layer)

    @property
    def needs_forward(self) -> bool:
        """Scores that read queries need the prompt's forward through the model (tasks then do not hand over K/V)."""
        return self.policy.needs_queries

    def get_seq_length(self) -> int:
        return self.N

    def held(self) -> int:
        """Tokens attention reads (dropped ones not counted)."""
        if self.pending is not None:
            return self.pending[0].shape[2]
        frozen = 0 if self.frozen is None else self.frozen[0].shape[2]
        return frozen + (self.main.get_seq_length() if self.main is not None else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.held()
        return held + query_length, self.N - held

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        B, _, n, _ = key_states.shape
        if B != 1 or (self.padding is not None and self.padding.valid(B, self.N + n) is not None):
            raise ValueError(f"policy={self.policy.name} runs one unpadded prompt at a time (batch_size=1)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_finite(key_states, value_states)
        if self.N == 0:  # the prompt: attention reads it exactly; it is split after its forward
            self.N, self.dims = n, (B, key_states.shape[1], key_states.shape[3])
            self.pending = (key_states, value_states)
            if not self.policy.needs_queries:
                self.split(None, None)
            return key_states, value_states
        if self.pending is not None:
            raise RuntimeError(
                f"policy={self.policy.name} score={self.policy.score} ranks the prompt by the attention its queries "
                "pay, and they never reached the cache: run the prompt through the model with this cache and "
                "attn_implementation='sdpa' (QuantizedKVCache.for_model routes it), or use policy.score=knorm"
            )
        self.N += n
        mk, mv = self.main.update(key_states, value_states)
        if self.frozen is None:
            return mk, mv
        return torch.cat([self.frozen[0], mk.to(self.frozen[0].dtype)], 2), torch.cat([self.frozen[1], mv], 2)

    def wants_queries(self, query: torch.Tensor) -> bool:
        """Whether `observe` should be given this forward's queries: the prompt's, before its split."""
        return self.pending is not None and query.shape[2] == self.pending[0].shape[2]

    def observe(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """The prompt's queries [B, Hq, T, D] and keys (as attention read them), right after its forward."""
        self.split(query, scaling)

    def split(self, query: torch.Tensor | None, scaling: float | None) -> None:
        """Deal the prompt's tokens to the main layer and the tiers (module docstring)."""
        k, v = self.pending
        self.pending = None
        T, S, W = k.shape[2], self.cfg.sink_tokens, self.policy.window
        mid = max(T - S - W, 0)
        sizes = deal([t.share for t in self.tier_specs], mid)
        self.split_sizes = sizes
        self.main = LAYERS[self.cfg.mode](self.main_cfg, None, PaddingState())
        self.main.layer_idx = self.layer_idx
        if not mid:
            self.main.update(k, v)
            return
        s = score(self.policy.score, k, query, scaling, W)[0, S : S + mid]  # [mid]
        order = torch.argsort(s, descending=True, stable=True) + S  # positions, highest score first
        ks, vs, a = [], [], 0
        for tier, size in zip(self.tier_specs, sizes, strict=True):
            pos, a = order[a : a + size].sort().values, a + size  # a tier keeps its tokens in their order
            if tier.config is None or not size:
                continue
            layer = LAYERS[self.cfg.mode](tier.config, None, PaddingState())
            layer.layer_idx = self.layer_idx
            tk, tv = layer.update(k[:, :, pos], v[:, :, pos])  # tier configs read back what they store
            ks.append(tk.clone())
            vs.append(tv.clone())
            self.tier_layers.append(layer)
        if ks:
            self.frozen = (torch.cat(ks, 2), torch.cat(vs, 2))
        keep = torch.cat([torch.arange(S, device=k.device), torch.arange(S + mid, T, device=k.device)])
        self.main.update(k[:, :, keep], v[:, :, keep])

    def prefix_boundary(self, n: int) -> int:
        return 0

    # -- accounting ----------------------------------------------------------------------------------------------
    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): what the main layer and the stored tiers hold (packed mode; simulated layers store none),
        and the fp16 K/V of every position seen, dropped tokens included."""
        if self.pending is not None or self.main is None:
            return 0, 0
        stored = sum(layer.nbytes()[0] for layer in (self.main, *self.tier_layers) if hasattr(layer, "nbytes"))
        B, H, D = self.dims
        return stored, 2 * 2 * B * H * self.N * D


def _main_config(cfg):
    from dataclasses import replace

    return replace(cfg, policy="kivi", policy_options=(), skip_layers=(), layers=())
