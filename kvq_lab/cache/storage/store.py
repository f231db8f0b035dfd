"""Storage of the packed cache: bit-packed codes and per-group parameters of one tensor's quantized history."""

from __future__ import annotations

import torch

from kvq_lab.quant.outliers import Outliers
from kvq_lab.quant.pack import BLOCK, word_dtype, word_layout
from kvq_lab.quant.reference import code_format, fake_quant
from kvq_lab.quant.residuals import Chain, open_error
from kvq_lab.quant.spec import QuantSpec


class PackedStore:
    """Quantized history of one `[B, H, T, D]` tensor, indexed by storage position t (0 = first quantized slot).

    codes: uint8 [B, H, n_blocks * BLOCK * bits / 8, D] (`kvq_lab.quant.pack` layout), zero beyond what is written;
        `bits` is the code format's `code_bits`.
    scale, zero: [B, H, T_cap, D/G] (per-token groups) or [B, H, T_cap/G, D] (per-channel groups): only the
        parameters the format declares (`format.params`), at their stored width (`format.param_encodings`: fp16, or
        uint8 bytes of nvfp4's e4m3 and mxfp4's e8m0 scales); zero is None for formats without a zero point (fp8).
        What reads them gets `read_params()`: for fp16 parameters the stored tensors themselves; else a widened copy
        (fp16 for e4m3, fp32 for e8m0: the floats the formula reads), made at the first read, kept in step with every
        later write in place (a kept kernel call keeps reading it), remade when the store grows. It is the kernels'
        working copy, not what the method stores: `nbytes` does not count it (1 or 2 bytes more per group).
    table: fp32 [2^bits], the format's code values (x' = table[code] * scale + zero), or None for int, whose codes
        are their own values. Shared with the format (read-only); per tensor where the format's table depends on what
        a layer fitted (lut's codebook, nvfp4's tensor scale: `format.table_bytes` counts what is stored of it).
    Memory is allocated in whole blocks of BLOCK tokens (per-channel params: whole groups) as tokens arrive.
    `backend` (`kvq_lab.cache.routing.backends`) quantizes what is written and dequantizes what is read.
    outliers (`kvq_lab.quant.outliers.Outliers`, or None): dense-and-sparse; the elements its `mask` marks are kept out
        of their group's statistics (code 0) and stored exactly beside the codes: `out_val` [K] in the model's dtype
        (as sinks and windows are kept; fp16 models: 2 bytes) and `out_idx` int32 [K], the flat index
        ((b * H + h) * T_max + t) * D + d (T_max = 2^31 // (B * H * D)); `dequantize` puts them back.
        The same mask and quantizer call as simulated mode (`kvq_lab.quant.outliers.fake_quant`).
    residual (`kvq_lab.quant.residuals.Chain`, or None): corrections of the error each written token's codes leave
        (r = x - deq(x), 0 at outliers and padding), stored as `res` uint8 [B, H, units, unit_bytes(D)], one unit per
        `residual.block` positions (exactly the bytes the method stores, allocated as the codes grow); a unit not yet
        complete keeps its positions' error as fp16 in `pending` [B, H, k, D] (positions [pending_at, pending_at + k);
        GEAR's streaming buffer, counted by `nbytes`) until the writes complete it. `dequantize` adds the rebuild, and
        the pending fp16 error, as simulated mode does.
    """

    def __init__(self, spec: QuantSpec, backend, outliers: Outliers | None = None, residual: Chain | None = None):
        self.spec = spec
        self.outliers = outliers
        self.residual = residual
        self.res: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None  # fp16 error of an incomplete residual unit (block corrections)
        self.pending_at = 0
        self.out_val: torch.Tensor | None = None
        self.out_idx: torch.Tensor | None = None
        self.format = code_format(spec)
        self.backend = backend
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self.length = 0  # storage positions written (the furthest row)
        self.generation = 0  # bumped whenever codes, scale, zero or their widened copy become new tensors (growth): a
        # kept kernel call (`kvq_lab.kernels.cpu_kernel.KeptCall`) holds their addresses until then
        self._read: tuple | None = None  # (scale, zero) widened, for a format that `widens`; None: not made yet
        self.dims, self.device = (0, 0, 0), None  # (B, H, D) and device, set by the stream at prefill
        self.bits = self.format.code_bits
        u, nb = word_layout(self.bits)
        self._m, self._nb = BLOCK // u, nb  # rows per plane, bytes per word

    @property
    def reads_dequantized(self) -> bool:
        """What the kernels cannot read from codes alone is stored (sparse outliers, residual corrections): the
        history is read dequantized (`dequantize`), in PyTorch."""
        return self.outliers is not None or self.residual is not None

    # -- growth ------------------------------------------------------------------------------------------------
    def _reserve(self, n_tokens: int, like: torch.Tensor) -> None:
        """Grow storage to hold positions [0, n_tokens) for all B rows (`like`: [B or fewer, H, *, D])."""
        B, H, D = self.dims
        G, bits = self.spec.group_size, self.bits
        blocks = -(-n_tokens // BLOCK)
        rows = blocks * BLOCK * bits // 8
        if self.codes is None:
            fmt = self.format
            self.codes = like.new_zeros(B, H, 0, D, dtype=torch.uint8)
            p_last = D // G if self.spec.axis == "token" else D
            self.scale = like.new_zeros(B, H, 0, p_last, dtype=fmt.stored_dtype("scale"))
            has_zero = "zero" in fmt.params
            self.zero = like.new_zeros(B, H, 0, p_last, dtype=fmt.stored_dtype("zero")) if has_zero else None
            self.table = None if fmt.codes_are_values else fmt.table(like.device)
            if self.residual is not None:
                self.res = like.new_zeros(B, H, 0, self.residual.unit_bytes(D), dtype=torch.uint8)
        if rows > self.codes.shape[2]:
            self.generation += 1
            self.codes = torch.cat([self.codes, self.codes.new_zeros(B, H, rows - self.codes.shape[2], D)], 2)
        units = -(-blocks * BLOCK // self.residual.block) if self.res is not None else 0
        if self.res is not None and units > self.res.shape[2]:
            extra = self.res.new_zeros(B, H, units - self.res.shape[2], self.res.shape[3])
            self.res = torch.cat([self.res, extra], 2)
        n_par = blocks * BLOCK if self.spec.axis == "token" else -(-n_tokens // G)
        if n_par > self.scale.shape[2]:
            self.generation += 1
            self._read = None
            extra = (B, H, n_par - self.scale.shape[2], self.scale.shape[3])
            self.scale = torch.cat([self.scale, self.scale.new_zeros(extra)], 2)
            if self.zero is not None:
                self.zero = torch.cat([self.zero, self.zero.new_zeros(extra)], 2)

    # -- write -------------------------------------------------------------------------------------------------
    def write(self, x: torch.Tensor, t0: int, valid: torch.Tensor | None = None, rows: slice | None = None) -> None:
        """Quantize x [b, H, n, D] and store it at positions [t0, t0 + n) of batch rows `rows` (default: all).

        Per-channel groups need t0 and n to be multiples of G (groups are whole). `valid` [b, 1, n] excludes
        positions from min/max (their codes are 0). The bits of [t0, t0 + n) must not have been written before:
        codes are or-ed into zeroed storage, so older codes in a shared block are left exactly as they were.
        """
        n = x.shape[2]
        if n == 0:
            return
        G = self.spec.group_size
        if self.spec.axis == "channel" and (t0 % G or n % G):
            raise ValueError(f"per-channel history is written in whole groups of {G}; got t0={t0}, n={n}")
        rows = rows if rows is not None else slice(None)
        self._reserve(t0 + n, x)
        if self.outliers is not None:
            out = self.outliers.mask(x)  # [b, H, n, D]: kept exact, out of the group statistics
            if valid is not None:
                out = out & valid.to(torch.bool)[..., None]  # padding is no outlier (valid: [b, 1, n])
            self._keep_outliers(x, out, t0, rows)
            valid = ~out if valid is None else ~out & valid.to(torch.bool)[..., None]
        self.backend.write(self, x, t0, valid, rows)
        if self.residual is not None:
            self._keep_residual(x, t0, valid, rows)
        self.length = max(self.length, t0 + n)

    def _keep_residual(self, x: torch.Tensor, t0: int, valid: torch.Tensor | None, rows: slice) -> None:
        """Store the residual corrections of x [b, H, n, D] at positions [t0, t0 + n): the error of the codes just
        written (the reference's arithmetic, which every backend's quantizer reproduces bit for bit), 0 outside
        `valid` ([b, 1, n] positions or [b, H, n, D] elements)."""
        xf = x.float()
        r = xf - fake_quant(xf, self.spec, valid=valid, partial="exclude")
        if valid is not None:
            v = valid.to(torch.bool)
            r = torch.where(v if v.dim() == 4 else v[..., None], r, 0.0)
        n = self.residual.block
        if self.pending is not None:  # the writes continue an incomplete unit: complete it first
            if rows != slice(None) or t0 != self.pending_at + self.pending.shape[2]:
                raise ValueError(
                    f"positions [{t0}, {t0 + x.shape[2]}) do not continue the incomplete residual unit at "
                    f"{self.pending_at} for every row"
                )
            r, t0 = torch.cat([self.pending.float(), r], 2), self.pending_at
            self.pending = None
        if t0 % n:
            raise ValueError(f"residual units of {n} tokens start at multiples of {n}; got a write at {t0}")
        whole = r.shape[2] // n * n
        if whole:
            self.res[rows, :, t0 // n : (t0 + whole) // n] = self.residual.encode(r[:, :, :whole])[0]
        if whole < r.shape[2]:
            if rows != slice(None):
                raise ValueError(f"a write to some rows must fill whole residual units of {n} tokens")
            self.pending, self.pending_at = open_error(r[:, :, whole:]).to(torch.float16), t0 + whole

    def _keep_outliers(self, x: torch.Tensor, mask: torch.Tensor, t0: int, rows: slice) -> None:
        """Append the elements of x [b, H, n, D] under mask (same shape) to the sparse store, exactly (x's dtype)."""
        B, H, D = self.dims
        b, h, t, d = mask.nonzero(as_tuple=True)
        b = b + (rows.start or 0)
        t_max = (2**31 - 1) // (B * H * D)
        if t0 + x.shape[2] > t_max:
            raise ValueError(f"the sparse outlier index holds {t_max} tokens for batch {B}; got {t0 + x.shape[2]}")
        idx = (((b * H + h) * t_max + t0 + t) * D + d).to(torch.int32)
        val = x[mask]
        self.out_idx = idx if self.out_idx is None else torch.cat([self.out_idx, idx])
        self.out_val = val if self.out_val is None else torch.cat([self.out_val, val])

    def put(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, t0: int, rows: slice) -> None:
        """Store quantized positions [t0, t0 + n): codes uint8 [b, H, n, D] and their params in the reference's
        layout and dtype (as read: `QTensor`'s), zero None for formats without one (for backends that quantize
        outside the storage; `write` has reserved the room). Parameters are stored at their encoding's width."""
        if (zero is None) != (self.zero is None):
            raise ValueError(f"format={self.format.name} stores {', '.join(self.format.params)}; got zero={zero}")
        stored = self.format.encode_params(scale, zero)
        n, G = codes.shape[2], self.spec.group_size
        span = slice(t0, t0 + n) if self.spec.axis == "token" else slice(t0 // G, (t0 + n) // G)
        for dst, new in zip((self.scale, self.zero), stored, strict=True):
            if new is not None:
                dst[rows, :, span] = new
        if self._read is not None:  # the widened copy a kernel reads (and may keep): the same groups, read back
            for dst, new in zip(self._read, self.format.decode_params(*stored), strict=True):
                if new is not None:
                    dst[rows, :, span] = new
        self._or_codes(codes, t0, rows)

    def _or_codes(self, codes: torch.Tensor, t0: int, rows: slice) -> None:
        """Or codes [b, H, n, D] of positions t0.. into the packed storage (see the layout in `pack`)."""
        bits, m, nb = self.bits, self._m, self._nb
        wt = word_dtype(bits)  # int64 for 5-bit codes: the top code of a 40-bit word starts at bit 35
        n = codes.shape[2]
        dst = self.codes[rows]  # a view: rows is a slice
        if n == 1:  # a decode step: one token, its bits of one word (nb bytes)
            t = t0 % BLOCK
            row = t0 // BLOCK * nb * m + t % m
            w = codes.to(wt) << (bits * (t // m))
            for i in range(nb):
                dst[:, :, row + i * m : row + i * m + 1] += ((w >> (8 * i)) & 0xFF).to(torch.uint8)
            return
        t = torch.arange(t0, t0 + n, device=codes.device)
        k, r = (t % BLOCK) // m, (t % BLOCK) % m  # plane and row of each token within its block
        base = t // BLOCK * (nb * m) + r
        # each token owns bits [bits*k, bits*k + bits) of its word, zero until now: adding is an or
        w = codes.to(wt) << (k * bits).to(wt).view(1, 1, n, 1)
        for i in range(nb):
            dst.index_add_(2, base + i * m, ((w >> (8 * i)) & 0xFF).to(torch.uint8))

    # -- read --------------------------------------------------------------------------------------------------
    def dequantize(self, n: int) -> torch.Tensor:
        """fp32 [B, H, n, D]: table[code] * scale + zero, the reference's arithmetic (two roundings, no fma)."""
        if n == 0:
            return torch.zeros(*self.dims[:2], 0, self.dims[2], device=self.device)
        deq = self.backend.dequantize(self.codes, *self.read_params(), self.spec, n)
        if self.res is not None:
            deq = deq + self._correction(n)
        if self.out_idx is not None and self.out_idx.numel():
            B, H, D = self.dims
            t_max = (2**31 - 1) // (B * H * D)
            i = self.out_idx.long()
            d, rest = i % D, i // D
            t, bh = rest % t_max, rest // t_max
            sel = t < n
            deq[bh[sel] // H, bh[sel] % H, t[sel], d[sel]] = self.out_val[sel].to(deq.dtype)
        return deq

    def _correction(self, n: int) -> torch.Tensor:
        """fp32 [B, H, n, D]: the residual corrections of positions [0, n): the stored units' rebuild, the pending
        error where a unit is incomplete, 0 where nothing was written."""
        blk = self.residual.block
        done = self.pending_at if self.pending is not None else self.length // blk * blk
        units = min(-(-n // blk), done // blk)
        corr = self.residual.decode(self.res[:, :, :units], self.dims[2])[:, :, :n]
        if corr.shape[2] < n:
            corr = torch.cat([corr, corr.new_zeros(*corr.shape[:2], n - corr.shape[2], corr.shape[3])], 2)
        if self.pending is not None and self.pending_at < n:
            k = min(n, self.pending_at + self.pending.shape[2]) - self.pending_at
            corr[:, :, self.pending_at : self.pending_at + k] = self.pending[:, :, :k].float()
        return corr

    def read_params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scale, zero) as the formula and the kernels read them: the stored tensors for fp16 parameters, else the
        widened copy (`CodeFormat.decode_params`; see the class docstring). (None, None) before any write."""
        if not self.format.widens:
            return self.scale, self.zero
        if self._read is None:
            self._read = self.format.decode_params(self.scale, self.zero)
        return self._read

    def nbytes(self) -> int:
        """Codes and parameters as stored (at their encodings' widths), plus what the format keeps once per tensor
        (`format.table_bytes`: lut's codebook, nvfp4's fp32 tensor scale; int and fp8 tables are fixed by the
        format's name and width), sparse outliers and residual corrections (with an incomplete unit's fp16 error)."""
        table = self.format.table_bytes if self.codes is not None else 0
        sparse = tensor_bytes(self.out_val) + tensor_bytes(self.out_idx)  # value (model dtype) + int32 index
        kept = (self.codes, self.scale, self.zero, self.res, self.pending)
        return sum(tensor_bytes(t) for t in kept) + table + sparse


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes held by t (0 for None): the cache's byte accounting counts what is stored, as stored."""
    return 0 if t is None else t.numel() * t.element_size()
