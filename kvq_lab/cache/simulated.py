"""Simulated ("fake quant") cache layer: KIVI Table 1's setting.

Every cached token, prefill included, is quantized and dequantized before attention sees it; exact keys and
values are kept alongside, so nothing is lost between steps. Each token is quantized with the group it
belongs to by position (groups aligned at the first non-sink token). A per-channel group that is not yet
full is zero-padded (as KIVI's fake quant) and requantized as tokens join it; full groups are final and
never recomputed, so a decode step costs one group, not the whole history.

Left-padded batches: row b's first `p_b` positions are padding. Each row has its own streams, run on its real
tokens only (positions p_b onwards), so sinks are the row's first `sink_tokens` real tokens, per-channel groups
start at its first non-sink real token (position p_b + sink_tokens), and a row sees exactly what it would see
alone, for every axis and RoPE order, given the same K/V (tested bit for bit). Padding never enters a group;
attention sees the exact K/V there (the attention mask hides them). An unpadded batch runs one stream pair over
all rows, as batch 1 does; a padded one costs one stream pair per row.

End to end, a padded row's K/V reach the cache only as bit-exact as the model's batched arithmetic makes them
(masked SDPA over a longer row sums in another order: ~1e-5 differences from the second layer on, SmolLM2 fp32),
and 2-bit fake quant of every token, prefill included, can amplify such differences (an fp16 parameter or a code
flips), so batch_size=3 and batch_size=1 generations can still differ on a real model.

Transforms (`key_transform`, `value_transform`; `kvq_lab.quant.transforms`): the stream runs on the transformed
tensor T(x) (kept beside the exact one, with the tokens' positions where a transform reads them), and attention sees
T^-1 of its fake quantization; sinks stay exact. `simulate` is the same arithmetic on a whole tensor in one call
(the probes use it; the layer reproduces it token by token).
"""

from __future__ import annotations

import math

import torch

from kvq_lab.quant.outliers import Outliers, fake_quant
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.quant.transforms import Pipeline, Positions

from .base import QuantizedLayerBase, register_layer


class FakeQuantStream:
    """Incremental fake quantization of one growing `[B, H, T, D]` tensor (keys or values of one layer).

    Every row of the tensor shares the stream's group layout, so a left-padded batch gives each row its own
    stream over its real tokens (`SimulatedLayer`)."""

    def __init__(self, spec: QuantSpec, sink_tokens: int, outliers: Outliers | None = None):
        self.spec = spec
        self.sink = sink_tokens
        self.outliers = outliers  # dense-and-sparse: these elements stay exact (kvq_lab.quant.outliers)
        self.final: torch.Tensor | None = None  # dequantized positions [sink, sink + done), never recomputed
        self.done = 0

    def view(self, exact: torch.Tensor) -> torch.Tensor:
        """exact [B, H, T, D] (all tokens so far, no padding) -> what attention sees [B, H, T, D]."""
        if self.spec.is_identity or exact.shape[-2] <= self.sink:
            return exact
        start = self.sink + self.done
        new = exact[..., start:, :]
        deq = fake_quant(new, self.spec, self.outliers, partial="zero")
        n = new.shape[-2]
        keep = n if self.spec.axis == "token" else n // self.spec.group_size * self.spec.group_size
        if keep:
            head = deq[..., :keep, :]
            self.final = head if self.final is None else torch.cat([self.final, head], dim=-2)
            self.done += keep
        parts = [exact[..., : self.sink, :]] if self.sink else []
        parts += [t for t in (self.final, deq[..., keep:, :]) if t is not None and t.shape[-2]]
        return torch.cat(parts, dim=-2)


def _around(
    stream: FakeQuantStream, exact: torch.Tensor, transformed: torch.Tensor, pipe: Pipeline, pos: Positions | None
) -> torch.Tensor:
    """What attention sees of a tensor whose quantizer is wrapped in `pipe`: exact, transformed [b, H, T, D] (no
    padding; pos: their positions or None) -> the stream's fake quantization of `transformed` with the transforms
    undone, sinks exact (as the model made them), [b, H, T, D]."""
    s = stream.sink
    deq = stream.view(transformed)[..., s:, :]
    back = pipe.inverse(deq, None if pos is None else pos.take(slice(None), slice(s, None)))
    return torch.cat([exact[..., :s, :], back], dim=-2)


def simulate(
    x: torch.Tensor,
    spec: QuantSpec,
    pipe: Pipeline | None = None,
    pos: Positions | None = None,
    sink_tokens: int = 0,
    outliers: Outliers | None = None,
) -> torch.Tensor:
    """What simulated mode's attention sees of a whole tensor x [B, H, T, D] (no padding), in one call: the first
    `sink_tokens` tokens exact; the others transformed by `pipe` (at positions `pos`), fake-quantized with groups from
    the first non-sink token (a partial per-channel group zero-padded, as KIVI's fake quant; `outliers` kept exact),
    transforms undone."""
    stream = FakeQuantStream(spec, sink_tokens, outliers)
    return stream.view(x) if pipe is None else _around(stream, x, pipe.forward(x, pos), pipe, pos)


