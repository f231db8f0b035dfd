"""Streaming policies of the packed cache: which tokens of one tensor stay exact and when groups are quantized.

Every stream follows one protocol (`Stream`), so the layer never asks which kind it holds:
    prefill(x, pads)             the prompt, [B, H, N, D]; pads: left-padding positions p_b per row
    step(x, N, pads, owns)       one decode token [B, H, 1, D] at absolute position N
    n_quantized(N)               quantized history tokens (the furthest row)
    materialize(N, sink, pads, rotate)   full [B, H, N, D]: sinks exact, history dequantized, window exact
    view(N, sink, pads, rotate)  a kernel's `StreamView` of the stored segments (a padded batch: with per-row
                                 `starts` and `counts`, see `kvq_lab.kernels.view`)
    moving(N, pads)              what a decode step moves in that view: (n, w, window, per-row layout or None)
    slot()                       where the next step's token goes (a row of the window buffer, for a caller that
                                 writes it there; `step` then copies nothing), or None
    nbytes()                     bytes held
    quantized                    whether the stream stores codes (False: the exact 16-bit stream)

`rotate(x, abs_pos)` undoes the layer's transforms that cannot be folded into attention (`rope_pre`: re-rotates
pre-RoPE keys) on stored tokens [B, H, n, D] at absolute positions [B, n]; None when there are none. A stream's
`encode(x, abs_pos)`, when the layer sets one, applies those transforms: the stream holds its window as the model made
it (exact, nothing to undo when read) and encodes tokens only as they are quantized, the whole batch's window (or
prompt) at once. Sinks are the layer's; streams hold the tokens after them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from kvq_lab.cache.storage.store import PackedStore, tensor_bytes
from kvq_lab.kernels.view import StreamView
from kvq_lab.quant.pack import BLOCK
from kvq_lab.quant.spec import QuantSpec

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


class Stream(Protocol):
    """One tensor's (keys' or values') storage policy after the sinks; see the module docstring."""

    quantized: bool

    def prefill(self, x: torch.Tensor, pads: list[int]) -> None: ...
    def step(self, x: torch.Tensor, N: int, pads: list[int], owns: list[bool] | None) -> None: ...
    def n_quantized(self, N: int) -> int: ...
    def materialize(self, N: int, sink: torch.Tensor, pads: list[int], rotate: Rotate) -> torch.Tensor: ...
    def view(self, N: int, sink: torch.Tensor, pads: list[int], rotate: Rotate) -> StreamView: ...
    def slot(self) -> torch.Tensor | None: ...
    def nbytes(self) -> int: ...


def make_stream(spec: QuantSpec, exact_window: int, sink_tokens: int, backend, outliers=None, residual=None) -> Stream:
    """The policy for a quantizer: 16 bits exact; per-token groups a sliding window; per-channel groups a fill.
    outliers: dense-and-sparse elements kept exact in the store (`PackedStore`), or None; residual: corrections of
    the error stored beside the codes (`kvq_lab.quant.residuals.Chain`), or None."""
    if spec.is_identity:
        return ExactStream()
    cls = SlidingStream if spec.axis == "token" else FillStream
    stream = cls(spec, exact_window, sink_tokens, backend)
    stream.store.outliers, stream.store.residual = outliers, residual
    return stream


