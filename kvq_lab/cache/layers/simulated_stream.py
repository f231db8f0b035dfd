"""Simulated mode's arithmetic: incremental fake quantization of one growing tensor, and the same on a whole
tensor in one call.

Each token is quantized with the group it belongs to by position (groups aligned at the first non-sink token; the
first `sink_tokens` tokens stay exact). A per-channel group that is not yet full is zero-padded (as KIVI's fake
quant) and requantized as tokens join it; full groups are final and never recomputed, so a decode step costs one
group, not the whole history (`FakeQuantStream.tail`: the new token, or the per-channel group it joins).
`FakeQuantStream.step_rows` takes one decode step of every row of a left-padded batch in one call.

Transforms (`key_transform`, `value_transform`; `kvq_lab.quant.transforms`): the stream runs on the transformed
tensor T(x), and what attention sees is T^-1 of its fake quantization (`tail_around`); sinks stay exact. `simulate`
is the whole arithmetic on a whole tensor in one call (the probes use it;
`kvq_lab.cache.layers.simulated.SimulatedLayer` reproduces it token by token).
"""

from __future__ import annotations

import math

import torch

from kvq_lab.quant.outliers import Outliers, fake_quant
from kvq_lab.quant.residuals import Chain
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.quant.transforms import Pipeline, Positions


class FakeQuantStream:
    """Incremental fake quantization of one growing `[B, H, T, D]` tensor (keys or values of one layer).

    Every row of the tensor shares the stream's group layout, so a left-padded batch gives each row its own
    stream over its real tokens (`simulated.SimulatedLayer`). `tail` returns only what changed since its previous
    call (a decode step costs one group, not the whole history); `view` the whole tensor, which needs the final
    groups kept (`keep_final`)."""

    def __init__(
        self,
        spec: QuantSpec,
        sink_tokens: int,
        outliers: Outliers | None = None,
        keep_final: bool = True,
        residual: Chain | None = None,
    ):
        self.spec = spec
        self.sink = sink_tokens
        self.outliers = outliers  # dense-and-sparse: these elements stay exact (kvq_lab.quant.outliers)
        self.residual = residual  # corrections of the error (kvq_lab.quant.residuals)
        self.keep_final = keep_final
        # tokens become final in whole units: a per-channel group, and a residual correction's block (an open one
        # is recomputed as tokens join it, as an open per-channel group is)
        group = 1 if spec.axis == "token" else spec.group_size
        self.final_unit = math.lcm(group, 1 if residual is None else residual.block)
        self.final: torch.Tensor | None = None  # dequantized positions [sink, sink + done) (with keep_final)
        self.done = 0  # tokens after the sinks in whole groups: final, never recomputed
        self.seen = 0  # tokens given to the previous call

    def tail(self, exact: torch.Tensor) -> tuple[int, torch.Tensor]:
        """exact [B, H, T, D] (all tokens so far, no padding) -> (lo, what attention sees of positions [lo, T)),
        lo being the first position whose view may differ from the previous call's (every position on the first
        call)."""
        T = exact.shape[-2]
        lo, self.seen = self.seen, T
        if self.spec.is_identity or T <= self.sink:
            return lo, exact[..., lo:, :]
        start = self.sink + self.done
        new = exact[..., start:, :]
        deq = fake_quant(new, self.spec, self.outliers, partial="zero", residual=self.residual)
        n = new.shape[-2]
        keep = n // self.final_unit * self.final_unit
        parts = [exact[..., lo : self.sink, :]] if lo < self.sink else []
        if lo < start and self.final is not None:  # only a first call after `view` asks for what is final
            parts.append(self.final[..., max(lo - self.sink, 0) :, :])
        lo = min(lo, start)
        if keep:
            if self.keep_final:
                head = deq[..., :keep, :]
                self.final = head if self.final is None else torch.cat([self.final, head], dim=-2)
            self.done += keep
        return lo, torch.cat([*parts, deq], dim=-2) if parts else deq

    @staticmethod
    def step_rows(streams: list[FakeQuantStream], exact: torch.Tensor, pads: list[int], out: torch.Tensor) -> bool:
        """One decode step of a left-padded batch, every row's stream at once: exact [B, H, T, D] (row b's real tokens
        at positions pads[b] onwards, one new token each since the previous call), out [B, H, >= T, D] what attention
        sees, rewritten where it changes. The same arithmetic as `tail` row by row, in one fake-quant call: a row's
        open per-channel group is its last tokens zero-padded to G in both. Returns False, having done nothing, where
        it does not apply (outliers; residual corrections; kept final groups; a row that got more than one token or
        whose new token is a sink; a batch narrower than a group): `tail` then runs row by row."""
        first = streams[0]
        spec, B, T = first.spec, exact.shape[0], exact.shape[-2]
        lens = [T - p for p in pads]
        if first.outliers is not None or first.residual is not None or first.keep_final or len(streams) != B:
            return False
        if any(st.seen != n - 1 or n - 1 < st.sink for st, n in zip(streams, lens, strict=True)):
            return False
        open_ = [n - st.sink - st.done for st, n in zip(streams, lens, strict=True)]  # tokens after the final groups
        G = 1 if spec.is_identity or spec.axis == "token" else spec.group_size
        if T < G or any(not 1 <= k <= G for k in open_):
            return False
        if G == 1:  # a new token is a group of its own (or not quantized): the same column for every row
            new = exact[..., T - 1 :, :]
            out[..., T - 1 : T, :] = new if spec.is_identity else fake_quant(new, spec, None, partial="zero")
        else:
            j = torch.arange(G, device=exact.device)
            shift = torch.tensor([G - k for k in open_], device=exact.device)[:, None]  # [B, 1]
            src = j[None] + shift  # [B, G]: window column of the group's token j (past the window: zero padding)
            window = exact[..., T - G :, :]
            idx = src.clamp(max=G - 1)[:, None, :, None].expand_as(window)
            group = torch.where((src < G)[:, None, :, None], window.gather(2, idx), 0.0)
            deq = fake_quant(group, spec, None, partial="zero")
            back = j[None] - shift  # [B, G]: group token of window column j (negative: before the open group)
            idx = back.clamp(min=0)[:, None, :, None].expand_as(window)
            seen = out[..., T - G : T, :]
            out[..., T - G : T, :] = torch.where((back >= 0)[:, None, :, None], deq.gather(2, idx), seen)
        for st, n, k in zip(streams, lens, open_, strict=True):
            st.seen = n
            if not spec.is_identity and k == G:
                st.done += G
        return True

    def view(self, exact: torch.Tensor) -> torch.Tensor:
        """exact [B, H, T, D] (all tokens so far, no padding) -> what attention sees [B, H, T, D]."""
        if not self.keep_final:
            raise ValueError("view needs the final groups: make the stream with keep_final=True")
        self.seen = 0
        return self.tail(exact)[1]


