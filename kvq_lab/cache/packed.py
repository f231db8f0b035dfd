"""Packed ("real") cache layer: low-bit codes in memory, KIVI's streaming, exact prefill attention.

What is stored, per layer (positions are absolute cache positions 0..N-1; row b of a left-padded batch has
`p_b` padding positions first, then its real tokens j = 0, 1, ...):
    sinks    the first `sink_tokens` real tokens of each row, exact (post-RoPE keys, as the model made them).
    history  quantized tokens, codes bit-packed along tokens (`kvq_lab.quant.pack`), fp16 scale/zero per group.
    window   the most recent tokens in full precision, a fixed buffer of `residual_length` (R) tokens.

Streaming follows the grouping axis of each tensor (so any axis works for keys or values):
    per-channel (groups of G tokens, KIVI's keys): the window fills to R (or G when R = 0), then all of it is
        quantized at once, R/G whole groups; after a prefill of L tokens, (L - sinks) mod R stay full precision.
    per-token (groups of G channels, KIVI's values): a sliding window of the last R tokens; the oldest token is
        quantized as it leaves. R = 0 quantizes every token on arrival.
Quantized history is never re-quantized: a step quantizes at most one new block and writes its bits next to the
older ones (per-channel: the R-token window; per-token: the packing block of 32 tokens that the leaving token
opens, coded at once because per-token codes depend on the token alone; its other tokens are still in the
window, attended exactly, and their codes are read only once they leave).

Prefill attention runs on the exact keys and values (the model's own attention on what it just computed); the
cache quantizes afterwards, as KIVI does.

Left-padded batches: per-channel groups are aligned on each row's *real* tokens (row b's groups start at its
first non-sink token, position p_b + sink_tokens), and each row keeps its own count of quantized tokens and
window tokens, so every row stores exactly what it would store alone, for every axis, sink and window setting
(tested bit for bit). A batch then generates what each prompt generates alone as far as the model's own
batched arithmetic (masked SDPA over padding, batched matmuls) reproduces the single-prompt K/V: it did in the
tests; a last-bit difference there could in principle flip a code or a near-tied greedy token.
Per-token groups never span tokens, so they need no alignment: their history and window are
indexed by absolute position for all rows (a row's padding and sink positions hold unused zero codes). Pad
positions never enter a group's min/max. Ragged batches assemble full K/V per step with one gather (slower than
the batch-1 path, exact); the fused decode path below serves unpadded batches.

Decode attention: with `QuantizedKVCache.for_model` on an `sdpa` model, the model's attention is routed through
`kvq_sdpa` (registered here), which hands ordinary tensors to SDPA unchanged and, on decode steps, receives the
layer itself (`PackedKV`) instead of K/V tensors. The backend's `decode_attention` then attends over the packed
storage: `backend=cpu` (the CPU default) and `backend=triton` with a fused kernel that reads the packed bytes
(no buffer of the cache's size); `backend=torch`, the pure-PyTorch path below, builds each of K and V for this
step in a reused fp32 workspace (sinks and window copied, history unpacked and dequantized in place) and calls
SDPA with the query heads grouped per kv head (no repeat_kv). Nothing dequantized outlives the step; `nbytes()`
counts only what is stored. Without the routing (another attention implementation, or a cache built directly),
`update` returns dequantized K/V and the model's attention runs as usual.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvq_lab.quant.pack import BLOCK, plane_shifts, unpack, word_layout
from kvq_lab.quant.reference import quantize
from kvq_lab.quant.spec import QuantSpec

from .base import QuantizedLayerBase, register_layer

ATTN_NAME = "kvq_sdpa"


# ----------------------------------------------------------------------------------------------------------------
# Storage: packed codes + fp16 params of one tensor's quantized history
# ----------------------------------------------------------------------------------------------------------------


class PackedStore:
    """Quantized history of one `[B, H, T, D]` tensor, indexed by storage position t (0 = first quantized slot).

    codes: uint8 [B, H, n_blocks * BLOCK * bits / 8, D] (`kvq_lab.quant.pack` layout), zero beyond what is written.
    scale, zero: fp16 [B, H, T_cap, D/G] (per-token groups) or [B, H, T_cap/G, D] (per-channel groups).
    Memory is allocated in whole blocks of BLOCK tokens (per-channel params: whole groups) as tokens arrive.
    """

    def __init__(self, spec: QuantSpec, backend):
        self.spec = spec
        self.backend = backend
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.length = 0  # storage positions written (the furthest row)
        self.dims, self.device = (0, 0, 0), None  # (B, H, D) and device, set by the layer at prefill
        u, nb = word_layout(spec.bits)
        self._m, self._nb = BLOCK // u, nb  # rows per plane, bytes per word

    # -- growth ------------------------------------------------------------------------------------------------
    def _reserve(self, n_tokens: int, like: torch.Tensor) -> None:
        """Grow storage to hold positions [0, n_tokens) for all B rows (`like`: [B or fewer, H, *, D])."""
        B, H, D = self.dims
        G, bits = self.spec.group_size, self.spec.bits
        blocks = -(-n_tokens // BLOCK)
        rows = blocks * BLOCK * bits // 8
        if self.codes is None:
            self.codes = like.new_zeros(B, H, 0, D, dtype=torch.uint8)
            p_last = D // G if self.spec.axis == "token" else D
            self.scale = like.new_zeros(B, H, 0, p_last, dtype=torch.float16)
            self.zero = self.scale.clone()
        if rows > self.codes.shape[2]:
            self.codes = torch.cat([self.codes, self.codes.new_zeros(B, H, rows - self.codes.shape[2], D)], 2)
        n_par = blocks * BLOCK if self.spec.axis == "token" else -(-n_tokens // G)
        if n_par > self.scale.shape[2]:
            extra = self.scale.new_zeros(B, H, n_par - self.scale.shape[2], self.scale.shape[3])
            self.scale = torch.cat([self.scale, extra], 2)
            self.zero = torch.cat([self.zero, extra], 2)

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
        if hasattr(self.backend, "quantize_into"):  # a kernel that quantizes and packs straight into storage
            self.backend.quantize_into(self, x, t0, valid, rows)
            self.length = max(self.length, t0 + n)
            return
        codes, scale, zero = self.backend.quantize(x, self.spec, valid)
        if self.spec.axis == "token":
            self.scale[rows, :, t0 : t0 + n] = scale
            self.zero[rows, :, t0 : t0 + n] = zero
        else:
            self.scale[rows, :, t0 // G : (t0 + n) // G] = scale
            self.zero[rows, :, t0 // G : (t0 + n) // G] = zero
        self._or_codes(codes, t0, rows)
        self.length = max(self.length, t0 + n)

    def _or_codes(self, codes: torch.Tensor, t0: int, rows: slice) -> None:
        """Or codes [b, H, n, D] of positions t0.. into the packed storage (see the layout in `pack`)."""
        bits, m, nb = self.spec.bits, self._m, self._nb
        n = codes.shape[2]
        dst = self.codes[rows]  # a view: rows is a slice
        if n == 1:  # a decode step: one token, its bits of one word (nb bytes)
            t = t0 % BLOCK
            row = t0 // BLOCK * nb * m + t % m
            w = codes.to(torch.int32) << (bits * (t // m))
            for i in range(nb):
                dst[:, :, row + i * m : row + i * m + 1] += ((w >> (8 * i)) & 0xFF).to(torch.uint8)
            return
        t = torch.arange(t0, t0 + n, device=codes.device)
        k, r = (t % BLOCK) // m, (t % BLOCK) % m  # plane and row of each token within its block
        base = t // BLOCK * (nb * m) + r
        # each token owns bits [bits*k, bits*k + bits) of its word, zero until now: adding is an or
        w = codes.to(torch.int32) << (k * bits).to(torch.int32).view(1, 1, n, 1)
        for i in range(nb):
            dst.index_add_(2, base + i * m, ((w >> (8 * i)) & 0xFF).to(torch.uint8))

    # -- read --------------------------------------------------------------------------------------------------
    def codes_u8(self, n: int) -> torch.Tensor:
        """Codes of positions [0, n) (rounded up to whole blocks): uint8 [B, H, ceil(n/BLOCK)*BLOCK, D]."""
        rows = -(-n // BLOCK) * BLOCK * self.spec.bits // 8
        return self.backend.unpack(self.codes[:, :, :rows], self.spec.bits)

    def params(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scale and zero of positions [0, n): [B, H, n, D/G] or [B, H, n/G, D]."""
        k = n if self.spec.axis == "token" else n // self.spec.group_size
        return self.scale[:, :, :k].float(), self.zero[:, :, :k].float()

    def dequantize(self, n: int) -> torch.Tensor:
        """fp32 [B, H, n, D]: code * scale + zero, the reference's arithmetic (two roundings, no fma)."""
        if n == 0:
            return torch.zeros(*self.dims[:2], 0, self.dims[2], device=self.device)
        return self.backend.dequantize(self.codes, self.scale, self.zero, self.spec, n)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)


