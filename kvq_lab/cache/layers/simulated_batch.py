"""A simulated layer's growing buffers, and the row edits that batch simulated layers (continuous batching).

`Growing`: a [B, H, T, D] tensor growing along tokens with spare room, so a decode step copies its new tokens only;
the layer keeps its exact, transformed and attended tensors in them (`SimulatedLayer._grown`).

`SimulatedRows`, the row edits of `kvq_lab.cache.layers.simulated.SimulatedLayer` (`QuantizedLayerBase`'s batching
hooks; `QuantizedKVCache.stack`, `admit`, `select_rows`, `trim_padding` call them): `stack` joins caches of single
prompts into one left-padded batch that decodes as the rows would alone (`kvq_lab.lmeval.wrapper` batches prefix
reuse with it), `admit` puts a new prompt in a finished row's place, `select_rows` keeps some rows, `drop_left`
forgets padding columns. A row carries its own stream pair (`simulated_stream.FakeQuantStream`) wherever it goes.
"""

from __future__ import annotations

import copy

import torch

from kvq_lab.quant.transforms import Positions


class Growing:
    """A [B, H, T, D] tensor growing along tokens, with spare room: appending copies the new tokens only
    (amortized), where a `torch.cat` per step would copy the whole history. A batch (`SimulatedRows.admit`) can
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


class SimulatedRows:
    """The batching hooks of `SimulatedLayer`, over the state it keeps: `_grown` (name -> `Growing`: exact keys and
    values "k", "v", transformed ones "tk", "tv", what attention sees "sk", "sv"), `_streams` (one stream pair per
    row of a padded batch), `_padded`, `_pos` (positions, where a transform reads them) and `padding`."""

    stackable = True

    @classmethod
    def stack(cls, rows: list[SimulatedRows], pads: list[int], padding) -> SimulatedRows:
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

    def admit(self, slot: int, row: SimulatedRows, grow: int, padding) -> None:
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
