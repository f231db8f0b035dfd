"""What the decode-attention kernels read: one decode step's packed K/V as plain tensors, no cache objects.

The cache builds a `DecodeView` from its layer at each fused decode step (`PackedLayer.decode_view`); every decode
attention here (`torch_path.decode_attention_torch`, `cpu_kernel.decode_attention`,
`triton.decode_attention`) takes that view and the query, and nothing else of the cache.

Positions of one tensor (keys or values) of a batch without padding, with S = `sink_tokens` and s = min(S, N):

    [0, s)          sinks, exact                       `StreamView.sink`
    [S, S + n)      quantized history (codes + params)  `StreamView.codes/scale/zero`, storage positions [0, n)
    [N - w, N)      the full-precision window           the last w rows of `StreamView.window`

Every position is in exactly one segment. Keys and values split differently (their windows differ).

Three extensions, each None unless the layer's backend declares it reads them (`Backend.features`):
    rope   (`RopeView`) rope=pre keys: the history's keys are quantized pre-RoPE; the kernel rotates each history
           key row at its position id (`transformers` Llama's `rotate_half` convention) from a shared cos/sin
           table. Sinks and window are exact post-RoPE keys, as the model made them, and are read as they are.
    pads   left-padded batches: row b has `pads[b]` padding positions first (never attended), then its own sinks
           (`sink[b, :, j]` is its real token j < S), then its stream positions; a stream's storage position t of
           row b is absolute position `StreamView.starts[b] + t`, history while t < `StreamView.counts[b]`, and
           every later position of the row is in the window (its last rows, by absolute position).
    hadamard  (n_k, n_v): keys stored in the Hadamard basis of blocks of n_k channels (`hadamard` transform,
           H/sqrt(n)) and values in that of n_v, 0 for a tensor stored as it is: the kernel maps the query into the
           keys' basis before the scores and the output back from the values' basis after the weighted sum (sinks
           are in the basis already). Without it the caller makes those two maps around the kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StreamView(NamedTuple):
    """One tensor's stored segments (keys or values of one layer), as the cache holds them.

    sink: [B, H, >= s, D] exact tokens; the first s rows are attended.
    codes: uint8 [B, H, rows, D] bit-packed along tokens (`kvq_lab.quant.pack` layout), or None (nothing quantized).
    scale, zero: [B, H, T, D/G] (axis `token`) or [B, H, T/G, D] (axis `channel`); None with codes. As read: fp16,
        or fp32 where the format's stored encoding reads as fp32 (mxfp4's e8m0 scale), widened by the cache from the
        bytes it stores (`PackedStore.read_params`). zero is also None where the code format stores no zero point
        (fp8): then x' = table[code] * scale.
    n: quantized history tokens (storage positions [0, n)).
    window: [B, H, W, D] full-precision buffer (W >= w); its last w rows are the window's tokens.
    w: window tokens.
    bits, group_size, axis: the code layout (`bits` per stored code); `axis` is the grouping axis, "token" or
        "channel".
    history: fp32 [B, H, n, D], the history already dequantized (pre-RoPE keys re-rotated at their positions), or
        None. Only the PyTorch path reads it; kernels that read codes refuse a view that carries it.
    table: fp32 [2^bits], contiguous, on the codes' device: the value of each code before scale and zero
        (`kvq_lab.quant.formats`: x' = table[code] * scale + zero). None: every code is its own value (int), so
        kernels use the code itself, exactly as before formats existed.
    starts, counts: int64 [B] with `DecodeView.pads` (left-padded batches): row b's storage position t is absolute
        position starts[b] + t, quantized history while t < counts[b] (n = max(counts)). None without padding.
    """

    sink: torch.Tensor
    codes: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    n: int
    window: torch.Tensor
    w: int
    bits: int
    group_size: int
    axis: str
    history: torch.Tensor | None = None
    table: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    counts: torch.Tensor | None = None


class RopeView(NamedTuple):
    """rope=pre keys for a kernel that rotates them itself: history key row at cache position p of batch row b is
    rotated by the angle of position id `pos[b, p]` (sinks and window rows are post-RoPE already):
        k[i]       = k_pre[i] * cos[i] - k_pre[i + D/2] * sin[i]
        k[i + D/2] = k_pre[i + D/2] * cos[i] + k_pre[i] * sin[i]          (i < D/2)
    which is `k_pre * cos + rotate_half(k_pre) * sin` with the model's duplicated halves of cos/sin.

    cos, sin: fp32 [P, D/2], contiguous: row p the model's rotary module at position id p (attention scaling
        included), shared by all layers. pos: int32 [B, >= N], stride 1 along positions; every id < P.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor


class DecodeView(NamedTuple):
    """One layer's packed K/V at a decode step: N cached tokens, S = `sink_tokens` (history starts at S).

    rope: rope=pre keys to rotate in the kernel (`RopeView`), or None. pads: int64 [B] left-padding positions per
    row, or None (no padding; the module docstring gives the padded layout and `StreamView.starts/counts`).
    hadamard: (n_k, n_v) Hadamard blocks of the stored keys and values for the kernel to fold, or None."""

    keys: StreamView
    values: StreamView
    N: int
    sink_tokens: int
    rope: RopeView | None = None
    pads: torch.Tensor | None = None
    hadamard: tuple[int, int] | None = None


class Unsupported(ValueError):
    """A decode attention cannot take this view, query or mask as they are (an extension it does not read, a mask per
    query head, a dtype): raised before any work, so the caller can rebuild the view or take another path
    (`kvq_lab.cache.routing.attention` does)."""


def check_codes_only(view: DecodeView, kernel: str) -> None:
    """Kernels that read codes cannot apply a pre-dequantized history (rope=pre keys): fail rather than ignore it."""
    if view.keys.history is not None or view.values.history is not None:
        raise ValueError(
            f"{kernel} reads the packed codes; this view carries a dequantized history (rope=pre keys): "
            "use torch_path.decode_attention_torch"
        )
