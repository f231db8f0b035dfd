"""Shared machinery of kvq_lab's cache layers and the `QuantizedKVCache` container."""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .config import CacheConfig
from .rope import RopeHelper, position_ids_from


class NonFiniteError(FloatingPointError):
    """NaN or inf reached the cache; the message names the layer and the step."""


class PaddingState:
    """Which positions of a left-padded batch are real tokens, shared by all layers of one cache.

    `prompt_mask` [B, T0] (1 = token, 0 = padding) covers the prompt; every later position is a real token.
    """

    def __init__(self):
        self.prompt_mask: torch.Tensor | None = None

    def valid(self, batch: int, length: int) -> torch.Tensor | None:
        """[B, length] bool, or None when nothing is padded."""
        m = self.prompt_mask
        if m is None or bool(m.all()):
            return None
        if m.shape[0] != batch:
            raise ValueError(f"padding mask has batch {m.shape[0]} but the cache sees batch {batch}")
        m = m.to(torch.bool)
        if length <= m.shape[1]:
            return m[:, :length]
        return torch.cat([m, m.new_ones(batch, length - m.shape[1])], dim=1)


class QuantizedLayerBase(DynamicLayer):
    """Base of kvq_lab cache layers: holds the config, the RoPE helper (rope=pre) and the padding state.

    `self.keys` / `self.values` follow `DynamicLayer`'s meaning where a subclass keeps exact tensors; subclasses
    that store codes override `get_seq_length`.
    """

    is_croppable = False

    def __init__(self, cfg: CacheConfig, rope: RopeHelper | None = None, padding: PaddingState | None = None):
        super().__init__()
        self.cfg = cfg
        # 16-bit keys are stored as they are: a RoPE round trip would only add rounding error
        self.rope = rope if cfg.rope == "pre" and not cfg.key.is_identity else None
        self.padding = padding
        self.layer_idx = -1
        self.steps = 0

    def rope_cos_sin(self, key_states: torch.Tensor, start: int, kwargs: dict):
        B, _, T, _ = key_states.shape
        pos = position_ids_from(kwargs, B, start, T, key_states.device)
        return self.rope.cos_sin(key_states, pos)

    def check_finite(self, *tensors: torch.Tensor) -> None:
        """NaN or inf in any of the tensors raises `NonFiniteError` naming this layer and step. One fp32 sum per
        tensor (non-finite exactly when an element is, short of fp32 overflow, ~3e38) instead of an elementwise
        pass: this runs for every layer at every decode step."""
        self.steps += 1
        for t in tensors:
            if not math.isfinite(float(t.sum(dtype=torch.float32))):
                raise NonFiniteError(
                    f"non-finite value (NaN/inf) in the KV cache at layer {self.layer_idx}, step {self.steps - 1} "
                    f"(cache {self.cfg.label()}); check the model dtype and the quantizer range"
                )

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvq_lab caches support greedy and sampling decoding, not beam search")


LAYERS: dict[str, type[QuantizedLayerBase]] = {}


def register_layer(mode: str):
    """Register a cache layer class for `CacheConfig.mode`: one new file plus this decorator adds a mode."""

    def deco(cls):
        LAYERS[mode] = cls
        return cls

    return deco


class QuantizedKVCache(Cache):
    """A `transformers.Cache` with independent key/value quantizers: `model.generate(..., past_key_values=cache)`.

    One layer object per decoder layer, of the class registered for `cfg.mode`. Build it with
    `QuantizedKVCache.for_model(model, cfg)`; a cache holds one generation's state, so make a fresh one per call.
    """

    def __init__(self, cfg: CacheConfig, num_layers: int, rotary_emb: torch.nn.Module | None = None):
        from . import packed, simulated  # noqa: F401  (registers the layer classes)

        if cfg.mode not in LAYERS:
            raise ValueError(f"no cache layer registered for mode={cfg.mode!r}; have {sorted(LAYERS)}")
        if cfg.rope == "pre" and rotary_emb is None:
            raise ValueError("rope=pre needs the model's rotary embedding module (use QuantizedKVCache.for_model)")
        self.cfg = cfg
        self.padding = PaddingState()
        rope = RopeHelper(rotary_emb) if rotary_emb is not None else None
        layers = [LAYERS[cfg.mode](cfg, rope, self.padding) for _ in range(num_layers)]
        for i, layer in enumerate(layers):
            layer.layer_idx = i
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, model, cfg: CacheConfig) -> QuantizedKVCache:
        text_cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        cfg.check_head_dim(head_dim)
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        cache = cls(cfg, text_cfg.num_hidden_layers, rotary_emb=rotary)
        prepare = getattr(LAYERS[cfg.mode], "prepare_model", None)  # e.g. packed: route decode attention to it
        if prepare is not None:
            prepare(model, cache)
        return cache

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the prompt's padding ([B, T0], 1 = token) so pad positions never enter a group's min/max."""
        self.padding.prompt_mask = None if attention_mask is None else attention_mask.detach()

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the cache: `stored` (as kept) and `fp16` (the same tokens as an fp16 cache)."""
        stored = fp16 = 0
        for layer in self.layers:
            s, f = layer.nbytes() if hasattr(layer, "nbytes") else (0, 0)
            stored += s
            fp16 += f
        return {"stored": stored, "fp16": fp16}
