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

Decode cost: the layer keeps what attention saw at the previous step in a buffer and rewrites only what changed
(`FakeQuantStream.tail`: the new token, or the per-channel group it joins); exact tensors grow in place (`Growing`).
`update` returns views of those buffers, valid until the next update (as a static cache's tensors).
`SimulatedLayer.stack` joins caches of single prompts into one left-padded batch that decodes as the rows would alone
(`kvq_lab.lmeval.wrapper` batches prefix reuse with it).

Transforms (`key_transform`, `value_transform`; `kvq_lab.quant.transforms`): the stream runs on the transformed
tensor T(x) (kept beside the exact one, with the tokens' positions where a transform reads them), and attention sees
T^-1 of its fake quantization; sinks stay exact. `simulate` is the same arithmetic on a whole tensor in one call
(the probes use it; the layer reproduces it token by token).
"""

from __future__ import annotations

import copy
import math

import torch

from kvq_lab.quant.outliers import Outliers, fake_quant
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.quant.transforms import Pipeline, Positions

from .base import QuantizedLayerBase, register_layer


class FakeQuantStream:
    """Incremental fake quantization of one growing `[B, H, T, D]` tensor (keys or values of one layer).

    Every row of the tensor shares the stream's group layout, so a left-padded batch gives each row its own
    stream over its real tokens (`SimulatedLayer`). `tail` returns only what changed since its previous call (a
    decode step costs one group, not the whole history); `view` the whole tensor, which needs the final groups
    kept (`keep_final`)."""

    def __init__(self, spec: QuantSpec, sink_tokens: int, outliers: Outliers | None = None, keep_final: bool = True):
        self.spec = spec
        self.sink = sink_tokens
        self.outliers = outliers  # dense-and-sparse: these elements stay exact (kvq_lab.quant.outliers)
        self.keep_final = keep_final
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
        deq = fake_quant(new, self.spec, self.outliers, partial="zero")
        n = new.shape[-2]
        keep = n if self.spec.axis == "token" else n // self.spec.group_size * self.spec.group_size
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
        it does not apply (outliers; kept final groups; a row that got more than one token or whose new token is a
        sink; a batch narrower than a group): `tail` then runs row by row."""
        first = streams[0]
        spec, B, T = first.spec, exact.shape[0], exact.shape[-2]
        lens = [T - p for p in pads]
        if first.outliers is not None or first.keep_final or len(streams) != B:
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


def _tail_around(
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
    """The whole of `_tail_around`: what attention sees of every position [b, H, T, D]."""
    stream.seen = 0
    return _tail_around(stream, exact, transformed, pipe, pos)[1]


class Growing:
    """A [B, H, T, D] tensor growing along tokens, with spare room: appending copies the new tokens only
    (amortized), where a `torch.cat` per step would copy the whole history. A batch (`SimulatedLayer.admit`) can
    also grow it on the left (more padding before every row) and drop leading columns, both in place where the
    room allows."""

    def __init__(self, x: torch.Tensor):
        self.buf, self.off, self.n = x, 0, x.shape[-2]  # the tokens are buf[..., off : off + n, :]

    def __deepcopy__(self, memo) -> Growing:
        return Growing(self.value.clone())  # the tokens, not the spare room

    @property
    def value(self) -> torch.Tensor:
        return self.buf[..., self.off : self.off + self.n, :]

    def _move(self, left: int, n: int) -> None:
        """Copy the tokens into a new buffer with `left` free columns before them and room for n tokens in all."""
        shape = list(self.buf.shape)
        shape[-2] = left + max(n, 2 * self.n, 64)
        buf = self.buf.new_empty(shape)
        buf[..., left : left + self.n, :] = self.value
        self.buf, self.off = buf, left

    def grow_to(self, n: int) -> None:
        """Make room for n tokens (positions past the old length are left as they are: write them)."""
        if self.off + n > self.buf.shape[-2]:
            self._move(self.off, n)
        self.n = max(self.n, n)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n
        self.grow_to(n + x.shape[-2])
        self.value[..., n:, :] = x
        return self.value

    def grow_left(self, e: int) -> None:
        """e more leading columns, zero in every row."""
        if e > self.off:
            self._move(max(e, self.n // 2, 64), self.n + e)
        self.off -= e
        self.n += e
        self.buf[..., self.off : self.off + e, :] = 0

    def drop_left(self, k: int) -> None:
        """Forget the first k columns."""
        self.off += k
        self.n -= k


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
        # exact keys / values, and transformed ones where a transform applies ([B, H, T, D], growing in place; the
        # exact ones are `self.keys` / `self.values`), the positions of all tokens where a transform reads them
        # (rope_pre), and what attention sees of keys and values, rewritten where it changes (`FakeQuantStream.tail`)
        self._grown: dict[str, Growing] = {}
        self._tk: torch.Tensor | None = None
        self._tv: torch.Tensor | None = None
        self._pos: Positions | None = None

    def _new_streams(self) -> tuple[FakeQuantStream, FakeQuantStream]:
        S = self.cfg.sink_tokens
        return FakeQuantStream(self.cfg.key, S, self.cfg.outliers("key"), keep_final=False), FakeQuantStream(
            self.cfg.value, S, self.cfg.outliers("value"), keep_final=False
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
                        lo, part = stream.tail(exact) if pipe is None else _tail_around(stream, exact, tx, pipe, pos)
                        seen.value[r, :, p + lo : p + lo + part.shape[-2]] = part
        # the new tokens only: history was checked when it arrived (a whole-history scan costs ~13% of decode)
        self.check_finite(key_states, value_states)
        return seen_k.value, seen_v.value

    stackable = True

    @classmethod
    def stack(cls, rows: list[SimulatedLayer], pads: list[int], padding) -> SimulatedLayer:
        """Layers of unpadded batch-1 caches -> one layer of a left-padded batch (see `QuantizedLayerBase.stack`).
        A padded layer runs one stream pair per row, on the row's real tokens only: the rows' own streams carry on
        as they would alone. Padding positions hold zeros (exact, never quantized, hidden by the attention mask)."""
        for r in rows:
            if r._streams is None or r._padded or r.keys.shape[0] != 1:
                raise ValueError("stack takes filled, unpadded caches of one prompt each")
        out = copy.copy(rows[0])
        out.padding, out._padded = padding, True
        out._streams = [r._streams[0] for r in rows]

        def joined(ts: list[torch.Tensor]) -> torch.Tensor:  # [1, ..., T_b, D] each -> [B, ..., T, D], left-padded
            out = ts[0].new_zeros(len(ts), *ts[0].shape[1:-2], max(pads[0] + ts[0].shape[-2], 1), ts[0].shape[-1])
            for b, (t, p) in enumerate(zip(ts, pads, strict=True)):
                out[b, ..., p:, :] = t[0]
            return out

        out._grown = {name: Growing(joined([r._grown[name].value for r in rows])) for name in rows[0]._grown}
        out._bind()
        if rows[0]._pos is not None:  # positions [1, T] ids, [1, 1, T, D] cos/sin: padded the same way
            ids = torch.cat([torch.nn.functional.pad(r._pos.ids, (p, 0)) for r, p in zip(rows, pads, strict=True)])
            trig = [None if rows[0]._pos[i] is None else joined([r._pos[i] for r in rows]) for i in (1, 2)]
            out._pos = Positions(ids, *trig)
        return out

    def _bind(self) -> None:
        """Point keys, values and the transformed tensors at the buffers in `_grown` (after they were replaced)."""
        self.keys, self.values = self._grown["k"].value, self._grown["v"].value
        self._tk = self._grown["tk"].value if "tk" in self._grown else None
        self._tv = self._grown["tv"].value if "tv" in self._grown else None

    def admit(self, slot: int, row: SimulatedLayer, grow: int, padding) -> None:
        """Put the layer of an unpadded batch-1 cache `row` into batch row `slot` of this stacked layer, in place of
        the row there (a finished generation), `grow` more padding columns first before every row (the new row is
        longer than the batch): it carries on with its own streams, as in `stack`. Costs the new row's tokens (and
        the new columns), not the batch's."""
        if row._streams is None or row._padded or row.keys.shape[0] != 1:
            raise ValueError("admit takes a filled, unpadded cache of one prompt")
        if not self._padded:
            raise ValueError("admit needs a layer of a padded batch (stack the first rows)")
        for name, g in self._grown.items():
            if grow:
                g.grow_left(grow)
            src = row._grown[name].value[0]
            g.value[slot, ..., : g.n - src.shape[-2], :] = 0
            g.value[slot, ..., g.n - src.shape[-2] :, :] = src
        self._bind()
        self._streams[slot] = row._streams[0]
        self.padding = padding
        if self._pos is not None:  # positions of rope_pre: ids [B, T], cos/sin [B, 1, T, D], padded as in `stack`
            F = torch.nn.functional
            ids, trig = self._pos.ids, [self._pos.cos, self._pos.sin]
            ids = F.pad(ids, (grow, 0))
            ids[slot] = F.pad(row._pos.ids[0], (ids.shape[1] - row._pos.ids.shape[1], 0))
            for i, (t, new) in enumerate(zip(trig, (row._pos.cos, row._pos.sin), strict=True)):
                if t is not None:
                    t = F.pad(t, (0, 0, grow, 0))
                    t[slot] = F.pad(new[0], (0, 0, t.shape[2] - new.shape[2], 0))
                    trig[i] = t
            self._pos = Positions(ids, *trig)

    def drop_left(self, k: int, padding) -> None:
        """Forget the first k columns of a stacked layer (padding in every row: `QuantizedKVCache.trim_padding`)."""
        for g in self._grown.values():
            g.drop_left(k)
        self._bind()
        if self._pos is not None:
            self._pos = self._pos.take(slice(None), slice(k, None))
        self.padding = padding

    def select_rows(self, rows: list[int], padding) -> None:
        """Keep batch rows `rows` of a stacked (padded) layer, in that order (finished generations leave the batch)."""
        if not self._padded:
            raise ValueError("select_rows needs a layer of a padded batch (one stream pair per row)")
        idx = torch.tensor(rows, device=self.keys.device)
        self._grown = {name: Growing(g.value.index_select(0, idx)) for name, g in self._grown.items()}
        self._bind()
        if self._pos is not None:
            self._pos = self._pos.take(idx, slice(None))
        self._streams = [self._streams[i] for i in rows]
        self.padding = padding

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
