"""Bit packing of quantization codes: the storage layout of the packed cache, and its byte accounting.

Layout (shared by the PyTorch path and the Triton kernels; tested bit for bit against each other):

    codes [..., T, D] (uint8, one code per element)  ->  packed [..., T * bits / 8, D] (uint8)

Codes are packed along the *token* axis, in blocks of `BLOCK` tokens, channel by channel. A block's codes are
cut into `u` planes of `m = BLOCK / u` tokens (u = codes per word, see `word_layout`); word `r` of channel `d`
holds the codes of tokens `r, r + m, r + 2m, ...` of the block, least significant first:

    word[r, d] = sum_k code[k * m + r, d] << (bits * k)          k = 0 .. u-1

and is stored as `nb` little-endian bytes, each byte plane contiguous: block rows `[nb, m, D]`.
    bits 1, 2, 4, 8 -> a word is one byte holding 8, 4, 2, 1 codes;
    bits 3          -> a word is 3 bytes holding 8 codes (24 bits, nothing wasted);
    bits 5          -> a word is 5 bytes holding 8 codes (40 bits: held in an int64 while packing, `word_dtype`).

Why along tokens, plane-major: unpacking is then `(packed[None] >> shifts) & mask` over long contiguous runs of
`m * D` bytes, which PyTorch on CPU does ~7x faster than unpacking codes interleaved along channels (a size-4
innermost broadcast); and a block of tokens is independent of the blocks before it, so the cache appends
blocks without touching older ones. Per-token streams that append one token at a time rewrite the bits of the
current (partial) block only: its codes are unpacked and repacked losslessly, never re-quantized.

Byte accounting: a block is allocated whole, so `T` tokens take `ceil(T / BLOCK) * BLOCK * bits / 8` bytes per
channel; each parameter the code format declares takes its stored width per group (`CodeFormat.param_encodings`:
fp16, 2 bytes, unless the format says otherwise; int: scale and zero point; fp8: scale only; nvfp4, mxfp4: a one-byte
e4m3 / e8m0 scale). At 2 bits (int), G = 32, T a multiple of 32: 2 + 2 * 16 / 32 = 3 bits per element (5.33x smaller
than fp16); fp8, G = 32: 8 + 16 / 32 = 8.5; nvfp4, G = 16: 4 + 8 / 16 = 4.5; mxfp4, G = 32: 4.25. The integer
arithmetic of the layout is `kvq_lab.quant.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layout import BLOCK, packed_rows, padded_tokens, word_layout
from .reference import QTensor, code_format
from .spec import QuantSpec

__all__ = [
    "BLOCK",
    "PackedQTensor",
    "pack",
    "packed_rows",
    "pad_tokens",
    "padded_tokens",
    "plane_shifts",
    "qtensor_nbytes",
    "unpack",
    "word_dtype",
    "word_layout",
]


def pack(codes: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """codes uint8 [..., T, D] (T a multiple of `block`, every code < 2^bits) -> packed uint8 [..., T*bits/8, D]."""
    *lead, T, D = codes.shape
    u, nb = word_layout(bits)
    if T % block or block % u:
        raise ValueError(f"pack needs T ({T}) a multiple of block ({block}), and block a multiple of {u}")
    m, nblk = block // u, T // block
    # [..., nblk, u, m, D]: plane k of a block holds tokens k*m .. k*m+m-1
    c = codes.reshape(*lead, nblk, u, m, D)
    if nb == 1:
        # planes occupy disjoint bits, so the sum of the shifted planes is their bitwise or (no carries)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).view(u, 1, 1)
        return (c << shifts).sum(-3, dtype=torch.uint8).reshape(*lead, nblk * m, D)
    wt = word_dtype(bits)
    shifts = torch.arange(0, bits * u, bits, dtype=wt, device=codes.device).view(u, 1, 1)
    w = (c.to(wt) << shifts).sum(-3)  # [..., nblk, m, D], a 24- or 40-bit word per (row, channel)
    planes = torch.stack([(w >> (8 * i)) & 0xFF for i in range(nb)], dim=-3)  # [..., nblk, nb, m, D]
    return planes.to(torch.uint8).reshape(*lead, nblk * nb * m, D)


def word_dtype(bits: int) -> torch.dtype:
    """The integer dtype that holds one word of `bits`-bit codes while packing or unpacking several bytes: int32 up
    to 24-bit words (3 bits), int64 for 40-bit words (5 bits), whose upper codes would overflow an int32."""
    _, nb = word_layout(bits)
    return torch.int64 if 8 * nb > 31 else torch.int32


_SHIFTS: dict = {}


def plane_shifts(bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[u, 1, 1] shift of each plane, built once per (bits, dtype, device): unpacking runs every decode step."""
    key = (bits, dtype, device)
    if key not in _SHIFTS:
        u, _ = word_layout(bits)
        _SHIFTS[key] = torch.arange(0, bits * u, bits, dtype=dtype, device=device).view(u, 1, 1)
    return _SHIFTS[key]


