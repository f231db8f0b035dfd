"""Simulated ("fake quant") cache layer: KIVI Table 1's setting.

Every cached token, prefill included, is quantized and dequantized before attention sees it; exact keys and
values are kept alongside, so nothing is lost between steps. The arithmetic (groups by position, aligned at the
first non-sink token; a partial per-channel group zero-padded and requantized as tokens join it; full groups final)
is `kvq_lab.cache.layers.simulated_stream`'s, one stream per tensor.

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

Decode cost: the layer keeps what attention saw at the previous step in a buffer and rewrites only what changed
(`FakeQuantStream.tail`; a padded batch's rows in one call, `FakeQuantStream.step_rows`); exact tensors grow in
place (`simulated_batch.Growing`). `update` returns views of those buffers, valid until the next update (as a
static cache's tensors).

Transforms (`key_transform`, `value_transform`; `kvq_lab.quant.transforms`): the streams run on the transformed
tensors T(x), kept beside the exact ones (with the tokens' positions where a transform reads them), and attention
sees T^-1 of their fake quantization; sinks stay exact.

Roles: this module is the layer (what attention sees, per step); `simulated_stream` the fake-quant arithmetic of
one tensor, `simulated_batch` the growing buffers and the row edits that batch layers (`stack`, `admit`, ...).
"""

from __future__ import annotations

import math

import torch

