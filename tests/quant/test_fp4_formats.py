"""The FP4 formats, `nvfp4` and `mxfp4`, beyond the registry's matrices: their oracles, their stored widths, and the
per-tensor scale.

Oracles: ggml's MXFP4 quantizer (the `gguf` package's numpy port), byte for byte on awkward data, for mxfp4's codes
and E8M0 exponents; gguf's NVFP4 decoding (doubled E2M1 table under half a UE4M3 scale) for nvfp4's values, and its
UE4M3 encoder where NVIDIA's rounding (nearest even) and ggml's (ties up, [256, 448] to 448) are meant to agree.
Storage: the scales are one byte (e4m3, e8m0) wherever bytes are counted or held, and read back exactly.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import NVFP4
from helpers_models import compose

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.accounting import tensor_bits
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.kernels import cpu_kernel
from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.quant.formats import bits_per_element, get_format, tensor_nbytes
from kvq_lab.quant.formats.encodings import decode, encode
from kvq_lab.quant.formats.fp4 import E2M1
from kvq_lab.quant.layout import padded_tokens
from kvq_lab.quant.pack import PackedQTensor, qtensor_nbytes
from kvq_lab.quant.reference import code_format, dequantize, fake_quant, quantize
from kvq_lab.quant.spec import QuantConfigError, QuantSpec

MXFP4 = get_format("mxfp4")
NVFP4_1 = get_format("nvfp4")  # global scale 1: no calibration


def awkward_rows(G: int, seed: int) -> torch.Tensor:
    """fp32 [n, G] groups meant to break a block quantizer: zeros, constants, huge and tiny magnitudes, an outlier,
    elements in E2M1's subnormal range next to a large one, values just below a power of two (where fp32 log2 rounds
    up to the power), exact E2M1 midpoints (ties), fp32 subnormals next to normal values, and plain noise."""
    g = torch.Generator().manual_seed(seed)
    r = lambda scale: torch.randn(G, generator=g) * scale  # noqa: E731
    below8 = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0))
    ties = torch.tensor([4.0, 0.375, 0.125, -0.125, 0.625, -0.375, 2.5, -2.5, 3.5, 1.75, -0.875, 1.25])
    rows = [
        torch.zeros(G),
        torch.full((G,), 3.7),
        torch.full((G,), -2.5),
        torch.full((G,), 4.0),  # an exact power of two: every element maps to 4
        r(1e-6),  # fp16-subnormal magnitudes
        r(1e-30),
        r(1e30),
        r(1.0).index_fill(0, torch.tensor([3]), 1e4),  # one huge outlier: the rest round to 0 or +-0.5 steps
        r(1.0).index_fill(0, torch.tensor([0]), 3e38),  # near fp32's largest
        r(1.0).index_fill(0, torch.tensor([5]), float(below8)),  # log2 rounds up to 3: a coarser exponent
        r(1e-3).index_fill(0, torch.tensor([1]), 6.0),  # the others below half the smallest step (E2M1 subnormal)
        torch.cat([ties, r(0.5)])[:G],
        torch.cat([torch.tensor([1.0, 1e-40, -1e-41]), r(1e-8)])[:G],  # fp32 subnormals beside normal values
        r(2.0),
        r(50.0),
    ]
    return torch.stack(rows)


def gguf_mxfp4(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's MXFP4 of x [n, 32]: (exponents uint8 [n], codes uint8 [n, 32], dequantized fp32 [n, 32])."""
    q = gguf.quants.quantize(x.numpy(), GGMLQuantizationType.MXFP4)  # [n, 17]: e, then 16 bytes of nibble pairs
    qs = q[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # byte j holds codes j (low nibble) and j + 16 (high)
    return q[:, 0], codes, gguf.quants.dequantize(q, GGMLQuantizationType.MXFP4)


# -- mxfp4: ggml's bytes --------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf - inf in ggml's search over a 3e38 group
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp4_is_ggml_byte_for_byte_on_awkward_groups(seed):
    x = awkward_rows(32, seed)
    e, codes, deq = gguf_mxfp4(x)
    g = x[:, None]  # [n, 1 group, 32]
    c, s, z = MXFP4.quantize_groups(g)
    assert z is None and s.dtype == torch.float32
    assert np.array_equal(encode("e8m0", s)[:, 0].numpy(), e)  # the stored byte is ggml's exponent
    assert np.array_equal(MXFP4.exponents(g)[:, 0].numpy(), e)
    assert np.array_equal(c[:, 0].numpy(), codes)
    assert np.array_equal(MXFP4.dequantize_groups(c, s, z)[:, 0].numpy(), deq)
    # the oracle can fail: for the group just below 8 (row 9) the exact floor(log2 a) is 2, one lower than ggml's
    # (and ours), where log2 is rounded to fp32 first
    exact = torch.frexp(x.abs().amax(-1))[1] - 1 - 2 + 127
    assert x[9].abs().max() < 8 and int(exact[9]) == int(e[9]) - 1


def test_mxfp4_ties_go_to_the_lower_magnitude_and_zero_is_plus_zero():
    # scale 1 (a = 4: e = 2 - 2 + 127): ggml's argmin keeps the first (lowest) code on a tie
    g = torch.tensor([[[4.0, 0.75, -0.75, 2.5, -5.0, 0.25, -0.25, -1e-9]]])
    c, s, _ = MXFP4.quantize_groups(g)
    assert s.item() == 1.0
    assert c[0, 0].tolist() == [6, 1, 9, 4, 14, 0, 0, 0]  # 4, 0.5, -0.5, 2, -4, +0, +0, +0


def test_mxfp4_below_ggmls_range_keeps_exponent_zero():
    """amax < 2^-125 (fp32 subnormals): ggml's exponent turns negative and its uint8 cast wraps; here e = 0, the
    scale 2^-127, and the group still meets the bound (nothing saturates)."""
    g = torch.tensor([[[2.0**-126 * 0.75, -(2.0**-130), 2.0**-140, 0.0]]])
    c, s, _ = MXFP4.quantize_groups(g)
    assert encode("e8m0", s).item() == 0 and s.item() == 2.0**-127
    err = (MXFP4.dequantize_groups(c, s, None) - g).abs()
    assert (err <= MXFP4.error_bound(g, s, None)).all()


def test_e8m0_reads_as_fp32_because_fp16_cannot_hold_it():
    """Every E8M0 byte e = 0 .. 254 reads as exactly 2^(e - 127) and encodes back; fp16 holds only 2^-24 .. 2^15, so
    a group of keys near 1e-9 or 1e6 would lose its scale in fp16 (0 or inf), and the widened scale is fp32."""
    e = torch.arange(255, dtype=torch.uint8)
    v = decode("e8m0", e)
    assert v.dtype == torch.float32
    assert torch.equal(v.double(), torch.pow(2.0, e.double() - 127))
    assert torch.equal(encode("e8m0", v), e)
    fits = (v >= 2.0**-24) & (v <= 2.0**15)
    assert fits.sum() == 40 and not torch.equal(v.half().float(), v)


def test_e4m3_reads_as_fp16_exactly():
    b = torch.arange(0x7F, dtype=torch.uint8)  # every non-negative finite e4m3 pattern (0x7F is NaN)
    v = decode("e4m3", b)
    assert v.dtype == torch.float16
    assert torch.equal(v.float(), b.view(torch.float8_e4m3fn).float())
    assert torch.equal(encode("e4m3", v), b)


# -- nvfp4: gguf's values, NVIDIA's rounding ------------------------------------------------------------------------
def test_nvfp4_table_and_scales_are_ggufs_nvfp4_decoding():
    """gguf's NVFP4 decodes a code as kvalues[c] (E2M1 doubled) times half the UE4M3 byte: our table and fp16 scales
    give the same value for every code and every scale byte nvfp4 stores (0 .. 0x7E)."""
    assert NVFP4_1.table().tolist() == [*E2M1, *(-v for v in E2M1)] == [v / 2 for v in NVFP4.kvalues]
    b = np.arange(0x7F, dtype=np.uint8)
    assert np.array_equal(NVFP4.ue4m3_to_fp32(b) * 2, decode("e4m3", torch.from_numpy(b)).float().numpy())


def gguf_nvfp4_blocks(codes: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """gguf NVFP4 super-blocks of 64 values from nvfp4 groups of 16: codes uint8 [n, 4, 16], scale fp16 [n, 4] ->
    uint8 [n, 36] (4 UE4M3 bytes, then 8 bytes per block: codes j and j + 8 of block i in byte 8 i + j)."""
    c = codes.numpy().astype(np.uint8)
    qs = (c[..., :8] | (c[..., 8:] << 4)).reshape(len(c), 32)
    return np.concatenate([encode("e4m3", scale).numpy(), qs], axis=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_dequantizes_as_gguf_decodes_its_bytes(seed):
    x = awkward_rows(64, seed)  # a row of 64 = one gguf super-block, four nvfp4 groups of 16
    g = x.view(-1, 4, 16)
    c, s, _ = NVFP4_1.quantize_groups(g)
    want = gguf.quants.dequantize(gguf_nvfp4_blocks(c, s), GGMLQuantizationType.NVFP4)
    assert np.array_equal(NVFP4_1.dequantize_groups(c, s, None).reshape(-1, 64).numpy(), want)
    assert not np.array_equal(want, x.numpy())  # it quantized something


def test_nvfp4_block_scale_rounds_as_nvidia_and_agrees_with_ggml_off_its_quirks():
    """The block scale is torch's float8_e4m3fn cast (round to nearest even; NVIDIA's cvt.rn.satfinite), clamped at
    448. gguf's fp32_to_ue4m3 gives the same byte everywhere but in three places: ties (up, not to even), from 248
    (what rounds to 256 or more: 448), and between 7.5 * 2^-9 and 2^-6 (kept at its largest subnormal)."""
    g = torch.Generator().manual_seed(5)
    v = torch.cat([
        torch.rand(100000, generator=g) * (248 - 2**-6) + 2**-6,  # normal scales below ggml's ceiling
        torch.rand(20000, generator=g) * 7.5 * 2**-9,  # subnormal scales
    ])  # fmt: skip
    ours = v.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(ours, NVFP4.fp32_to_ue4m3(v.numpy()))  # random values are never exact ties
    quirks = torch.tensor([1.0625, 2**-10, 5 * 2**-10, 21.0, 250.0, 300.0, 7.75 * 2**-9])
    want = [1.0, 0.0, 2**-8, 20.0, 256.0, 288.0, 2**-6]  # nearest even; ggml: 1.125, 2^-9, 3 * 2^-9, 22, 448, ...
    assert quirks.to(torch.float8_e4m3fn).float().tolist() == want
    theirs = decode("e4m3", torch.from_numpy(NVFP4.fp32_to_ue4m3(quirks.numpy()))).float().tolist()
    assert theirs == [1.125, 2**-9, 3 * 2**-9, 22.0, 448.0, 448.0, 7 * 2**-9]
    # and the format uses it: a group's scale is e4m3(a / 6), so a = 6.375 (a / 6 = 1.0625, a tie) gets 1.0
    _, s, _ = NVFP4_1.quantize_groups(torch.tensor([[[6.375] + [0.0] * 15]]))
    assert s.item() == 1.0


def test_nvfp4_elements_round_to_nearest_even_and_saturate():
    # a = 6.3: scale e4m3(1.05) = 1, y = x; 6.3 saturates to 6
    g = torch.tensor([[[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.1, 6.3, -0.75, 0.3, 0.0, 2.9, 4.9]]])
    c, s, _ = NVFP4_1.quantize_groups(g)
    assert s.item() == 1.0
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 6.0, -1.0, 0.5, 0.0, 3.0, 4.0]
    assert NVFP4_1.dequantize_groups(c, s, None)[0, 0].tolist() == want
    assert c[0, 0, 9].item() == 0  # -0.1 rounds to zero: +0, code 0


# -- the per-tensor scale ---------------------------------------------------------------------------------------------
def test_nvfp4_fits_its_global_scale_per_tensor():
    x = torch.randn(1, 3, 40, 64, generator=torch.Generator().manual_seed(1))
    x[0, 1, 7, 9] = -50.0
    s = QuantSpec(4, 16, "token", "nvfp4")
    fitted = NVFP4_1.fit(s, x, torch.zeros_like(x))
    assert fitted.tensor_scale == pytest.approx(50.0 / 2688, rel=1e-7) and fitted.format == "nvfp4"
    mask = x.abs() >= 50  # an outlier kept outside the format does not set the scale
    assert NVFP4_1.fit(s, x, x, mask).tensor_scale == pytest.approx(float(x.abs()[~mask].max()) / 2688, rel=1e-7)
    assert NVFP4_1.fit(s, torch.zeros_like(x), x).tensor_scale == 1.0
    fmt = code_format(fitted)  # the spec carries it to the format: its table is E2M1 times it, rounded once each
    assert fmt.tensor_scale == fitted.tensor_scale
    e2m1 = torch.tensor(NVFP4_1.table().tolist(), dtype=torch.float64)
    assert torch.equal(fmt.table(), (e2m1 * fmt.tensor_scale).float())
    # the tensor's largest element now maps onto the top of the ranges: block scale 448, E2M1 6
    q = quantize(x, fitted)
    assert q.scale.max().item() == 448.0 and q.scale.dtype == torch.float16
    assert dequantize(q).abs().max().item() == pytest.approx(50.0, rel=1e-6)


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_a_fitted_global_scale_stays_within_the_bound_and_helps_small_tensors(axis):
    """With global = amax / 2688 a tensor of small keys uses e4m3's normal range; with global 1 its block scales sit
    among e4m3's subnormals (steps of 2^-9) or round to 0, and lose precision."""
    x = torch.randn(2, 2, 48, 64, generator=torch.Generator().manual_seed(2)) * 2e-3
    fitted = NVFP4_1.fit(QuantSpec(4, 16, axis, "nvfp4"), x, x)
    errs = {}
    for spec in (fitted, QuantSpec(4, 16, axis, "nvfp4")):
        fmt = code_format(spec)
        g = x.reshape(2, 2, 48, 4, 16) if axis == "token" else x.reshape(2, 2, 3, 16, 64).transpose(-1, -2)
        c, sc, _ = fmt.quantize_groups(g)
        err = (fmt.dequantize_groups(c, sc, None) - g).abs()
        assert (err <= fmt.error_bound(g, sc, None) + 1e-12).all()
        errs[spec.tensor_scale] = err.pow(2).mean().item()
    assert errs[fitted.tensor_scale] < 0.5 * errs[None]


def test_tensor_scale_is_checked_in_one_line():
    assert QuantSpec(4, 16, "token", "nvfp4", tensor_scale=0.1).tensor_scale == float(np.float32(0.1))
    for bad in (0, -1.0, float("inf"), float("nan"), 1e39, True, "0.1"):
        with pytest.raises(QuantConfigError, match="tensor_scale=.* must be a positive number") as e:
            QuantSpec(4, 16, "token", "nvfp4", tensor_scale=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(QuantConfigError, match="format=int has no option 'tensor_scale'"):
        CacheConfig(key=QuantSpec(2, 32, "token", tensor_scale=0.5))
    with pytest.raises(QuantConfigError, match="format=mxfp4 has no option 'tensor_scale'"):
        code_format(QuantSpec(4, 32, "token", "mxfp4", tensor_scale=0.5))
    assert QuantSpec(4, 16, "token", "nvfp4").short() == "nvfp4-T16"
    assert QuantSpec(4, 16, "token", "nvfp4", tensor_scale=0.1).short().startswith("nvfp4.s")


# -- stored widths: the arithmetic, and what is held ------------------------------------------------------------------
def test_bits_per_element_count_the_one_byte_scales():
    assert bits_per_element(NVFP4_1, 16) == 4.5  # 4 + 8 / 16: an e4m3 byte per 16
    assert bits_per_element(MXFP4, 32) == 4.25  # 4 + 8 / 32: an e8m0 byte per 32
    assert bits_per_element(NVFP4_1, 32) == 4.25 and bits_per_element(MXFP4, 16) == 4.5  # any group size
    assert NVFP4_1.table_bytes == 4 and MXFP4.table_bytes == 0  # nvfp4's fp32 per tensor, beside the groups
    for fmt, G in ((NVFP4_1, 16), (MXFP4, 32)):
        for axis, T in (("token", 64), ("token", 37), ("channel", 64), ("channel", 37)):
            groups = T * 64 // G if axis == "token" else -(-T // G) * 64
            want = padded_tokens(T) * 64 // 2 + groups  # codes in whole blocks of 32 tokens, one byte per group
            assert tensor_nbytes(fmt, G, axis, T, 64) == want == qtensor_nbytes(T, 64, QuantSpec(4, G, axis, fmt.name))


@pytest.mark.parametrize("name, G", [("nvfp4", 16), ("mxfp4", 32)])
def test_packed_qtensor_holds_one_byte_per_scale_and_reads_it_back(name, G):
    x = torch.randn(2, 3, 70, 64, generator=torch.Generator().manual_seed(3)) * 4
    q = quantize(x, QuantSpec(4, G, "channel", name))
    p = PackedQTensor.from_qtensor(q)
    assert p.scale.dtype == torch.uint8 and p.zero is None
    assert p.nbytes() == 2 * 3 * qtensor_nbytes(70, 64, q.spec)
    back = p.to_qtensor()
    assert torch.equal(back.scale.view(torch.uint8), q.scale.view(torch.uint8)) and back.scale.dtype == q.scale.dtype
    assert torch.equal(dequantize(back), dequantize(q))


@pytest.mark.parametrize("name, G", [("nvfp4", 16), ("mxfp4", 32)])
def test_the_packed_store_holds_the_bytes_and_counts_them(name, G):
    cfg = CacheConfig(
        key=QuantSpec(4, G, "token", name), value=QuantSpec(4, G, "channel", name), mode="packed", backend="torch"
    )
    layer = PackedLayer(cfg, None, PaddingState())
    k = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(4))
    layer.update(k, k)  # R = 0: every token quantized
    for st in (layer.k_stream.store, layer.v_stream.store):
        assert st.scale.dtype == torch.uint8 and st.zero is None
        per = 4 if name == "nvfp4" else 0  # the fp32 tensor scale, once per layer and tensor
        assert st.nbytes() == 2 * (64 * 64 // 2 + 64 * 64 // G) + per
        scale, _ = st.read_params()  # what the kernels read: the same values, widened
        assert scale.dtype == st.format.param_dtype("scale")
        assert torch.equal(encode(st.format.param_encoding("scale"), scale), st.scale)
    stored, _ = layer.nbytes()
    assert stored == layer.k_stream.nbytes() + layer.v_stream.nbytes()
    # cache/bits_total: the format's bits per element, plus the fp32 tensor scale once per layer (H * N * D elements)
    per = 32 if name == "nvfp4" else 0
    assert tensor_bits(cfg, "key", 1024, 2, 64) == bits_per_element(code_format(cfg.key), G) + per / (2 * 1024 * 64)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_the_widened_parameters_kernels_read_follow_every_write(name):
    """The store widens its one-byte scales into a copy the kernels read: each write updates that copy in place, so a
    view (and a kept kernel call, which keeps its addresses) always holds every written group; only growth makes a
    new copy, and it moves the store's generation (a kept call is then rebuilt)."""
    cfg = CacheConfig(
        key=QuantSpec(4, 16, "channel", name), value=QuantSpec(4, 16, "token", name), mode="packed",
        exact_window=0, backend="torch",
    )  # fmt: skip
    layer = PackedLayer(cfg, None, PaddingState())
    x = torch.randn(1, 2, 140, 64, generator=torch.Generator().manual_seed(6))
    layer.update(x[:, :, :40], x[:, :, :40])
    st = layer.v_stream.store  # per-token values, R = 0: one write per step
    enc = st.format.param_encoding("scale")
    same = 0
    for N in range(40, 140):
        g0, s0 = st.generation, layer.decode_view().values.scale
        layer.update(x[:, :, N : N + 1], x[:, :, N : N + 1])
        s1 = layer.decode_view().values.scale
        assert (st.generation == g0) == (s1 is s0)  # a new copy exactly when the generation moved
        assert torch.equal(s1, decode(enc, st.scale)) and s1[0, :, N].abs().sum() > 0  # this step's groups are in it
        same += s1 is s0
    assert same > 90  # in place between growths (a block of 32 tokens at a time)


# -- both cache modes, a fitted scale, the C kernel ---------------------------------------------------------------
def fitted_specs(x: torch.Tensor):
    k = NVFP4_1.fit(QuantSpec(4, 16, "channel", "nvfp4"), x, x)
    v = NVFP4_1.fit(QuantSpec(4, 16, "token", "nvfp4"), x * 3, x)
    return k, v


def test_a_fitted_nvfp4_in_simulated_mode_is_the_reference():
    x = torch.randn(1, 2, 75, 64, generator=torch.Generator().manual_seed(7))
    ks, vs = fitted_specs(x)
    assert ks.tensor_scale != 1.0 != vs.tensor_scale
    layer = SimulatedLayer(CacheConfig(key=ks, value=vs, mode="simulated", sink_tokens=2), None, PaddingState())
    K, V = layer.update(x[:, :, :45], 3 * x[:, :, :45])
    for N in range(45, 75):
        K, V = layer.update(x[:, :, N : N + 1], 3 * x[:, :, N : N + 1])
    n = 75
    assert torch.equal(K, torch.cat([x[:, :, :2], fake_quant(x[:, :, 2:n], ks)], 2))
    assert torch.equal(V, torch.cat([3 * x[:, :, :2], fake_quant(3 * x[:, :, 2:n], vs)], 2))
    assert not torch.equal(K, fake_quant(x, QuantSpec(4, 16, "channel", "nvfp4")))  # the global scale matters


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_fitted_nvfp4_in_packed_mode_is_the_reference(backend):
    """Chunks (a prefill, then windows of 32 keys, and values leaving their window) store what one reference call
    over the whole history stores, because the global scale is the tensor's, not the chunk's; the C kernel reads the
    per-tensor table and the fp16-widened e4m3 scales and attends as the PyTorch path does."""
    x = torch.randn(1, 2, 120, 64, generator=torch.Generator().manual_seed(8))
    ks, vs = fitted_specs(x)
    cfg = CacheConfig(key=ks, value=vs, mode="packed", exact_window=32, sink_tokens=3, backend=backend)
    layer = PackedLayer(cfg, None, PaddingState())
    layer.update(x[:, :, :70], 3 * x[:, :, :70])
    for N in range(70, 120):
        layer.update(x[:, :, N : N + 1], 3 * x[:, :, N : N + 1])
    K, V = layer.materialize()
    kq = (120 - 3) // 32 * 32
    vq = 120 - 3 - 32
    assert torch.equal(K[:, :, 3 : 3 + kq], dequantize(quantize(x[:, :, 3 : 3 + kq], ks)))
    assert torch.equal(V[:, :, 3 : 3 + vq], dequantize(quantize(3 * x[:, :, 3 : 3 + vq], vs)))
    assert layer.k_stream.store.nbytes() == 2 * tensor_nbytes(code_format(ks), 16, "channel", kq, 64) + 4
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(9))
    view = layer.decode_view()
    assert view.keys.scale.dtype == torch.float16 and torch.equal(view.keys.table, code_format(ks).table())
    ours = decode_attention_torch(view, q, None, 0.125)
    got = cpu_kernel.decode_attention(view, q, None, 0.125) if backend == "cpu" else ours
    torch.testing.assert_close(got, ours, rtol=1e-5, atol=1e-6)


# -- before any model loads -----------------------------------------------------------------------------------------
def test_the_presets_set_the_standard_blocks():
    from kvq_lab.run.config import validate

    for name, label in (("nvfp4", "nvfp4-T16"), ("mxfp4", "mxfp4-T32")):
        plan = validate(compose([f"quant={name}", "mode=packed"]))
        assert plan.cache.label().startswith(f"K{label}_V{label}_pac"), plan.cache.label()


def test_another_block_size_runs_and_one_the_head_dim_refuses_fails_before_load():
    """Other group sizes are allowed (the same arithmetic per group; the label shows the block: `nvfp4-T32`); a
    per-token group that does not divide the head dim, or a backend the format refuses, fails in one line."""
    from kvq_lab.run.config import ConfigError, validate

    assert validate(compose(["format=nvfp4"])).cache.label() == "Knvfp4-C32_Vnvfp4-T32_sim"
    with pytest.raises(ConfigError, match=r"group_size \(keys\)=48 does not divide head_dim=64") as e:
        validate(compose(["format=nvfp4", "group_size=48", "key_axis=token"]))  # the embedded model's header
    assert "\n" not in str(e.value)
    bad = [
        (["format=mxfp4", "mode=packed", "exact_window=32", "backend=cpu"], "^backend=cpu cannot read format=mxfp4"),
        (["format=nvfp4", "bits=2"], "^format=nvfp4 takes 4 bits; bits=2 conflicts"),
    ]
    for overrides, match in bad:
        with pytest.raises(ConfigError, match=match) as e:
            validate(compose([*overrides, "model.path=/no/model"]))  # refused before the model is even looked for
        assert "\n" not in str(e.value)