class _QuantizedStream(ABC):
    """What the quantized policies share: a `PackedStore` of history, an fp window buffer, and assembly. A policy
    adds `prefill`, `step`, `n_quantized` and `_slots` (where a padded row's positions are stored)."""

    quantized = True

    def __init__(self, spec: QuantSpec, S: int, backend):
        self.spec, self.S = spec, S
        self.store = PackedStore(spec, backend)
        self._win: _Window | None = None  # the fp window (`window`), set at prefill
        self.encode: Rotate = None  # the layer's unfoldable transforms, applied as tokens are quantized

    @property
    def window(self) -> torch.Tensor | None:
        """The fp window [B, H, W, D] (a view into its buffer, valid until the next step); None before prefill."""
        return None if self._win is None else self._win.view

    @window.setter
    def window(self, x: torch.Tensor) -> None:
        self._win = _Window(x)

    def slot(self) -> torch.Tensor | None:
        """Where the next `step`'s token goes in the window buffer (`_Window.slot`: a [B, H, 1, D] view, written by
        the caller, then passed to `step`, which copies nothing), or None where a step keeps no window (R = 0 with
        per-token groups) or before prefill."""
        w = self._win
        return None if w is None or not w.n else w.slot()

    @property
    def window_slots(self) -> int:
        """Rows the window's buffer holds: W plus `spare_rows(W)` (what `nbytes` counts)."""
        return 0 if self._win is None else self._win.buf.shape[2]

    def _encoded(self, x: torch.Tensor, abs_pos: torch.Tensor) -> torch.Tensor:
        """x [B, H, n, D] at absolute positions [B, n] as the quantizer sees it (`encode` applied, if any)."""
        return x if self.encode is None else self.encode(x, abs_pos)

    def _init_store(self, x: torch.Tensor) -> None:
        B, H, _, D = x.shape
        self.store.dims, self.store.device = (B, H, D), x.device

    def slot_positions(self, q: int, pads: list[int], device) -> torch.Tensor:
        """Absolute positions [B, q] of storage positions [0, q) (every row: S + t)."""
        return torch.arange(self.S, self.S + q, device=device).expand(len(pads), q)

    @abstractmethod
    def n_quantized(self, N: int) -> int: ...

    @abstractmethod
    def _rows(self, N: int, pads: list[int]) -> tuple[list[int], list[int]]:
        """Padded batch: per row, the absolute position of storage position 0 and the quantized history tokens."""

    @abstractmethod
    def _slots(self, a: torch.Tensor, j: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded batch: per absolute position a [B, N] (j: index among the row's real tokens), its storage
        position and whether it is quantized history: ([B, N], [B, N] bool)."""

    def history(self, q: int, pads: list[int], rotate: Rotate) -> torch.Tensor:
        """fp32 [B, H, q, D]: storage positions [0, q) dequantized, `rotate` applied (unfoldable transforms undone)."""
        deq = self.store.dequantize(q)
        if rotate is not None and q:
            deq = rotate(deq, self.slot_positions(q, pads, deq.device))
        return deq

    def moving(self, N: int, pads: list[int] | None = None) -> tuple[int, int, torch.Tensor, tuple | None]:
        """What a decode step moves in the stream's view at N cached positions: quantized history tokens n, window
        tokens w, the window [B, H, W, D] (its last w rows) and, for a left-padded batch (`pads` with a non-zero
        entry), each row's layout (starts, counts: lists, `StreamView.starts/counts`; w is then W: the rows hold
        positions by absolute position, each row reads its own), else None."""
        q = self.n_quantized(N)
        if pads is None or not any(pads):
            return q, max(0, N - self.S) - q, self.window, None
        return q, self.window.shape[2], self.window, self._rows(N, pads)

    def view(self, N: int, sink: torch.Tensor, pads: list[int], rotate: Rotate) -> StreamView:
        q, w, _, rows = self.moving(N, pads)
        st = self.store
        # a history the kernels cannot read from codes alone (transforms to undo, sparse outliers, residual
        # corrections): dequantized here
        deq = self.history(q, pads, rotate) if (rotate is not None or st.reads_dequantized) and q else None
        starts = counts = None
        if rows is not None:  # per-row layouts: the kernel reads each row's own (codes are never dequantized here)
            if deq is not None:
                raise ValueError("a padded batch's view carries codes only: build it without transforms to undo")
            dev = self.window.device
            starts, counts = torch.tensor(rows[0], device=dev), torch.tensor(rows[1], device=dev)
        scale, zero = st.read_params()  # as the kernels read them (widened where stored narrower)
        return StreamView(
            sink, st.codes, scale, zero, q, self.window, w,
            st.bits, self.spec.group_size, self.spec.axis, deq, st.table, starts, counts,
        )  # fmt: skip

    def materialize(self, N: int, sink: torch.Tensor, pads: list[int], rotate: Rotate) -> torch.Tensor:
        if not any(pads):  # every row has the same layout: plain slices
            q = self.n_quantized(N)
            w = max(0, N - self.S) - q
            win = self.window[:, :, self.window.shape[2] - w :] if w else self.window[:, :, :0]
            hist = self.history(q, pads, rotate)
            return torch.cat([sink[:, :, : min(self.S, N)], hist.to(win.dtype), win], 2)
        # padded batch: gather each row's sinks, history and window into absolute positions
        S = self.S
        B, H, _, D = sink.shape
        dev = sink.device
        a = torch.arange(N, device=dev).expand(B, N)
        j = a - torch.tensor(pads, device=dev)[:, None]  # real-token index (negative: padding)
        W = self.window.shape[2]
        q = self.n_quantized(N)
        hidx, in_hist = self._slots(a, j, N)
        deq = self.history(q, pads, rotate)
        src = torch.cat([sink, deq.to(self.window.dtype), self.window], 2)  # [B, H, S + q + W, D]
        idx = torch.where(
            j < S, j.clamp(min=0), torch.where(in_hist, S + hidx.clamp(0, max(q - 1, 0)), S + q + a - (N - W))
        )
        idx = torch.where(j < 0, 0, idx).clamp(0, src.shape[2] - 1)
        return src.gather(2, idx[:, None, :, None].expand(B, H, N, D))

    def nbytes(self) -> int:
        return self.store.nbytes() + (0 if self._win is None else tensor_bytes(self._win.buf))


class SlidingStream(_QuantizedStream):
    """Per-token groups: a sliding fp window of the last R positions; a position is quantized as it leaves.

    Indexed by absolute position for every row: storage position t holds absolute position `S + t`
    (S = sink_tokens). Positions that are padding or sinks for a row are stored as zero codes and never read.
    window: [B, H, R, D], absolute positions [N - R, N) (zeros before position 0).

    When a position leaves and its packing block has no codes yet, the whole block is quantized at once from the
    window (the block's memory is allocated anyway): per-token quantization depends on the token alone, so the
    codes are the same whenever they are computed, and positions still in the window are attended exactly
    (their early codes are not read until they leave). One quantization per BLOCK steps instead of one per step.
    """

    def __init__(self, spec, R, S, backend):
        super().__init__(spec, S, backend)
        self.R = R
        self.done = 0  # storage positions with codes (>= the quantized count: a block may be coded early)

    def n_quantized(self, N: int) -> int:
        return max(0, N - self.R - self.S)

    def prefill(self, x: torch.Tensor, pads: list[int]) -> None:
        """x [B, H, N, D]; pads: p_b per row. Quantizes positions [S, N - R)."""
        self._init_store(x)
        N = x.shape[2]
        q = self.n_quantized(N)
        if q:
            hist = self._encoded(x[:, :, self.S : self.S + q], self.slot_positions(q, pads, x.device))
            self.store.write(hist, 0, self._valid(0, q, pads, x.device))
        self.done = q
        self.window = _last(x, self.R)

    def _valid(self, t0: int, n: int, pads: list[int], device) -> torch.Tensor | None:
        """[B, 1, n] bool: storage positions [t0, t0 + n) that are history of each row (None: all rows, all)."""
        if not any(pads):
            return None
        a = torch.arange(self.S + t0, self.S + t0 + n, device=device)
        return (a >= torch.tensor(pads, device=device)[:, None] + self.S)[:, None, :]

    def step(self, x: torch.Tensor, N: int, pads: list[int], owns: list[bool] | None = None) -> None:
        """Append x [B, H, 1, D] at absolute position N (pads: p_b per row; owns: unused, rows share positions)."""
        both = self._win.push(x) if self.R else x  # absolute positions [N - R, N]; the window is now its last R
        t = N - self.R - self.S  # storage position of the token leaving the window
        if t >= self.done:
            k = min(BLOCK - t % BLOCK, self.R + 1)  # up to the end of its block, from what has arrived
            a = torch.arange(N - self.R, N - self.R + k, device=x.device).expand(x.shape[0], k)
            self.store.write(self._encoded(both[:, :, :k], a), t, self._valid(t, k, pads, x.device))
            self.done = t + k

    def _rows(self, N, pads):
        return [self.S] * len(pads), [self.n_quantized(N)] * len(pads)

    def _slots(self, a, j, N):
        return a - self.S, a < N - self.R


class FillStream(_QuantizedStream):
    """Per-channel groups: an fp window fills to Rp = R (or G when R = 0) tokens, then is quantized at once.

    Indexed per row by real non-sink token: storage position i of row b holds absolute position p_b + S + i,
    so groups align on each row's own tokens. q[b] tokens quantized, w[b] in the window.
    window: [B, H, Rp, D], absolute positions [N - Rp, N); row b's window is its last w[b] entries.
    """

    def __init__(self, spec, R, S, backend):
        super().__init__(spec, S, backend)
        self.Rp = R if R else spec.group_size
        self.q: list[int] = []
        self.w: list[int] = []

    def n_quantized(self, N: int) -> int:
        return max(self.q) if self.q else 0

    def prefill(self, x: torch.Tensor, pads: list[int]) -> None:
        """x [B, H, N, D]; pads: p_b per row (padding positions first)."""
        self._init_store(x)
        B, H, N, D = x.shape
        S, Rp = self.S, self.Rp
        ell = [max(0, N - p - S) for p in pads]  # non-sink real tokens per row
        f = [e // Rp * Rp for e in ell]  # quantized now: whole windows
        self.q, self.w = f, [e - k for e, k in zip(ell, f, strict=True)]
        if max(f) and all(p == pads[0] for p in pads):
            s0 = pads[0] + S
            a = torch.arange(s0, s0 + f[0], device=x.device).expand(B, f[0])
            self.store.write(self._encoded(x[:, :, s0 : s0 + f[0]], a), 0)
        elif max(f):
            tx = self._encoded(x, torch.arange(N, device=x.device).expand(B, N))
            for b, (p, k) in enumerate(zip(pads, f, strict=True)):  # ragged rows: one write per row (prefill only)
                if k:
                    self.store.write(tx[b : b + 1, :, p + S : p + S + k], 0, rows=slice(b, b + 1))
        self.window = _last(x, Rp)

    def step(self, x: torch.Tensor, N: int, pads: list[int], owns: list[bool] | None) -> None:
        """Append x [B, H, 1, D]; owns[b]: the token is a real non-sink token of row b (None: every row)."""
        self._win.push(x)
        for b in range(len(self.w)):
            self.w[b] += 1 if owns is None else owns[b]
        full = [b for b, w in enumerate(self.w) if w == self.Rp]
        if not full:
            return
        B, Rp = x.shape[0], self.Rp
        win = self._encoded(self.window, torch.arange(N + 1 - Rp, N + 1, device=x.device).expand(B, Rp))
        if len(full) == len(self.w) and all(k == self.q[0] for k in self.q):
            self.store.write(win, self.q[0])
        else:
            for b in full:  # rows flush at different steps in a ragged batch: once per Rp steps per row
                self.store.write(win[b : b + 1], self.q[b], rows=slice(b, b + 1))
        for b in full:
            self.q[b] += self.Rp
            self.w[b] = 0

    def slot_positions(self, q, pads, device):
        """Row b's storage position t is absolute position p_b + S + t."""
        return torch.tensor(pads, device=device)[:, None] + self.S + torch.arange(q, device=device)

    def _rows(self, N, pads):
        return [p + self.S for p in pads], list(self.q)

    def _slots(self, a, j, N):
        hidx = j - self.S
        return hidx, hidx < torch.tensor(self.q, device=a.device)[:, None]


def spare_rows(n: int) -> int:
    """Rows a window buffer of n positions holds beyond them (`_Window`): n/16 (8 at R = 128), at least 1; none for an
    empty window. Memory for speed: ~6% more window bytes, the window's rows moved back once per n/16 steps."""
    return max(1, n // 16) if n else 0


class _Window:
    """A stream's fp window, the last n positions [B, H, n, D], advanced one position per step without a new tensor.

    A buffer of n + s rows (s = `spare_rows(n)`) holds the window as a view of n consecutive rows that moves down one
    row per step (the new token written after it); when the buffer's end is reached, the window's rows move back to
    its front (n rows copied once per s steps, where a concatenation copied n + 1 rows into a new tensor every step).
    The views of every offset are made once, so a step is one copy of one row. A window view is valid until the next
    `push`.
    """

    def __init__(self, x: torch.Tensor):
        B, H, n, D = x.shape
        spare = spare_rows(n)  # an empty window (R = 0, per-token groups) never moves: no spare rows
        self.n, self.off = n, 0
        self.buf = x.new_empty(B, H, n + spare, D)
        self.buf[:, :, :n] = x
        self._views = [self.buf.narrow(2, o, n) for o in range(spare + 1)]
        self._with_new = [self.buf.narrow(2, o, n + 1) for o in range(spare)]
        self._new = [self.buf.narrow(2, o + n, 1) for o in range(spare)]

    @property
    def view(self) -> torch.Tensor:
        return self._views[self.off]

    def slot(self) -> torch.Tensor:
        """The row [B, H, 1, D] (a view) the next `push` writes: a caller may write the new token there itself and
        push this very view, which is then not copied. The window is unchanged."""
        if self.off == len(self._new):
            self.buf[:, :, : self.n] = self._views[self.off].clone()  # the rows overlap: copied through a new tensor
            self.off = 0
        return self._new[self.off]

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """Append x [B, H, 1, D]; the window is then its last n positions. Returns the old window followed by x
        ([B, H, n + 1, D], a view valid until the next push)."""
        new = self.slot()
        if x is not new:
            new.copy_(x)
        self.off += 1
        return self._with_new[self.off - 1]


class ExactStream:
    """16 bits: the tensor is kept as it is, sinks included (DynamicCache's behaviour, bit for bit)."""

    quantized = False

    def __init__(self):
        self.x: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        """x [B, H, n, D], any n."""
        self.x = x if self.x is None else torch.cat([self.x, x], 2)

    def prefill(self, x, pads):
        self.append(x)

    def step(self, x, N, pads, owns):
        self.append(x)

    def n_quantized(self, N: int) -> int:
        return 0

    def materialize(self, N, sink, pads, rotate):
        return self.x

    def view(self, N, sink, pads, rotate):
        raise TypeError("an exact (16-bit) stream stores no codes: attention reads it materialized")

    def slot(self):
        return None  # the tensor grows by concatenation: no row to write ahead

    def nbytes(self) -> int:
        return tensor_bytes(self.x)


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last n positions of x [B, H, N, D], zero-padded on the left when N < n."""
    N = x.shape[2]
    return x[:, :, N - n :].clone() if N >= n else F.pad(x, (0, 0, n - N, 0))