from kvq_lab.cache.accounting import kv_bits
from kvq_lab.cache.layers.base import QuantizedLayerBase, register_layer
from kvq_lab.cache.layers.simulated_batch import Growing, SimulatedRows
from kvq_lab.cache.layers.simulated_stream import FakeQuantStream, tail_around
from kvq_lab.quant.transforms import Positions


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
class SimulatedLayer(SimulatedRows, QuantizedLayerBase):
    """One attention layer's simulated cache. `update` returns fake-quantized keys/values of every cached token.

    Streams: one pair (keys, values) over the whole batch when nothing is padded; one pair per row otherwise,
    each over that row's real tokens (see the module docstring)."""

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._streams: list[tuple[FakeQuantStream, FakeQuantStream]] | None = None  # set at the first update
        self._padded = False
        # exact keys / values, and transformed ones where a transform applies ([B, H, T, D], growing in place; the
        # exact ones are `self.keys` / `self.values`), the positions of all tokens where a transform reads them
        # (rope_pre), and what attention sees of keys and values, rewritten where it changes (`FakeQuantStream.tail`)
        self._grown: dict[str, Growing] = {}
        self._tk: torch.Tensor | None = None
        self._tv: torch.Tensor | None = None
        self._pos: Positions | None = None

    @staticmethod
    def stored_bits(cfg, n_tokens: int, shape) -> tuple[float, float]:
        """(keys, values) bits per element one layer would store for n_tokens, counted as the packed cache with the
        same quantizers stores them (`kvq_lab.cache.accounting`; this mode keeps no window): the budget it stands for.
        """
        return kv_bits(cfg, n_tokens, shape)

    def _new_streams(self) -> tuple[FakeQuantStream, FakeQuantStream]:
        S = self.cfg.sink_tokens
        c = self.cfg
        return tuple(
            FakeQuantStream(getattr(c, t), S, c.outliers(t), keep_final=False, residual=c.residual(t))
            for t in ("key", "value")
        )

    def _append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        g = self._grown.get(name)
        if g is None:
            g = self._grown[name] = Growing(x.clone())
            return g.value
        return g.append(x)

    def _seen(self, name: str, exact: torch.Tensor) -> Growing:
        """The buffer of what attention sees of `exact` [B, H, T, D], with room for T tokens; padding positions
        hold the exact tensor's (finite, hidden by the attention mask), every other new position is written by the
        streams."""
        g = self._grown.get(name)
        if g is None:
            g = self._grown[name] = Growing(exact.clone())
        g.grow_to(exact.shape[-2])
        return g

    def update(self, key_states, value_states, *args, **kwargs):
        """Append the new tokens -> what attention sees of keys and values [B, H, T, D] (views of the layer's buffers,
        valid until the next update, as a static cache's)."""
        B = key_states.shape[0]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        self.keys, self.values = self._append("k", key_states), self._append("v", value_states)
        valid = self.padding.valid(B, self.keys.shape[-2]) if self.padding else None
        if self._streams is None:
            self._padded = valid is not None
            self._streams = [self._new_streams() for _ in range(B if self._padded else 1)]
        elif self._padded and valid is None:  # stacked rows of one length (`stack`): no padding, a stream pair each
            valid = torch.ones(B, self.keys.shape[-2], dtype=torch.bool, device=self.keys.device)
        elif valid is not None and not self._padded:
            raise ValueError("the padding mask changed during generation; call set_padding before the first update")
        pos = None
        if self.positional:
            pos = self.new_positions(key_states, start, kwargs)
            self._pos = pos if self._pos is None else self._pos.cat(pos)
        if self.k_pipe is not None:
            self._tk = self._append("tk", self.k_pipe.forward(key_states, pos))
        if self.v_pipe is not None:
            self._tv = self._append("tv", self.v_pipe.forward(value_states, pos))

        seen_k, seen_v = self._seen("sk", self.keys), self._seen("sv", self.values)
        # one stream pair over all rows (nothing padded: batch 1), else one per row, each on the row's real tokens
        # alone, exactly as for a batch of one (padding positions keep their exact values)
        pads = left_pads(valid) if self._padded else [0]
        rows = [(slice(None), 0)] if not self._padded else [(slice(b, b + 1), p) for b, p in enumerate(pads)]
        # a decode step of a padded batch: all rows in one call where it applies (untransformed tensors)
        tensors = ((self.keys, self.k_pipe, seen_k), (self.values, self.v_pipe, seen_v))
        batched = [
            self._padded
            and key_states.shape[-2] == 1
            and pipe is None
            and FakeQuantStream.step_rows([pair[i] for pair in self._streams], exact, pads, seen.value)
            for i, (exact, pipe, seen) in enumerate(tensors)
        ]
        # the others row by row
        if not all(batched):
            for (r, p), (k_stream, v_stream) in zip(rows, self._streams, strict=True):
                keys, values, tk, tv = [None if x is None else x[r, :, p:] for x in self._tensors()]
                pos = None if self._pos is None else self._pos.take(r, slice(p, None))
                for exact, tx, pipe, stream, seen, done in (
                    (keys, tk, self.k_pipe, k_stream, seen_k, batched[0]),
                    (values, tv, self.v_pipe, v_stream, seen_v, batched[1]),
                ):
                    if not done:
                        lo, part = stream.tail(exact) if pipe is None else tail_around(stream, exact, tx, pipe, pos)
                        seen.value[r, :, p + lo : p + lo + part.shape[-2]] = part
        # the new tokens only: history was checked when it arrived (a whole-history scan costs ~13% of decode)
        self.check_finite(key_states, value_states)
        if start == 0 and self.cfg.exact_prefill:  # the prompt's forward reads the K/V the model computed
            return self.keys, self.values
        return seen_k.value, seen_v.value

    def prefix_boundary(self, n: int) -> int:
        """Every token is quantized with the group it belongs to by position, and transforms act token by token.
        A per-channel group that the cut splits would be shown to the tokens before the cut zero-padded instead of
        whole, so the cut goes within the sinks or at a whole number of per-channel groups after them (anywhere
        when no quantizer groups along tokens). Unpadded caches with a quantized prefill only (`prefill=exact`: a
        later piece would read the first one quantized)."""
        if self._padded:
            return 0
        if self.cfg.exact_prefill and not (self.cfg.key.is_identity and self.cfg.value.is_identity):
            return 0  # a prefill in two pieces: the second reads the first one's tokens quantized, one prefill exact
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
