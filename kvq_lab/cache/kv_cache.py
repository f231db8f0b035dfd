"""`QuantizedKVCache`, the `transformers.Cache` of kvq_lab, and the one module that assembles the cache layers.

Layer modules register themselves with `base.register_layer` when imported; importing them here (and nowhere in the
registry) is what makes every `CacheConfig.mode` available. A new mode is one new layer module plus one import line.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from kvq_lab.cache.accounting import Shape, format_bits
from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.layers import packed, recompute, simulated  # noqa: F401  (importing one registers its mode)
from kvq_lab.cache.layers.base import LAYERS, PaddingState
from kvq_lab.cache.layers.heads import HeadsLayer
from kvq_lab.cache.layers.tiered import TieredLayer
from kvq_lab.cache.routing.rope import RopeHelper

__all__ = ["LAYERS", "QuantizedKVCache"]


def layer_class(cfg: CacheConfig):
    """The layer of a decoder layer's config: the mode's, or under a token policy the tiered one, or with per-head
    bits the heads one (both build the mode's layers inside them)."""
    if cfg.head_bits:
        return HeadsLayer
    return TieredLayer if cfg.splits_tokens else LAYERS[cfg.mode]


class QuantizedKVCache(Cache):
    """A `transformers.Cache` with independent key/value quantizers: `model.generate(..., past_key_values=cache)`.

    One layer object per decoder layer, of the class registered for `cfg.mode` (a token policy's: `TieredLayer`;
    per-head bits: `HeadsLayer`; both hold layers of that class). Build it with `QuantizedKVCache.for_model(model,
    cfg)`; a cache holds one generation's state, so make a fresh one per call.
    """

    def __init__(self, cfg: CacheConfig, num_layers: int, rotary_emb: torch.nn.Module | None = None):
        if cfg.mode not in LAYERS:
            raise ValueError(f"no cache layer registered for mode={cfg.mode!r}; have {sorted(LAYERS)}")
        if cfg.rope == "pre" and rotary_emb is None:
            raise ValueError("rope=pre needs the model's rotary embedding module (use QuantizedKVCache.for_model)")
        self.cfg = cfg
        self.padding = PaddingState()
        rope = RopeHelper(rotary_emb) if rotary_emb is not None else None
        # each layer's own config where calibration fitted one per layer (nuq codebooks, fitted transforms)
        layers = [layer_class(cfg.for_layer(i))(cfg.for_layer(i), rope, self.padding) for i in range(num_layers)]
        for i, layer in enumerate(layers):
            layer.layer_idx = i
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model, cfg: CacheConfig) -> QuantizedKVCache:
        text_cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        cfg.check_head_dim(head_dim)
        cfg.check_heads(text_cfg.num_key_value_heads, f"{type(model).__name__}")
        if cfg.skip_layers:  # skip_layers=sliding_window names the model's own (run.py resolved it from its files)
            types = getattr(text_cfg, "layer_types", None) or []
            sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            cfg = cfg.resolve_layers(sliding, text_cfg.num_hidden_layers, type(model).__name__)
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        cache = cls(cfg, text_cfg.num_hidden_layers, rotary_emb=rotary)
        for klass in {LAYERS[cfg.mode], *(type(layer) for layer in cache.layers)}:
            prepare = getattr(klass, "prepare_model", None)  # e.g. packed: route decode attention to it
            if prepare is not None:
                prepare(model, cache)
        return cache

    @staticmethod
    def stored_bits(cfg: CacheConfig, n_tokens: int, model=None) -> dict[str, float]:
        """What a cache of `cfg` stores for a sequence of n_tokens (the task's, `Task.cached_tokens`), each layer's
        count by its own kind (`stored_bits` of the mode's, tiered or heads layer; `kvq_lab.cache.accounting`), over
        the model's layers and shape (None: one head of 64, one layer per fitted config; a `Shape`: a model's shape
        read from its files, counted before it loads):
        `cache/bits_key`, `cache/bits_value`, `cache/bits` (the format's own cost), `cache/bits_total_key`,
        `cache/bits_total_value`, `cache/bits_total` (their mean: everything stored, per K/V element) and
        `cache/bits_tokens`. A mode that caches one tensor instead of K and V (`Capabilities.stores_kv` False) has
        no per-tensor numbers: `cache/bits_total` and `cache/bytes_per_token` (per token and layer) from its bytes."""
        if isinstance(model, Shape):
            shape = model
        else:
            shape = Shape.of(model) if model is not None else Shape(layers=max(1, len(cfg.layers)))
        configs = [cfg.for_layer(i) for i in range(shape.layers)]
        n = n_tokens
        if not cfg.caps.stores_kv:
            stored = sum(LAYERS[c.mode].stored_bytes(c, n, shape) for c in configs)
            elements = shape.layers * 2 * shape.heads * n * shape.head_dim  # the same tokens as K and V
            return {
                "cache/bits_total": 8 * stored / elements,
                "cache/bytes_per_token": stored / (n * shape.layers),
                "cache/bits_tokens": float(n),
            }
        out = format_bits(cfg)
        per = [layer_class(c).stored_bits(c, n, shape) for c in configs]
        for j, tensor in enumerate(("key", "value")):
            out[f"cache/bits_total_{tensor}"] = sum(p[j] for p in per) / len(per)
        out["cache/bits_total"] = (out["cache/bits_total_key"] + out["cache/bits_total_value"]) / 2
        out["cache/bits_tokens"] = float(n)
        return out

    @property
    def needs_forward(self) -> bool:
        """Filled only through the model's forward (mode=recompute caches the attention's input X, which `update`
        alone does not carry): callers that hand K/V to `update` directly must run the model instead."""
        return any(getattr(layer, "needs_forward", False) for layer in self.layers)

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the prompt's padding ([B, T0], 1 = token) so pad positions never enter a group's min/max."""
        self.padding.prompt_mask = None if attention_mask is None else attention_mask.detach()

    @property
    def stackable(self) -> bool:
        """`stack` can join caches like this one into a batch (every layer class implements it)."""
        return all(layer.stackable for layer in self.layers)

    @classmethod
    def stack(cls, rows: list[QuantizedKVCache]) -> QuantizedKVCache:
        """Caches of one prompt each (batch 1, unpadded, filled, any lengths) -> one cache of the left-padded batch of
        those prompts (row b padded by the longest length minus its own), holding for each row what the row's cache
        held: decode then goes on in one batch, each row as it would alone (a left-padded batch's guarantee, up to
        the model's batched arithmetic). The rows are consumed (their state moves into the result)."""
        lengths = [r.get_seq_length() for r in rows]
        if min(lengths) < 1:
            raise ValueError("stack takes filled caches (every row holds at least one token)")
        T = max(lengths)
        pads = [T - n for n in lengths]
        out = copy.copy(rows[0])
        out.padding = PaddingState()
        device = rows[0].layers[0].keys.device
        out.set_padding(torch.stack([torch.arange(T, device=device) >= p for p in pads]).long())
        out.layers = [
            type(layer).stack([r.layers[i] for r in rows], pads, out.padding) for i, layer in enumerate(rows[0].layers)
        ]
        return out

    def select_rows(self, rows: list[int]) -> None:
        """Keep batch rows `rows` of a stacked cache, in that order: a finished generation leaves the batch, and the
        others decode on as they would (each row has its own quantization state)."""
        mask = self.padding.prompt_mask
        self.padding = PaddingState()
        self.set_padding(None if mask is None else mask[rows])
        for layer in self.layers:
            layer.select_rows(rows, self.padding)

    def batch_mask(self) -> torch.Tensor:
        """[B, T] long, 1 = a real token, of every position the cache holds (a stacked batch's left padding is 0)."""
        B, T = self.layers[0].keys.shape[0], self.get_seq_length()
        valid = self.padding.valid(B, T)
        return torch.ones(B, T, dtype=torch.long, device=self.layers[0].keys.device) if valid is None else valid.long()

    def admit(self, slot: int, row: QuantizedKVCache) -> None:
        """Put the single prompt `row` (filled, unpadded, batch 1) into batch row `slot` of this stacked cache, in place
        of the row there (a finished generation): left-padded to the batch's length, or, where it is longer, every
        other row padded further on the left. It decodes on as it would alone, as after `stack`; the others as
        before. Continuous batching (`kvq_lab.lmeval.wrapper`) keeps the batch full with it. The row is consumed."""
        B, T, n = self.layers[0].keys.shape[0], self.get_seq_length(), row.get_seq_length()
        if not 0 <= slot < B:
            raise ValueError(f"slot {slot} is not a row of this batch of {B}")
        grow = max(n - T, 0)
        mask = torch.nn.functional.pad(self.batch_mask(), (grow, 0))
        mask[slot] = (torch.arange(T + grow, device=mask.device) >= T + grow - n).long()
        self.padding.prompt_mask = mask
        for i, layer in enumerate(self.layers):
            layer.admit(slot, row.layers[i], grow, self.padding)

    def trim_padding(self) -> int:
        """Drop the leading columns that are padding in every row of a stacked batch (left when its longest rows
        leave) -> how many: attention no longer reads them."""
        mask = self.batch_mask()
        k = int((mask.cumsum(1) == 0).all(0).sum())
        k = min(k, mask.shape[1] - 1)
        if k > 0:
            self.padding.prompt_mask = mask[:, k:]
            for layer in self.layers:
                layer.drop_left(k, self.padding)
        return k

    def prefix_boundary(self, n: int) -> int:
        """Where the first n tokens of a prompt may be cut so that this cache, filled with the tokens before the cut
        and then with the rest, holds what it holds after the whole prompt (`QuantizedLayerBase.prefix_boundary`);
        0 where only the empty prefix qualifies."""
        return min(layer.prefix_boundary(n) for layer in self.layers)

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the cache: `stored` (as kept) and `fp16` (the same tokens as an fp16 cache)."""
        stored = fp16 = 0
        for layer in self.layers:
            s, f = layer.nbytes() if hasattr(layer, "nbytes") else (0, 0)
            stored += s
            fp16 += f
        return {"stored": stored, "fp16": fp16}