_CONST: dict = {}


def _const(name: str, device, make):
    """Small constant tensors, built once per device (avoids an allocation per decode step)."""
    key = (name, device)
    if key not in _CONST:
        _CONST[key] = make().to(device)
    return _CONST[key]


def quantize_whole_groups(x: torch.Tensor, spec: QuantSpec):
    """`reference.quantize` for x [B, H, T, D] made of whole groups and no padding, in fewer ops (decode steps).

    Bit for bit the reference's arithmetic (tested): same min/max, outward fp16 rounding, IEEE division, round
    half to even. A zero-width group divides 0 by a tiny positive number instead of selecting 0: same code, 0.
    Returns codes uint8 [B, H, T, D] and fp16 scale, zero in the reference's parameter layout.
    """
    B, H, T, D = x.shape
    G, L = spec.group_size, spec.levels
    xf = x.float()
    g = xf.view(B, H, T, D // G, G) if spec.axis == "token" else xf.view(B, H, T // G, G, D).transpose(-1, -2)
    mn, mx = torch.aminmax(g, dim=-1)
    neg = _const("-inf16", x.device, lambda: torch.tensor(float("-inf"), dtype=torch.float16))
    pos = _const("+inf16", x.device, lambda: torch.tensor(float("inf"), dtype=torch.float16))
    zero = mn.half()
    zero = torch.where(zero.float() > mn, zero.nextafter(neg), zero)  # fp16, rounded down
    z = zero.float()
    want = (mx - z) / L
    scale = want.half()
    scale = torch.where(scale.float() < want, scale.nextafter(pos), scale)  # fp16, rounded up
    s = scale.float().clamp_min(1e-38)
    codes = torch.round((g - z.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, L).to(torch.uint8)
    if spec.axis == "token":
        return codes.view(B, H, T, D), scale, zero
    return codes.transpose(-1, -2).reshape(B, H, T, D), scale, zero


class TorchBackend:
    """`backend=torch`, the pure-PyTorch path: the reference quantizer, `pack.unpack`, vectorised dequantization.
    Quantization and storage of every CPU backend; decode attention is `decode_attention_torch`."""

    name = "torch"

    @staticmethod
    def quantize(x, spec, valid):
        if valid is None and (spec.axis == "token" or x.shape[2] % spec.group_size == 0):
            return quantize_whole_groups(x, spec)
        q = quantize(x, spec, valid=valid, partial="exclude")
        return q.codes[:, :, : x.shape[2]], q.scale, q.zero

    @staticmethod
    def unpack(packed, bits):
        return unpack(packed, bits)

    @staticmethod
    def dequantize(codes, scale, zero, spec, n):
        B, H, _, D = codes.shape
        G = spec.group_size
        c = unpack(codes[:, :, : -(-n // BLOCK) * BLOCK * spec.bits // 8], spec.bits)[:, :, :n].float()
        if spec.axis == "token":
            x = c.view(B, H, n, D // G, G) * scale[:, :, :n, :, None].float() + zero[:, :, :n, :, None].float()
        else:
            s, z = scale[:, :, : n // G].float(), zero[:, :, : n // G].float()
            x = c.view(B, H, n // G, G, D) * s[:, :, :, None, :] + z[:, :, :, None, :]
        return x.view(B, H, n, D)


_WARNED: set = set()


def _cpu_kernel_builds() -> bool:
    from kvq_lab.quant import cpu_kernel

    err = cpu_kernel.build_error()
    if err is not None and "auto" not in _WARNED:
        _WARNED.add("auto")
        first = err.splitlines()[0]
        warnings.warn(f"backend=auto: {first}; the packed cache uses the PyTorch path (backend=torch)", stacklevel=3)
    return err is None


class CpuBackend(TorchBackend):
    """`backend=cpu`: the PyTorch path's quantization and storage, decode attention in one native call per layer
    (`kvq_lab.quant.cpu_kernel`, compiled on first use)."""

    name = "cpu"

    @staticmethod
    def decode_attention(layer, query, mask, scaling):
        from kvq_lab.quant import cpu_kernel

        return cpu_kernel.decode_attention(layer, query, mask, scaling)


def get_backend(name: str):
    """`torch`, `cpu`, `triton`, or `auto` (Triton when CUDA is present, else the CPU kernel where it builds, else
    torch). Triton is imported only when chosen."""
    if name == "auto":
        name = "triton" if torch.cuda.is_available() else "cpu" if _cpu_kernel_builds() else "torch"
    if name == "torch":
        return TorchBackend
    if name == "cpu":
        from kvq_lab.quant import cpu_kernel

        cpu_kernel.load()  # fail at cache creation, with the compiler's message, not in the middle of generate
        return CpuBackend
    from kvq_lab.quant import triton_kernels

    return triton_kernels.TritonBackend


# ----------------------------------------------------------------------------------------------------------------
# Streams: one tensor's sinks-excluded history and window, with the axis's streaming policy
# ----------------------------------------------------------------------------------------------------------------


class SlidingStream:
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
        self.spec, self.R, self.S = spec, R, S
        self.store = PackedStore(spec, backend)
        self.window: torch.Tensor | None = None
        self.done = 0  # storage positions with codes (>= the quantized count: a block may be coded early)

    def n_quantized(self, N: int) -> int:
        return max(0, N - self.R - self.S)

    def prefill(self, x: torch.Tensor, pads: list[int]) -> None:
        """x [B, H, N, D]; pads: p_b per row. Quantizes positions [S, N - R)."""
        N = x.shape[2]
        q = self.n_quantized(N)
        if q:
            self.store.write(x[:, :, self.S : self.S + q], 0, self._valid(0, q, pads, x.device))
        self.done = q
        self.window = _last(x, self.R)

    def _valid(self, t0: int, n: int, pads: list[int], device) -> torch.Tensor | None:
        """[B, 1, n] bool: storage positions [t0, t0 + n) that are history of each row (None: all rows, all)."""
        if not any(pads):
            return None
        a = torch.arange(self.S + t0, self.S + t0 + n, device=device)
        return (a >= torch.tensor(pads, device=device)[:, None] + self.S)[:, None, :]

    def step(self, x: torch.Tensor, N: int, pads: list[int]) -> None:
        """Append x [B, H, 1, D] at absolute position N (pads: p_b per row)."""
        both = torch.cat([self.window, x], 2) if self.R else x  # absolute positions [N - R, N]
        t = N - self.R - self.S  # storage position of the token leaving the window
        if t >= self.done:
            k = min(BLOCK - t % BLOCK, self.R + 1)  # up to the end of its block, from what has arrived
            self.store.write(both[:, :, :k], t, self._valid(t, k, pads, x.device))
            self.done = t + k
        if self.R:
            self.window = both[:, :, 1:]

    def nbytes(self) -> int:
        return self.store.nbytes() + _nb(self.window)


class FillStream:
    """Per-channel groups: an fp window fills to Rp = R (or G when R = 0) tokens, then is quantized at once.

    Indexed per row by real non-sink token: storage position i of row b holds absolute position p_b + S + i,
    so groups align on each row's own tokens. q[b] tokens quantized, w[b] in the window.
    window: [B, H, Rp, D], absolute positions [N - Rp, N); row b's window is its last w[b] entries.
    """

    def __init__(self, spec, R, S, backend):
        self.spec, self.S = spec, S
        self.Rp = R if R else spec.group_size
        self.store = PackedStore(spec, backend)
        self.window: torch.Tensor | None = None
        self.q: list[int] = []
        self.w: list[int] = []

    def prefill(self, x: torch.Tensor, pads: list[int]) -> None:
        """x [B, H, N, D]; pads: p_b per row (padding positions first)."""
        B, H, N, D = x.shape
        S, Rp = self.S, self.Rp
        ell = [max(0, N - p - S) for p in pads]  # non-sink real tokens per row
        f = [e // Rp * Rp for e in ell]  # quantized now: whole windows
        self.q, self.w = f, [e - k for e, k in zip(ell, f, strict=True)]
        if max(f) and all(p == pads[0] for p in pads):
            s0 = pads[0] + S
            self.store.write(x[:, :, s0 : s0 + f[0]], 0)
        else:
            for b, (p, k) in enumerate(zip(pads, f, strict=True)):  # ragged rows: one write per row (prefill only)
                if k:
                    self.store.write(x[b : b + 1, :, p + S : p + S + k], 0, rows=slice(b, b + 1))
        self.window = _last(x, Rp)

    def step(self, x: torch.Tensor, owns: list[bool] | None) -> None:
        """Append x [B, H, 1, D]; owns[b]: the token is a real non-sink token of row b (None: every row)."""
        self.window = torch.cat([self.window, x], 2)[:, :, 1:]
        for b in range(len(self.w)):
            self.w[b] += 1 if owns is None else owns[b]
        full = [b for b, w in enumerate(self.w) if w == self.Rp]
        if not full:
            return
        if len(full) == len(self.w) and all(k == self.q[0] for k in self.q):
            self.store.write(self.window, self.q[0])
        else:
            for b in full:  # rows flush at different steps in a ragged batch: once per Rp steps per row
                self.store.write(self.window[b : b + 1], self.q[b], rows=slice(b, b + 1))
        for b in full:
            self.q[b] += self.Rp
            self.w[b] = 0

    def nbytes(self) -> int:
        return self.store.nbytes() + _nb(self.window)


class ExactStream:
    """16 bits: the tensor is kept as it is (DynamicCache's behaviour, bit for bit)."""

    def __init__(self):
        self.x: torch.Tensor | None = None

    def append(self, x):
        self.x = x if self.x is None else torch.cat([self.x, x], 2)

    def nbytes(self) -> int:
        return _nb(self.x)


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _last(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last n positions of x [B, H, N, D], zero-padded on the left when N < n."""
    N = x.shape[2]
    return x[:, :, N - n :].clone() if N >= n else F.pad(x, (0, 0, n - N, 0))


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


class PackedKV:
    """What `update` hands the attention function on fused decode steps: the layer itself, not tensors."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer


@register_layer("packed")
class PackedLayer(QuantizedLayerBase):
    """One attention layer's packed cache (see the module docstring for the storage and streaming rules)."""

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._args = (cfg, rope, padding)
        self.backend = get_backend(cfg.backend)
        self.fused = False  # set by `prepare_model` when the model's attention is routed through kvq_sdpa
        self.N = 0
        self.pads: list[int] = []
        self.sink_k = self.sink_v = None
        self.k_stream = self._make_stream(cfg.key)
        self.v_stream = self._make_stream(cfg.value)
        self._pos: torch.Tensor | None = None  # rope=pre: position ids [B, N] (int32) to re-rotate keys

    def _make_stream(self, spec):
        c = self.cfg
        if spec.is_identity:
            return ExactStream()
        cls = SlidingStream if spec.axis == "token" else FillStream
        return cls(spec, c.residual_length, c.sink_tokens, self.backend)

    # -- hooks ---------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_model(model, cache) -> None:
        """Route an `sdpa` model's attention through `kvq_sdpa`, so decode steps read the packed cache directly.

        The routed function passes ordinary tensors to SDPA unchanged, so other caches see the same model.
        """
        cfg = model.config
        impl = getattr(cfg, "_attn_implementation", None)
        if impl == "sdpa":
            model.set_attn_implementation(ATTN_NAME)
            impl = ATTN_NAME
        if impl == ATTN_NAME:
            for layer in cache.layers:
                layer.fused = True

    def get_seq_length(self) -> int:
        return self.N

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.N + query_length, 0

    @property
    def uniform(self) -> bool:
        """No padding: every row has the same layout, so K/V segments are plain slices."""
        return not any(self.pads)

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        B, H, n, D = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_finite(key_states, value_states)
        identity = isinstance(self.k_stream, ExactStream) and isinstance(self.v_stream, ExactStream)
        if identity:  # 16 bits: exactly DynamicCache
            self.k_stream.append(key_states)
            self.v_stream.append(value_states)
            self.N += n
            return self.k_stream.x, self.v_stream.x

        pre_k = key_states
        if self.rope is not None:
            pos = _positions(kwargs, B, self.N, n, key_states.device)
            self._pos = pos if self._pos is None else torch.cat([self._pos, pos], 1)
            cos, sin = self.rope.cos_sin(key_states, pos)
            pre_k = self.rope.unrotate(key_states, cos, sin)

        if self.N == 0:
            self._prefill(key_states, pre_k, value_states)
            # prefill attention runs on exactly what the model computed
            return key_states, value_states
        if n > 1:
            # several new tokens on a non-empty cache (chunked prefill): absorbed one by one, attention on the
            # dequantized cache
            for t in range(n):
                self._step(key_states[:, :, t : t + 1], pre_k[:, :, t : t + 1], value_states[:, :, t : t + 1])
            return self.materialize()
        self._step(key_states, pre_k, value_states)
        if self.fused and self.uniform and not isinstance(self.k_stream, ExactStream):
            if isinstance(self.v_stream, ExactStream):
                return self.materialize()
            handle = PackedKV(self)
            return handle, handle
        return self.materialize()

    def _prefill(self, k, pre_k, v):
        B, H, N, D = k.shape
        S = self.cfg.sink_tokens
        real = self.padding.valid(B, N) if self.padding is not None else None
        if real is not None:
            if not bool((real[:, 1:] >= real[:, :-1]).all()):
                raise ValueError("the packed cache supports left padding only (attention mask 0...0 1...1 per row)")
            self.pads = (N - real.sum(1)).tolist()
        else:
            self.pads = [0] * B
        self.N = N
        for stream in (self.k_stream, self.v_stream):
            if not isinstance(stream, ExactStream):
                stream.store.dims, stream.store.device = (B, H, D), k.device
        # sinks: the first S real tokens of each row, exact
        idx = (torch.tensor(self.pads, device=k.device)[:, None] + torch.arange(S, device=k.device)).clamp(max=N - 1)
        gidx = idx[:, None, :, None].expand(B, H, S, D)
        self.sink_k, self.sink_v = k.gather(2, gidx), v.gather(2, gidx)
        for stream, x in ((self.k_stream, pre_k), (self.v_stream, v)):
            if isinstance(stream, ExactStream):
                stream.append(x)
            elif isinstance(stream, SlidingStream):
                stream.prefill(x, self.pads)
            else:
                stream.prefill(x, self.pads)

    def _step(self, k, pre_k, v):
        N, S = self.N, self.cfg.sink_tokens
        self.N = N + 1
        if self.uniform and N >= S:  # the common case: every row owns the new token as history
            for stream, x in ((self.k_stream, pre_k), (self.v_stream, v)):
                if isinstance(stream, SlidingStream):
                    stream.step(x, N, self.pads)
                elif isinstance(stream, FillStream):
                    stream.step(x, None)
                else:
                    stream.append(x)
            return
        j = [N - p for p in self.pads]  # the new token's index among each row's real tokens
        for b, jj in enumerate(j):  # sinks still filling (prompts shorter than sink_tokens): at most S steps
            if jj < S:
                self.sink_k[b, :, jj] = k[b, :, 0]
                self.sink_v[b, :, jj] = v[b, :, 0]
        owns = [jj >= S for jj in j]
        for stream, x in ((self.k_stream, pre_k), (self.v_stream, v)):
            if isinstance(stream, ExactStream):
                stream.append(x)
            elif isinstance(stream, SlidingStream):
                stream.step(x, N, self.pads)
            else:
                stream.step(x, owns)

    # -- views ---------------------------------------------------------------------------------------------------
    def _rotate(self, deq: torch.Tensor, abs_pos: torch.Tensor) -> torch.Tensor:
        """rope=pre: rotate dequantized pre-RoPE keys [B, H, n, D] at absolute positions abs_pos [B, n]."""
        pos = self._pos.gather(1, abs_pos.clamp(0, self.N - 1)).long()
        cos, sin = self.rope.cos_sin(deq, pos)
        return self.rope.rotate(deq, cos, sin)

    def key_history(self, n: int) -> torch.Tensor:
        """Uniform rows: dequantized (and, rope=pre, re-rotated) keys of history positions [S, S + n)."""
        deq = self.k_stream.store.dequantize(n)
        if self.rope is not None and n:
            S = self.cfg.sink_tokens
            ap = torch.arange(S, S + n, device=deq.device).expand(deq.shape[0], n)
            deq = self._rotate(deq, ap)
        return deq

    def counts(self, stream) -> tuple[int, int]:
        """Uniform rows: (quantized history tokens, fp window tokens) of one stream."""
        q = stream.n_quantized(self.N) if isinstance(stream, SlidingStream) else stream.q[0]
        return q, max(0, self.N - self.cfg.sink_tokens) - q

    def _segments(self, stream):
        """Uniform rows: (history length, fp window tensor) of one stream; window [B, H, w, D]."""
        q, w = self.counts(stream)
        win = stream.window[:, :, stream.window.shape[2] - w :] if w else stream.window[:, :, :0]
        return q, win

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full K, V [B, H, N, D] in the model's dtype: sinks exact, history dequantized, window exact."""
        if self.uniform:
            return self._materialize_uniform()
        return self._materialize_ragged()

    def _materialize_uniform(self):
        N, S = self.N, self.cfg.sink_tokens
        s = min(S, N)
        out = []
        for stream, sink, is_key in ((self.k_stream, self.sink_k, True), (self.v_stream, self.sink_v, False)):
            if isinstance(stream, ExactStream):
                x = stream.x
                if is_key and self.rope is not None:  # cannot happen: identity keys skip RoPE handling
                    raise AssertionError
                out.append(x)
                continue
            q, win = self._segments(stream)
            hist = self.key_history(q) if is_key else stream.store.dequantize(q)
            out.append(torch.cat([sink[:, :, :s], hist.to(win.dtype), win], 2))
        return out[0], out[1]

    def _materialize_ragged(self):
        """Padded batch: gather each row's sinks, history and window into absolute positions."""
        N, S = self.N, self.cfg.sink_tokens
        ref = self.sink_k
        B, H, _, D = ref.shape
        dev = ref.device
        a = torch.arange(N, device=dev).expand(B, N)
        p = torch.tensor(self.pads, device=dev)[:, None]
        j = a - p  # real-token index (negative: padding)
        out = []
        for stream, sink, is_key in ((self.k_stream, self.sink_k, True), (self.v_stream, self.sink_v, False)):
            if isinstance(stream, ExactStream):
                out.append(stream.x)
                continue
            W = stream.window.shape[2]
            if isinstance(stream, SlidingStream):
                q = stream.n_quantized(N)
                hidx = a - S  # storage position of a history token
                in_hist = a < N - stream.R
            else:
                q = max(stream.q) if stream.q else 0
                hidx = j - S
                in_hist = hidx < torch.tensor(stream.q, device=dev)[:, None]
            if is_key:
                deq = self.k_stream.store.dequantize(q)
                if self.rope is not None and q:
                    if isinstance(stream, SlidingStream):
                        ap = torch.arange(S, S + q, device=dev).expand(B, q)
                    else:
                        ap = p + S + torch.arange(q, device=dev)
                    deq = self._rotate(deq, ap)
            else:
                deq = stream.store.dequantize(q)
            src = torch.cat([sink, deq.to(stream.window.dtype), stream.window], 2)  # [B, H, S + q + W, D]
            idx = torch.where(
                j < S, j.clamp(min=0), torch.where(in_hist, S + hidx.clamp(0, max(q - 1, 0)), S + q + a - (N - W))
            )
            idx = torch.where(j < 0, 0, idx).clamp(0, src.shape[2] - 1)
            out.append(src.gather(2, idx[:, None, :, None].expand(B, H, N, D)))
        return out[0], out[1]

    # -- accounting ----------------------------------------------------------------------------------------------
    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): bytes this layer holds, and the same tokens as an fp16 K/V cache."""
        if not self.is_initialized or self.N == 0:
            return 0, 0
        stored = _nb(self.sink_k) + _nb(self.sink_v) + self.k_stream.nbytes() + self.v_stream.nbytes() + _nb(self._pos)
        B, H, D = self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]
        return stored, 2 * B * H * self.N * D * 2

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        # shape-only placeholders: DynamicLayer code reads self.keys for batch, heads and head_dim
        self.keys = key_states.new_empty(key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])
        self.values = self.keys

    def reset(self) -> None:
        """Forget everything stored (the routing to kvq_sdpa and the layer index are kept)."""
        fused, idx = self.fused, self.layer_idx
        self.__init__(*self._args)
        self.fused, self.layer_idx = fused, idx

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("the packed cache does not support beam search / batch expansion")

    def batch_select_indices(self, indices):
        raise NotImplementedError("the packed cache does not support batch selection")

    def crop(self, max_length):
        raise NotImplementedError("the packed cache cannot be cropped (quantized history is final)")


def _positions(kwargs, B, start, n, device) -> torch.Tensor:
    from .rope import position_ids_from

    return position_ids_from(kwargs, B, start, n, device).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------------
# Decode attention over the packed cache (PyTorch path)
# ----------------------------------------------------------------------------------------------------------------


def decode_attention_torch(layer: PackedLayer, query: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """One decode step's attention over a uniform-row packed layer.

    query [B, Hq, 1, D] (post-RoPE) -> output [B, 1, Hq, D] in query's dtype (the layout `sdpa_attention_forward`
    returns). K and V are assembled for this step only, each in a reused fp32 workspace (sinks and window copied,
    history unpacked into a reused uint8 workspace and dequantized in place with the reference's arithmetic),
    then one SDPA call with grouped query heads (GQA without repeating K/V). No decode step allocates anything
    of the cache's size: fresh multi-MB buffers cost more in page faults than the arithmetic that fills them.
    Keys and values may split differently (their windows differ): each buffer follows its own stream.
    """
    k = _assemble(layer, layer.k_stream, layer.sink_k, "k")  # [B, Hkv, N, D] fp32
    v = _assemble(layer, layer.v_stream, layer.sink_v, "v")
    if mask is not None:
        mask = mask[..., -layer.N :]
    out = F.scaled_dot_product_attention(query.float(), k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).to(query.dtype)


_WORKSPACE: dict = {}


def _workspace(name: str, numel: int, device, dtype=torch.float32) -> torch.Tensor:
    """A flat scratch buffer reused by every layer and step (decode working memory, not cache storage: one
    layer's K or V at a time, overwritten by the next layer; reusing it spares a fresh multi-MB allocation,
    and its page faults, per layer per step)."""
    buf = _WORKSPACE.get((name, device, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), device=device, dtype=dtype)
        _WORKSPACE[(name, device, dtype)] = buf
    return buf[:numel]


def _codes_into(store: PackedStore, n: int, name: str) -> torch.Tensor:
    """uint8 codes [B, H, n', D] (n' >= n, whole blocks) of storage positions [0, n), unpacked into a workspace."""
    bits, m, nb = store.spec.bits, store._m, store._nb
    if nb != 1:  # 3-bit words span 3 bytes: the general unpack (allocates)
        return store.codes_u8(n)
    B, H, D = store.dims
    nblk = -(-n // BLOCK)
    u = BLOCK // m
    packed = store.codes[:, :, : nblk * m].view(B, H, nblk, 1, m, D)
    out = _workspace(name + "codes", B * H * nblk * BLOCK * D, packed.device, torch.uint8)
    out = out.view(B, H, nblk, u, m, D)
    torch.bitwise_right_shift(packed, plane_shifts(bits, torch.uint8, packed.device), out=out)
    return out.bitwise_and_((1 << bits) - 1).view(B, H, nblk * BLOCK, D)


def _assemble(layer: PackedLayer, stream, sink: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 [B, H, N, D] of one stream for this step: sinks | dequantized history | window (uniform rows)."""
    B, H, _, D = sink.shape
    N, S = layer.N, layer.cfg.sink_tokens
    s = min(S, N)
    n, win = layer._segments(stream)
    out = _workspace(name, B * H * N * D, sink.device).view(B, H, N, D)
    if s:
        out[:, :, :s] = sink[:, :, :s]
    if n:
        store = stream.store
        if name == "k" and layer.rope is not None:
            out[:, :, s : s + n] = layer.key_history(n)
        else:
            G = store.spec.group_size
            if store.spec.axis == "token":  # params [B, H, n, D/G] broadcast over each group's channels
                shape = (B, H, n, D // G, G)
                sc, z = store.scale[:, :, :n, :, None], store.zero[:, :, :n, :, None]
            else:  # params [B, H, n/G, D] broadcast over each group's tokens
                shape = (B, H, n // G, G, D)
                sc, z = store.scale[:, :, : n // G, None, :], store.zero[:, :, : n // G, None, :]
            # code -> fp32 in place, then * scale, + zero: the reference's two roundings, no intermediate buffer
            dst = out[:, :, s : s + n].view(shape)
            dst.copy_(_codes_into(store, n, name)[:, :, :n].view(shape)).mul_(sc.float()).add_(z.float())
    if win.shape[2]:
        out[:, :, N - win.shape[2] :] = win
    return out


def kvq_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`kvq_sdpa`: SDPA for ordinary tensors, the packed-cache decode path for `PackedKV` handles."""
    if not isinstance(key, PackedKV):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = key.layer
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    fused = getattr(layer.backend, "decode_attention", decode_attention_torch)
    if layer.rope is not None:  # rope=pre re-rotates dequantized keys at their positions: only PyTorch does that
        fused = decode_attention_torch
    return fused(layer, query, attention_mask, scaling), None


ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, kvq_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
