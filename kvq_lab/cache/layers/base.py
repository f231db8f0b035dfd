"""Shared machinery of kvq_lab's cache layers and their registry (`LAYERS`, `register_layer`).

The registry imports none of its plugins: a layer module registers itself when imported, and `kvq_lab.cache.kv_cache`
(the module that assembles the cache) imports them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.modes import capabilities
from kvq_lab.cache.routing.rope import RopeHelper, position_ids_from, positions_for
from kvq_lab.common.registry import Registry
from kvq_lab.kernels.torch_path import all_finite
from kvq_lab.quant.transforms import Pipeline, Positions


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
    """Base of kvq_lab cache layers: holds the config, the transform pipelines, the RoPE helper and the padding state.

    k_pipe, v_pipe: the transforms around the key and value quantizers (`kvq_lab.quant.transforms`), None where
    none applies; positional: some transform reads positions (rope_pre), computed with `rope`, the model's rotary
    module (None for a model without one).

    `self.keys` / `self.values` follow `DynamicLayer`'s meaning where a subclass keeps exact tensors; subclasses
    that store codes override `get_seq_length`.
    """

    is_croppable = False
    # `stack` can join single-prompt caches of this class into one left-padded batch (`QuantizedKVCache.stack`)
    stackable = False

    def __init__(self, cfg: CacheConfig, rope: RopeHelper | None = None, padding: PaddingState | None = None):
        super().__init__()
        self.cfg = cfg
        # a 16-bit quantizer drops the transforms that would only add rounding (rope_pre: keys stored as they are)
        self.k_pipe: Pipeline | None
        self.v_pipe: Pipeline | None
        self.k_pipe, self.v_pipe = cfg.pipelines()
        self.positional = any(p is not None and p.positional for p in (self.k_pipe, self.v_pipe))
        self.rope = rope
        self.padding = padding
        self.layer_idx = -1
        self.steps = 0

    def positions(self, like: torch.Tensor, position_ids: torch.Tensor) -> Positions:
        """`Positions` of tokens at position_ids [B, T] (cos/sin from the model's rotary module where it has one)."""
        return positions_for(self.rope, like, position_ids)

    def new_positions(self, key_states: torch.Tensor, start: int, kwargs: dict) -> Positions:
        """Positions of the tokens of this `update` ([B, H, T, D] arriving at cache position `start`)."""
        B, _, T, _ = key_states.shape
        return self.positions(key_states, position_ids_from(kwargs, B, start, T, key_states.device))

    def check_finite(self, *tensors: torch.Tensor) -> None:
        """NaN or inf in any of the tensors raises `NonFiniteError` naming this layer and step (`all_finite`: this runs
        for every layer at every decode step)."""
        self.steps += 1
        if not self.all_finite(*tensors):
            raise NonFiniteError(
                f"non-finite value (NaN/inf) in the KV cache at layer {self.layer_idx}, step {self.steps - 1} "
                f"(cache {self.cfg.label()}); check the model dtype and the quantizer range"
            )

    # whether no element is NaN or inf (PyTorch sums; a layer with a kernel backend takes the backend's check)
    all_finite = staticmethod(all_finite)

    def prefix_boundary(self, n: int) -> int:
        """The largest m <= n such that what attention sees of a prompt's first m tokens, when this layer is given
        them alone, is what it sees of them when given the whole prompt. Then a prefill in two pieces cut at m
        computes what one prefill computes (every token's attention reads the same keys and values) and the layer
        ends up the same: a cache filled with m tokens may be checkpointed and reused for longer prompts that share
        them (`kvq_lab.lmeval.wrapper`). 0 (only the empty prefix) by default, for layers whose state depends on where a
        prompt is cut (the packed cache quantizes its prefill once, in whole groups, and keeps a window exact)."""
        return 0

    @classmethod
    def stack(cls, rows: list, pads: list[int], padding: PaddingState):
        """Layers of unpadded batch-1 caches (`rows`, one prompt each) -> one layer of a left-padded batch, row b
        behind `pads[b]` padding positions, each row keeping its own quantization state. Layers that set `stackable`
        implement it."""
        raise NotImplementedError(f"{cls.__name__} cannot stack single-prompt caches into a batch")

    def select_rows(self, rows: list[int], padding: PaddingState) -> None:
        """Keep batch rows `rows` of a stacked layer, in that order (`stackable` layers implement it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop rows of a batch")

    def admit(self, slot: int, row, grow: int, padding: PaddingState) -> None:
        """Put the layer of a single-prompt cache `row` into batch row `slot` of a stacked layer, after `grow` more
        padding columns before every row (`stackable` layers implement it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take a row into a batch")

    def drop_left(self, k: int, padding: PaddingState) -> None:
        """Forget the first k columns of a stacked layer, padding in every row (`stackable` layers implement it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop columns of a batch")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvq_lab caches support greedy and sampling decoding, not beam search")


LAYERS: Registry[type[QuantizedLayerBase]] = Registry("mode")


def register_layer(mode: str):
    """Register a cache layer class for `CacheConfig.mode`: one new file plus this decorator (and the mode's
    capabilities in `kvq_lab.cache.modes`) adds a mode; a mode another class holds is refused. The class carries its
    mode's capabilities as `caps`."""

    def deco(cls):
        cls.caps = capabilities(mode)
        return LAYERS.register(mode)(cls)

    return deco
