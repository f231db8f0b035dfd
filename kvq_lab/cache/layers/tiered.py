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
`normalized`) get them from the routed attention function (`kvq_lab.cache.routing.attention.kvq_sdpa_attention`), which
hands the layer the prompt's queries and keys right after its SDPA; `knorm` splits at once.

What attention reads afterwards: the tiers' K/V, then the main layer's, concatenated along tokens. Keys are stored
after RoPE (token policies refuse rope=pre), so a token's position lives in its key and the order of the columns
does not matter to attention; the layer reports its columns to the mask with an offset (`get_mask_sizes`) so that
new tokens keep their causal order while every kept token stays visible, and `get_seq_length` counts positions
(dropped tokens included), so position ids go on where the prompt ended.

Left-padded batches: each row is split as its prompt alone would be (`_Row`: its real tokens, its own scores from its
own queries, its own tiers), so rows hold different numbers of tokens. Decode steps hand attention each row's columns
right-aligned in one tensor with the columns a row does not hold marked (`kvq_lab.cache.routing.attention.MaskedKV`),
which the routed attention function masks itself: the model's own mask counts positions, not what each row kept. A batch
therefore needs the routed `sdpa` attention (`QuantizedKVCache.for_model` routes it). No prefix checkpoints
(`prefix_boundary` 0) and no stacking of single-prompt caches.
"""

from __future__ import annotations

import weakref

import torch

from kvq_lab.cache.layers.base import LAYERS, PaddingState, QuantizedLayerBase
from kvq_lab.cache.policies import deal
from kvq_lab.cache.policies.scores import score
from kvq_lab.cache.routing.attention import MaskedKV


class _Row:
    """One prompt of the batch (unpadded, batch 1) under the layer's policy: its exact K/V until the split, then its
    main layer, its filled tiers and what attention reads of them."""

    def __init__(self, owner: TieredLayer):
        self.owner = owner
        self.main = None  # the mode's layer: sinks, the prompt's last window tokens, every later token
        self.tier_layers: list = []  # one filled layer per stored tier
        self.frozen: tuple[torch.Tensor, torch.Tensor] | None = None  # what attention reads of the tiers
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the prompt's exact K/V until it is split
        self.split_sizes: list[int] = []  # tokens per tier (dropped ones included)

    def held(self) -> int:
        """Tokens attention reads (dropped ones not counted)."""
        if self.pending is not None:
            return self.pending[0].shape[2]
        frozen = 0 if self.frozen is None else self.frozen[0].shape[2]
        return frozen + (self.main.get_seq_length() if self.main is not None else 0)

    def split(self, query: torch.Tensor | None, scaling: float | None) -> None:
        """Deal the prompt's tokens to the main layer and the tiers (module docstring)."""
        o = self.owner
        k, v = self.pending
        self.pending = None
        T, S, W = k.shape[2], o.cfg.sink_tokens, o.policy.window
        mid = max(T - S - W, 0)
        sizes = deal([t.share for t in o.tier_specs], mid)
        self.split_sizes = sizes
        self.main = LAYERS[o.cfg.mode](o.main_cfg, None, PaddingState())
        self.main.layer_idx = o.layer_idx
        if not mid:
            self.main.update(k, v)
            return
        s = score(o.policy.score, k, query, scaling, W)[0, S : S + mid]  # [mid]
        order = torch.argsort(s, descending=True, stable=True) + S  # positions, highest score first
        ks, vs, a = [], [], 0
        for tier, size in zip(o.tier_specs, sizes, strict=True):
            pos, a = order[a : a + size].sort().values, a + size  # a tier keeps its tokens in their order
            if tier.config is None or not size:
                continue
            layer = LAYERS[o.cfg.mode](tier.config, None, PaddingState())
            layer.layer_idx = o.layer_idx
            tk, tv = layer.update(k[:, :, pos], v[:, :, pos])  # tier configs read back what they store
            ks.append(tk.clone())
            vs.append(tv.clone())
            self.tier_layers.append(layer)
        if ks:
            self.frozen = (torch.cat(ks, 2), torch.cat(vs, 2))
        keep = torch.cat([torch.arange(S, device=k.device), torch.arange(S + mid, T, device=k.device)])
        self.main.update(k[:, :, keep], v[:, :, keep])

    def step(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens [1, H, n, D] -> what attention reads of this row."""
        mk, mv = self.main.update(k, v)
        if self.frozen is None:
            return mk, mv
        return torch.cat([self.frozen[0], mk.to(self.frozen[0].dtype)], 2), torch.cat([self.frozen[1], mv], 2)

    def nbytes(self) -> int:
        return sum(layer.nbytes()[0] for layer in (self.main, *self.tier_layers) if hasattr(layer, "nbytes"))


class TieredLayer(QuantizedLayerBase):
    """One attention layer under a token policy (module docstring). `N`: positions seen, padding and dropped tokens
    included; `rows`: one `_Row` per prompt of the batch; `pads`: each row's left padding."""

    stackable = False

    @staticmethod
    def stored_bits(cfg, n_tokens: int, shape) -> tuple[float, float]:
        """(keys, values) bits per element of the layer after a prompt of n_tokens: the policy deals the tokens to
        the main layer and the tiers (`Policy.stored_bits`), each counted by the mode's layer."""
        policy = cfg.token_policy()

        def one(j: int) -> float:
            return policy.stored_bits(cfg, n_tokens, lambda c, n: LAYERS[c.mode].stored_bits(c, n, shape)[j])

        return one(0), one(1)

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self.policy = cfg.token_policy()
        self.tier_specs = cfg.tiers()
        self.main_cfg = _main_config(cfg)
        self.rows: list[_Row] = []
        self.pads: list[int] = []
        self.N = 0
        self.routed = False  # attention routed through kvq_sdpa (`prepare_model`): what a batch's decode needs

    # -- hooks ---------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_model(model, cache) -> None:
        """Route an `sdpa` model's attention through `kvq_sdpa` (a batch's decode masks each row's columns there) and
        have each attention module hand its layer the prompt's queries (only scores that read queries need them)."""
        from kvq_lab.cache.routing.attention import route_model

        tiered = [layer for layer in cache.layers if isinstance(layer, TieredLayer)]
        if not tiered or not route_model(model, []):
            return  # another attention implementation: one prompt at a time, and the split says no queries came
        for layer in tiered:
            layer.routed = True
            if layer.policy.needs_queries:
                model.model.layers[layer.layer_idx].self_attn.kvq_observer = weakref.ref(layer)

    @property
    def needs_forward(self) -> bool:
        """Scores that read queries need the prompt's forward through the model (tasks then do not hand over K/V)."""
        return self.policy.needs_queries

    @property
    def pending(self) -> bool:
        """The prompt went through, its split has not."""
        return any(row.pending is not None for row in self.rows)

    @property
    def split_sizes(self) -> list[int]:
        """Tokens per tier of the first row's split (dropped ones included)."""
        return self.rows[0].split_sizes if self.rows else []

    def get_seq_length(self) -> int:
        return self.N

    def held(self) -> int:
        """Columns attention reads: the prompt's positions until the split, then the most any row holds."""
        if self.pending:
            return self.N
        return max((row.held() for row in self.rows), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.held()
        return held + query_length, self.N - held

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        B, H, n, D = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_finite(key_states, value_states)
        if self.N == 0:  # the prompt: attention reads it exactly; each row is split after its forward
            valid = self.padding.valid(B, n) if self.padding is not None else None
            self.pads = [0] * B if valid is None else [n - int(valid[b].sum()) for b in range(B)]
            if valid is not None and not all(bool(valid[b, p:].all()) for b, p in enumerate(self.pads)):
                raise ValueError(f"policy={self.policy.name} takes left-padded batches (padding first in each row)")
            self.N, self.dims = n, (B, H, D)
            self.rows = [_Row(self) for _ in range(B)]
            for b, (row, p) in enumerate(zip(self.rows, self.pads, strict=True)):
                row.pending = (key_states[b : b + 1, :, p:], value_states[b : b + 1, :, p:])
            if not self.policy.needs_queries:
                self.split(None, None)
            return key_states, value_states
        if self.pending:
            raise RuntimeError(
                f"policy={self.policy.name} score={self.policy.score} ranks the prompt by the attention its queries "
                "pay, and they never reached the cache: run the prompt through the model with this cache and "
                "attn_implementation='sdpa' (QuantizedKVCache.for_model routes it), or use policy.score=knorm"
            )
        self.N += n
        outs = [row.step(key_states[b : b + 1], value_states[b : b + 1]) for b, row in enumerate(self.rows)]
        if B == 1:
            return outs[0]
        if not self.routed:
            raise ValueError(
                f"policy={self.policy.name} decodes a batch through the routed sdpa attention (each row holds its own "
                "tokens); build the cache with QuantizedKVCache.for_model on an sdpa model, or use batch_size=1"
            )
        S = max(k.shape[2] for k, _ in outs)
        k0, v0 = outs[0]
        keys, values = k0.new_zeros(B, H, S, D), v0.new_zeros(B, H, S, v0.shape[-1])
        valid = torch.zeros(B, S, dtype=torch.bool, device=k0.device)
        for b, (k, v) in enumerate(outs):
            keys[b, :, S - k.shape[2] :], values[b, :, S - v.shape[2] :] = k[0], v[0]
            valid[b, S - k.shape[2] :] = True
        handle = MaskedKV(keys, values, valid)
        return handle, handle

    def wants_queries(self, query: torch.Tensor) -> bool:
        """Whether `observe` should be given this forward's queries: the prompt's, before its split."""
        return self.pending and query.shape[2] == self.N

    def observe(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """The prompt's queries [B, Hq, T, D] and keys (as attention read them), right after its forward."""
        self.split(query, scaling)

    def split(self, query: torch.Tensor | None, scaling: float | None) -> None:
        """Each row's prompt dealt to its main layer and tiers (`_Row.split`), with its own queries."""
        for b, (row, p) in enumerate(zip(self.rows, self.pads, strict=True)):
            row.split(None if query is None else query[b : b + 1, :, p:], scaling)

    def prefix_boundary(self, n: int) -> int:
        return 0

    # -- accounting ----------------------------------------------------------------------------------------------
    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): what the rows' main layers and stored tiers hold (packed mode; simulated layers store
        none), and the fp16 K/V of every position seen, padding and dropped tokens included."""
        if self.pending or not self.rows:
            return 0, 0
        B, H, D = self.dims
        return sum(row.nbytes() for row in self.rows), 2 * 2 * B * H * self.N * D


def _main_config(cfg):
    from dataclasses import replace

    return replace(cfg, policy="kivi", policy_options=(), skip_layers=(), layers=())