def left_pads(valid: torch.Tensor) -> list[int]:
    """valid [B, T] bool (False = padding) -> padding positions per row; the padding must come first."""
    token_then_pad = (valid[:, 1:] < valid[:, :-1]).any(1)  # [B]
    if bool(token_then_pad.any()):
        row = int(token_then_pad.nonzero()[0])
        raise ValueError(
            f"attention mask row {row} has padding after a token; simulated mode needs left padding "
            "(tokenizer.padding_side='left')"
        )
    return (~valid).sum(1).tolist()


@register_layer("simulated")
class SimulatedLayer(QuantizedLayerBase):
    """One attention layer's simulated cache. `update` returns fake-quantized keys/values of every cached token.

    Streams: one pair (keys, values) over the whole batch when nothing is padded; one pair per row otherwise,
    each over that row's real tokens (see the module docstring)."""

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._streams: list[tuple[FakeQuantStream, FakeQuantStream]] | None = None  # set at the first update
        self._padded = False
        # transformed keys / values [B, H, T, D] where a transform applies, and the positions of all tokens where
        # a transform reads them (rope_pre)
        self._tk: torch.Tensor | None = None
        self._tv: torch.Tensor | None = None
        self._pos: Positions | None = None

    def _new_streams(self) -> tuple[FakeQuantStream, FakeQuantStream]:
        S = self.cfg.sink_tokens
        return FakeQuantStream(self.cfg.key, S, self.cfg.outliers("key")), FakeQuantStream(
            self.cfg.value, S, self.cfg.outliers("value")
        )

    def update(self, key_states, value_states, *args, **kwargs):
        B = key_states.shape[0]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        valid = self.padding.valid(B, self.keys.shape[-2]) if self.padding else None
        if self._streams is None:
            self._padded = valid is not None
            self._streams = [self._new_streams() for _ in range(B if self._padded else 1)]
        elif self._padded != (valid is not None):
            raise ValueError("the padding mask changed during generation; call set_padding before the first update")
        pos = None
        if self.positional:
            pos = self.new_positions(key_states, start, kwargs)
            self._pos = pos if self._pos is None else self._pos.cat(pos)
        if self.k_pipe is not None:
            tk = self.k_pipe.forward(key_states, pos)
            self._tk = tk if self._tk is None else torch.cat([self._tk, tk], dim=-2)
        if self.v_pipe is not None:
            tv = self.v_pipe.forward(value_states, pos)
            self._tv = tv if self._tv is None else torch.cat([self._tv, tv], dim=-2)

        if not self._padded:  # the common case (batch 1): one stream pair over all rows, no slicing or copies
            keys, values = self._view(*self._tensors(), self._pos, *self._streams[0])
        else:
            # rows are few: each row's streams run on its real tokens, alone, exactly as for a batch of one
            ks, vs = [], []
            for b, p in enumerate(left_pads(valid)):
                real = [None if x is None else x[b : b + 1, :, p:] for x in self._tensors()]
                pos = None if self._pos is None else self._pos.take(slice(b, b + 1), slice(p, None))
                k, v = self._view(*real, pos, *self._streams[b])
                # padding positions pass through exact (finite, and hidden by the attention mask)
                ks.append(torch.cat([self.keys[b : b + 1, :, :p], k], dim=-2))
                vs.append(torch.cat([self.values[b : b + 1, :, :p], v], dim=-2))
            keys, values = torch.cat(ks), torch.cat(vs)
        # the new tokens only: history was checked when it arrived (a whole-history scan costs ~13% of decode)
        self.check_finite(key_states, value_states)
        return keys, values

    def prefix_boundary(self, n: int) -> int:
        """Every token is quantized with the group it belongs to by position, and transforms act token by token.
        A per-channel group that the cut splits would be shown to the tokens before the cut zero-padded instead of
        whole, so the cut goes within the sinks or at a whole number of per-channel groups after them (anywhere
        when no quantizer groups along tokens). Unpadded caches only."""
        if self._padded:
            return 0
        sink = self.cfg.sink_tokens
        token_groups = [
            s.group_size for s in (self.cfg.key, self.cfg.value) if not s.is_identity and s.axis == "channel"
        ]
        if n <= sink or not token_groups:
            return n
        step = math.lcm(*token_groups)
        return sink + (n - sink) // step * step

    def _tensors(self):
        """The per-position tensors of the layer [B, H, T, D]: exact keys and values, and their transformed
        versions (None where no transform applies)."""
        return self.keys, self.values, self._tk, self._tv

    def _view(self, keys, values, tk, tv, pos, k_stream: FakeQuantStream, v_stream: FakeQuantStream):
        """What attention sees of rows holding no padding, given `_tensors()` of those rows ([b, H, T, D]) and
        their positions (or None): fake-quantized keys and values [b, H, T, D]."""
        keys = k_stream.view(keys) if self.k_pipe is None else _around(k_stream, keys, tk, self.k_pipe, pos)
        values = v_stream.view(values) if self.v_pipe is None else _around(v_stream, values, tv, self.v_pipe, pos)
        return keys, values