def tail_around(
    stream: FakeQuantStream, exact: torch.Tensor, transformed: torch.Tensor, pipe: Pipeline, pos: Positions | None
) -> tuple[int, torch.Tensor]:
    """`FakeQuantStream.tail` of a tensor whose quantizer is wrapped in `pipe`: exact, transformed [b, H, T, D] (no
    padding; pos: their positions or None) -> (lo, the stream's fake quantization of `transformed` at positions
    [lo, T) with the transforms undone, sinks exact as the model made them)."""
    s = stream.sink
    lo, deq = stream.tail(transformed)
    a = max(lo, s)
    back = pipe.inverse(deq[..., a - lo :, :], None if pos is None else pos.take(slice(None), slice(a, None)))
    return lo, torch.cat([exact[..., lo:s, :], back], dim=-2) if lo < s else back


def _around(
    stream: FakeQuantStream, exact: torch.Tensor, transformed: torch.Tensor, pipe: Pipeline, pos: Positions | None
) -> torch.Tensor:
    """The whole of `tail_around`: what attention sees of every position [b, H, T, D]."""
    stream.seen = 0
    return tail_around(stream, exact, transformed, pipe, pos)[1]


def simulate(
    x: torch.Tensor,
    spec: QuantSpec,
    pipe: Pipeline | None = None,
    pos: Positions | None = None,
    sink_tokens: int = 0,
    outliers: Outliers | None = None,
    residual: Chain | None = None,
) -> torch.Tensor:
    """What simulated mode's attention sees of a whole tensor x [B, H, T, D] (no padding), in one call: the first
    `sink_tokens` tokens exact; the others transformed by `pipe` (at positions `pos`), fake-quantized with groups from
    the first non-sink token (a partial per-channel group zero-padded, as KIVI's fake quant; `outliers` kept exact;
    `residual` corrections added), transforms undone."""
    stream = FakeQuantStream(spec, sink_tokens, outliers, residual=residual)
    return stream.view(x) if pipe is None else _around(stream, x, pipe.forward(x, pos), pipe, pos)