def unpack(packed: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Inverse of `pack`: packed uint8 [..., T*bits/8, D] -> codes uint8 [..., T, D]."""
    *lead, rows, D = packed.shape
    u, nb = word_layout(bits)
    m = block // u
    nblk = rows // (nb * m)
    if nblk * nb * m != rows:
        raise ValueError(f"{rows} byte rows are not whole blocks of {nb * m} rows ({bits}-bit, block {block})")
    if nb == 1:
        w = packed.view(*lead, nblk, 1, m, D)
        c = (w >> plane_shifts(bits, torch.uint8, packed.device)) & ((1 << bits) - 1)
    else:
        p = packed.view(*lead, nblk, nb, m, D)
        wt = word_dtype(bits)
        w = p[..., 0, :, :].to(wt)
        for i in range(1, nb):
            w = w | (p[..., i, :, :].to(wt) << (8 * i))
        c = ((w.unsqueeze(-3) >> plane_shifts(bits, wt, packed.device)) & ((1 << bits) - 1)).to(torch.uint8)
    return c.reshape(*lead, nblk * block, D)


def pad_tokens(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Zero-pad dim -2 of [..., T, D] up to whole blocks."""
    pad = padded_tokens(x.shape[-2], block) - x.shape[-2]
    return F.pad(x, (0, 0, 0, pad)) if pad else x


@dataclass
class PackedQTensor:
    """A `QTensor` with its codes bit-packed: what the packed cache stores for a chunk of quantized tokens.

    packed: uint8 [B, H, ceil(T_pad / BLOCK) * BLOCK * bits / 8, D]; scale, zero: the parameters of `QTensor` as the
    format stores them (fp16; uint8 where it declares a one-byte encoding: nvfp4's e4m3, mxfp4's e8m0), zero None
    where the format stores none. `read_params` widens them to what the dequantize formula and the kernels read.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    length: int
    dtype: torch.dtype
    block: int = BLOCK

    @classmethod
    def from_qtensor(cls, q: QTensor, block: int = BLOCK) -> PackedQTensor:
        fmt = code_format(q.spec)
        packed = pack(pad_tokens(q.codes, block), fmt.code_bits, block)
        return cls(packed, *fmt.encode_params(q.scale, q.zero), q.spec, q.length, q.dtype, block)

    def read_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero) as read: the stored parameters widened (`CodeFormat.decode_params`; fp16 ones as they are)."""
        return code_format(self.spec).decode_params(self.scale, self.zero)

    def to_qtensor(self) -> QTensor:
        G = self.spec.group_size
        t_pad = -(-self.length // G) * G if self.spec.axis == "channel" else self.length
        codes = unpack(self.packed, code_format(self.spec).code_bits, self.block)[..., :t_pad, :].contiguous()
        return QTensor(codes, *self.read_params(), self.spec, self.length, self.dtype)

    def nbytes(self) -> int:
        """Bytes stored: packed codes plus the format's parameters at their stored width."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero) if t is not None)

    def fp16_nbytes(self) -> int:
        """Bytes of the same tokens held as fp16."""
        B, H, _, D = self.packed.shape
        return B * H * self.length * D * 2


def qtensor_nbytes(n_tokens: int, D: int, spec: QuantSpec, block: int = BLOCK) -> int:
    """Arithmetic bytes of one [1, 1, n_tokens, D] quantized tensor in this layout (whole blocks, whole groups):
    codes plus the parameters the spec's format declares at their stored width (int: fp16 scale and zero point;
    fp8: fp16 scale; nvfp4, mxfp4: a one-byte scale)."""
    fmt = code_format(spec)
    codes = packed_rows(n_tokens, fmt.code_bits, block) * D
    groups = n_tokens * (D // spec.group_size) if spec.axis == "token" else -(-n_tokens // spec.group_size) * D
    return codes + groups * fmt.param_bytes_per_group
