"""Simulated ("fake quant") cache layer: KIVI Table 1's setting.

Every cached token, prefill included, is quantized and dequantized before attention sees it; exact keys and
values are kept alongside, so nothing is lost between steps. Each token is quantized with the group it
belongs to by position (groups aligned at the first non-sink token). A per-channel group that is not yet
full is zero-padded (as KIVI's fake quant) and requantized as tokens join it; full groups are final and
never recomputed, so a decode step costs one group, not the whole history.
"""

from __future__ import annotations

import torch

from kvq_lab.quant.reference import fake_quant
from kvq_lab.quant.spec import QuantSpec

from .base import QuantizedLayerBase, register_layer


class FakeQuantStream:
    """Incremental fake quantization of one growing `[B, H, T, D]` tensor (keys or values of one layer)."""

    def __init__(self, spec: QuantSpec, sink_tokens: int):
        self.spec = spec
        self.sink = sink_tokens
        self.final: torch.Tensor | None = None  # dequantized positions [sink, sink + done), never recomputed
        self.done = 0

    def view(self, exact: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """exact [B, H, T, D] (all tokens so far) -> what attention sees [B, H, T, D]; valid: [B, T] or None."""
        if self.spec.is_identity or exact.shape[-2] <= self.sink:
            return exact
        start = self.sink + self.done
        new = exact[..., start:, :]
        v = None if valid is None else valid[:, None, start:]
        deq = fake_quant(new, self.spec, valid=v, partial="zero")
        n = new.shape[-2]
        keep = n if self.spec.axis == "token" else n // self.spec.group_size * self.spec.group_size
        if keep:
            head = deq[..., :keep, :]
            self.final = head if self.final is None else torch.cat([self.final, head], dim=-2)
            self.done += keep
        parts = [exact[..., : self.sink, :]] if self.sink else []
        parts += [t for t in (self.final, deq[..., keep:, :]) if t is not None and t.shape[-2]]
        return torch.cat(parts, dim=-2)


@register_layer("simulated")
class SimulatedLayer(QuantizedLayerBase):
    """One attention layer's simulated cache. `update` returns fake-quantized keys/values of every cached token."""

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._k_stream = FakeQuantStream(cfg.key, cfg.sink_tokens)
        self._v_stream = FakeQuantStream(cfg.value, cfg.sink_tokens)
        self._pre_keys: torch.Tensor | None = None  # pre-RoPE keys (rope=pre only)
        self._cos = self._sin = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        valid = self.padding.valid(key_states.shape[0], self.keys.shape[-2]) if self.padding else None

        if self.rope is None:
            keys = self._k_stream.view(self.keys, valid)
        else:
            cos, sin = self.rope_cos_sin(key_states, start, kwargs)
            pre = self.rope.unrotate(key_states, cos, sin)
            self._pre_keys = pre if self._pre_keys is None else torch.cat([self._pre_keys, pre], dim=-2)
            self._cos = cos if self._cos is None else torch.cat([self._cos, cos], dim=-2)
            self._sin = sin if self._sin is None else torch.cat([self._sin, sin], dim=-2)
            deq = self._k_stream.view(self._pre_keys, valid)
            s = self.cfg.sink_tokens
            rotated = self.rope.rotate(deq[..., s:, :], self._cos[..., s:, :], self._sin[..., s:, :])
            keys = torch.cat([self.keys[..., :s, :], rotated], dim=-2)  # sinks: the exact post-RoPE keys
        values = self._v_stream.view(self.values, valid)
        # the new tokens only: history was checked when it arrived (a whole-history scan costs ~13% of decode)
        self.check_finite(key_states, value_states)
        return keys, values
