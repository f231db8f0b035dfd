"""Every registered code format through every layer that reads it: the reference (`quantize`/`dequantize`/
`fake_quant` dispatch on the spec's format), simulated mode, packed mode, and the decode paths (PyTorch, C kernel;
Triton's small case is in tests/kernels/test_triton.py), plus what the kernels declare they cannot read.

Driven by the registry: `FORMAT_CASES` iterates `FORMATS` (each at its default width, plus 3 and 8 bits where it
takes them: a 3-bit word spans 3 bytes, 8 bits is one code per byte), so a new format is tested here with no edit. A
format that refuses a backend (`unsupported_backends`: mxfp4, whose fp32-read scales the C kernel cannot take) is
checked to refuse it in one line where the matrix would run that backend.
Oracles: kernel vs reference on the same recipe is exact (codes, parameters, dequantized values); attention is
within the PyTorch path's own fp32 rounding; `int` is also checked against a frozen copy of the reference
arithmetic from before formats existed, so "bit-identical to today" is not a tautology.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import spy_cpu_kernel
from helpers_models import gen

import kvq_lab.quant.formats as formats
from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.cache.routing import backends as backends_mod
from kvq_lab.cache.routing.backends import get_backend
from kvq_lab.cache.storage.streams import spare_rows
from kvq_lab.kernels import cpu_kernel
from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.quant.formats import FORMATS, default_bits, register_format, tensor_nbytes
from kvq_lab.quant.formats.int_ import IntFormat
from kvq_lab.quant.layout import padded_tokens
from kvq_lab.quant.reference import _grouped, _ungrouped, code_format, dequantize, fake_quant, quantize
from kvq_lab.quant.rounding import fp16_round_down, fp16_round_up
from kvq_lab.quant.spec import QuantConfigError, QuantSpec


def _widths(name: str) -> list[int]:
    allowed = FORMATS[name].supported_bits
    return sorted({default_bits(name), *(b for b in (3, 8) if b in allowed)})


FORMAT_CASES = [pytest.param(n, b, id=f"{n}-{b}b") for n in sorted(FORMATS) for b in _widths(n)]
DEFAULT_CASES = [pytest.param(n, default_bits(n), id=n) for n in sorted(FORMATS)]


def spec(name: str, bits: int, axis: str, G: int = 32) -> QuantSpec:
    return QuantSpec(bits, G, axis, name)


def refused(name: str, cfg: CacheConfig) -> bool:
    """Whether the format refuses the config's backend (`unsupported_backends`); if so, checked: the packed layer
    refuses it in one line naming backend and format, before storing anything."""
    if cfg.backend not in FORMATS[name].unsupported_backends:
        return False
    with pytest.raises(QuantConfigError, match=f"^backend={cfg.backend} cannot read format={name} ") as e:
        PackedLayer(cfg, None, PaddingState())
    assert "\n" not in str(e.value)
    return True


def data(B, H, T, D, seed):
    """Seeded K-like data: an outlier channel, one all-zero token and one constant token (adversarial groups)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    x[..., 5] *= 20
    x[:, :, T // 3] = 0.0
    x[:, :, T // 2] = 1.375
    return x


# -- the reference: quantize / dequantize / fake_quant go through the spec's format ----------------------------------
@pytest.mark.parametrize("partial", ["zero", "exclude"])
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("name, bits", FORMAT_CASES)
def test_reference_dispatches_on_the_format(name, bits, axis, partial):
    s = spec(name, bits, axis)
    fmt = code_format(s)
    assert (fmt.name, fmt.bits) == (name, bits) and code_format(s) is fmt  # resolved once per spec
    x = data(2, 3, 45, 64, bits)  # T=45: a partial per-channel group
    valid = torch.arange(45)[None, None] >= torch.tensor([0, 4])[:, None, None]  # row 1 left-padded by 4
    q = quantize(x, s, valid=valid, partial=partial)
    # what the format does to the same groups, by hand
    pad = (-45) % 32 if axis == "channel" else 0
    vt = F.pad(valid.expand(2, 3, 45), (0, pad), value=partial == "zero")
    g = _grouped(F.pad(x, (0, 0, 0, pad)), s)
    codes, scale, zero = fmt.quantize_groups(g, _grouped(vt[..., None].expand(2, 3, 45 + pad, 64), s))
    assert torch.equal(q.codes, _ungrouped(codes, s)) and torch.equal(q.scale, scale)
    assert (q.zero is None) == ("zero" not in fmt.params)
    assert q.zero is None or torch.equal(q.zero, zero)
    y = dequantize(q)
    assert torch.equal(y, _ungrouped(fmt.dequantize_groups(codes, scale, zero), s)[..., :45, :])
    assert torch.equal(fake_quant(x, s, valid=valid, partial=partial), y)
    err = (y - x).abs()
    bound = _ungrouped(fmt.error_bound(g, scale, zero), s)[..., :45, :]
    ok = (err <= bound + 1e-3 * bound + 1e-6) | ~valid[..., None]
    assert ok.all()
    assert not torch.equal(y, x)  # it quantized something


def test_a_format_that_cannot_take_the_width_fails_in_one_line():
    with pytest.raises(QuantConfigError, match=r"format=fp8_e4m3 takes 8 bits; bits=2 conflicts") as e:
        quantize(torch.randn(1, 1, 32, 32), QuantSpec(2, 32, "token", "fp8_e4m3"))
    assert "\n" not in str(e.value)
    with pytest.raises(QuantConfigError, match="format='nf5' is not a registered code format"):
        fake_quant(torch.randn(1, 1, 32, 32), QuantSpec(2, 32, "token", "nf5"))


def _int_before_formats(x, spec, valid=None, partial="zero"):
    """kvq_lab.quant.reference.quantize as it was before code formats (commit 4a69294), verbatim in substance:
    the oracle for "int stays bit-identical"."""
    B, H, T, D = x.shape
    xf = x.float()
    pad = (-T) % spec.group_size if spec.axis == "channel" else 0
    if valid is not None:
        valid = valid.to(torch.bool).expand(B, H, T)
    if pad:
        xf = F.pad(xf, (0, 0, 0, pad))
        if partial == "exclude" or valid is not None:
            base = torch.ones(B, H, T, dtype=torch.bool) if valid is None else valid
            valid = F.pad(base, (0, pad), value=(partial == "zero"))
    g = _grouped(xf, spec)
    if valid is None:
        mn, mx = g.amin(-1), g.amax(-1)
        vg = None
    else:
        vg = _grouped(valid.unsqueeze(-1).expand(B, H, T + pad, D), spec)
        mn = torch.where(vg, g, float("inf")).amin(-1)
        mx = torch.where(vg, g, -float("inf")).amax(-1)
        empty = ~vg.any(-1)
        mn = torch.where(empty, 0.0, mn)
        mx = torch.where(empty, 0.0, mx)
    zero = fp16_round_down(mn)
    scale = fp16_round_up((mx - zero.float()) / spec.levels)
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((g - zero.float().unsqueeze(-1)) / safe).clamp_(0, spec.levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    if vg is not None:
        codes = torch.where(vg, codes, torch.zeros_like(codes))
    codes = _ungrouped(codes.to(torch.uint8), spec).contiguous()
    deq = _ungrouped(_grouped(codes.float(), spec) * s + zero.float().unsqueeze(-1), spec)[..., :T, :].to(x.dtype)
    return codes, scale, zero, deq


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", IntFormat.supported_bits)
def test_int_is_bit_identical_to_the_reference_before_formats(bits, axis, dtype):
    x = data(2, 2, 77, 64, bits).to(dtype)
    s = QuantSpec(bits, 32, axis)
    valid = torch.arange(77)[None, None] >= torch.tensor([0, 9])[:, None, None]
    for v, partial in ((None, "zero"), (None, "exclude"), (valid, "zero")):
        codes, scale, zero, deq = _int_before_formats(x, s, v, partial)
        q = quantize(x, s, valid=v, partial=partial)
        assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale) and torch.equal(q.zero, zero)
        assert torch.equal(dequantize(q), deq)
    other = quantize(x, QuantSpec(bits, 32, axis, "lut"))  # the oracle can fail: another format, other codes
    assert not torch.equal(other.codes, codes)


# -- simulated mode: every cached token fake-quantized by the format -------------------------------------------------
@pytest.mark.parametrize("kax, vax, S, D", [("channel", "token", 3, 64), ("token", "channel", 0, 128)])
@pytest.mark.parametrize("name, bits", FORMAT_CASES)
def test_simulated_mode(name, bits, kax, vax, S, D):
    """Sinks exact, every later token fake-quantized with the group it belongs to (partial per-channel groups
    zero-padded): step by step, what the reference gives for the whole sequence at once."""
    cfg = CacheConfig(key=spec(name, bits, kax), value=spec(name, bits, vax), mode="simulated", sink_tokens=S)
    layer = SimulatedLayer(cfg, None, PaddingState())
    k, v = data(1, 2, 75, D, 1), data(1, 2, 75, D, 2)
    K, V = layer.update(k[:, :, :45], v[:, :, :45])
    for N in range(45, 75):
        if N % 7 == 0 or N == 74:
            for got, x, s in ((K, k, cfg.key), (V, v, cfg.value)):
                want = torch.cat([x[:, :, :S], fake_quant(x[:, :, S:N], s, partial="zero")], 2)
                assert torch.equal(got, want), N
                assert not torch.equal(got, x[:, :, :N])
        K, V = layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])


# -- packed mode: storage, materialization and decode attention, per backend ---------------------------------------
def expected(x, s, S, q):
    """Sinks exact, history [S, S + q) reference-dequantized, the rest exact."""
    if q == 0:
        return x
    return torch.cat([x[:, :, :S], dequantize(quantize(x[:, :, S : S + q], s)).to(x.dtype), x[:, :, S + q :]], 2)


def store_nbytes_arithmetic(store, s: QuantSpec) -> int:
    """What a stream's store should hold: whole packing blocks of codes, the format's parameters per allocated group
    (per-token params are allocated per block of tokens), its table if it keeps one per tensor."""
    fmt = code_format(s)
    B, H, D = store.dims
    n = padded_tokens(store.length) if s.axis == "token" else store.length
    return B * H * tensor_nbytes(fmt, s.group_size, s.axis, n, D) + fmt.table_bytes


@dataclass
class PackedCase:
    kax: str
    vax: str
    S: int
    R: int
    D: int
    r: int  # query heads per kv head


PACKED = [PackedCase("channel", "token", 3, 32, 64, 3), PackedCase("token", "channel", 0, 64, 128, 2)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"K{c.kax[0]}V{c.vax[0]}-S{c.S}-R{c.R}-D{c.D}")
@pytest.mark.parametrize("name, bits", FORMAT_CASES)
def test_packed_mode(name, bits, case, backend):
    c = case
    cfg = CacheConfig(
        key=spec(name, bits, c.kax), value=spec(name, bits, c.vax), mode="packed", exact_window=c.R,
        sink_tokens=c.S, backend=backend,
    )  # fmt: skip
    if refused(name, cfg):
        return
    layer = PackedLayer(cfg, None, PaddingState())
    assert layer.backend.name == backend
    fmt = code_format(cfg.key)
    k, v = data(1, 2, 110, c.D, 3), data(1, 2, 110, c.D, 4)
    layer.update(k[:, :, :70], v[:, :, :70])  # T=70: not a multiple of G or of the packing block
    err_kernel = err_torch = 0.0
    for N in range(70, 110):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        if N % 9 and N != 109:
            continue
        n = N + 1
        Rk = c.R or 32
        kq = (n - c.S) // Rk * Rk if c.kax == "channel" else max(0, n - c.S - c.R)
        vq = (n - c.S) // Rk * Rk if c.vax == "channel" else max(0, n - c.S - c.R)
        K, V = layer.materialize()
        assert torch.equal(K, expected(k[:, :, :n], cfg.key, c.S, kq)) and not torch.equal(K, k[:, :, :n])
        assert torch.equal(V, expected(v[:, :, :n], cfg.value, c.S, vq))
        for stream, s in ((layer.k_stream, cfg.key), (layer.v_stream, cfg.value)):
            st = stream.store
            assert (st.zero is None) == ("zero" not in fmt.params)  # only the declared parameters are stored
            assert (st.table is None) == fmt.codes_are_values
            assert st.nbytes() == store_nbytes_arithmetic(st, s)
        # decode attention over the packed view: the backend's, and the PyTorch path, against fp64 SDPA
        q = torch.randn(1, 2 * c.r, 1, c.D, generator=torch.Generator().manual_seed(N)) * 3
        exact = F.scaled_dot_product_attention(
            q.double(), K.double(), V.double(), scale=c.D**-0.5, enable_gqa=True
        ).transpose(1, 2)
        ours = decode_attention_torch(layer.decode_view(), q, None, c.D**-0.5)
        got = layer.backend.decode_attention(layer.decode_view(), q, None, c.D**-0.5)
        torch.testing.assert_close(got, ours, rtol=1e-4, atol=1e-4)
        err_torch = max(err_torch, (ours.double() - exact).abs().max().item())
        err_kernel = max(err_kernel, (got.double() - exact).abs().max().item())
    assert err_torch < 1e-4
    # as accurate as the PyTorch path, up to a few fp32 roundings of the largest value (the paths sum in different
    # orders; how close the PyTorch path comes depends on the machine's BLAS: 7.7e-6 on an AVX-512 Xeon, where the
    # kernel's 2.0e-5 is 3.4 units of fp32 rounding of max |V| = 49)
    floor = 4 * torch.finfo(torch.float32).eps * v[:, :, :110].abs().max().item()
    assert err_kernel <= 2 * err_torch + floor, (err_kernel, err_torch, floor)


@pytest.mark.parametrize("name, bits", DEFAULT_CASES)
def test_c_kernel_dequantizes_exactly(name, bits):
    """The C kernel's dequantized history, bit for bit: with the history only (no sinks, no window) and one kv
    position weighted at a time (a one-hot mask), attention returns that position's value row exactly."""
    cfg = CacheConfig(
        key=spec(name, bits, "token"), value=spec(name, bits, "channel"), mode="packed", exact_window=0,
        backend="cpu",
    )  # fmt: skip
    if refused(name, cfg):
        return
    layer = PackedLayer(cfg, None, PaddingState())
    k, v = data(1, 2, 64, 64, 5), data(1, 2, 64, 64, 6)
    layer.update(k, v)  # 64 tokens, R=0: all quantized (keys per token, values in two whole per-channel groups)
    view = layer.decode_view()
    assert view.keys.n == view.values.n == 64 and view.keys.w == view.values.w == 0
    _, V = layer.materialize()
    q = torch.randn(1, 2, 1, 64)
    for p in (0, 31, 63):
        mask = torch.full((1, 1, 1, 64), float("-inf"))
        mask[..., p] = 0.0
        out = cpu_kernel.decode_attention(view, q, mask, 0.125)  # [1, 1, Hq, D]
        assert torch.equal(out[0, 0], V[0, :, p]), p  # weight exactly 1: the dequantized row itself


def test_fp8_bytes_are_the_arithmetic():
    """fp8 at G=32 stores 8 + 16/32 = 8.5 bits per quantized element (no zero point) plus the fp windows: within
    1% (here exactly, whole groups and blocks); int2 at the same setting stores 3."""
    R, D, H = 128, 64, 2
    k, v = data(1, H, 1152, D, 7), data(1, H, 1152, D, 8)
    for name, bpe in (("fp8_e4m3", 8.5), ("fp8_e5m2", 8.5), ("int", 3.0)):
        bits = default_bits(name)
        cfg = CacheConfig(
            key=spec(name, bits, "channel"), value=spec(name, bits, "token"), mode="packed", exact_window=R,
            backend="torch",
        )  # fmt: skip
        layer = PackedLayer(cfg, None, PaddingState())
        layer.update(k, v)  # keys: 1152 quantized (9 windows), values: 1024 quantized
        stored, _ = layer.nbytes()
        windows = 2 * (R + spare_rows(R)) * H * D * 4  # two fp32 window buffers of R tokens and the rows to move in
        elems = (1152 + 1024) * H * D
        assert abs(8 * (stored - windows) / elems - bpe) <= 0.01 * bpe, name
        assert stored - windows == elems * bpe / 8


def test_the_table_is_counted_once_per_tensor():
    cfg = CacheConfig(
        key=spec("lut", 4, "token"), value=spec("lut", 4, "token"), mode="packed", exact_window=0, backend="torch"
    )
    layer = PackedLayer(cfg, None, PaddingState())
    k = data(1, 2, 64, 64, 9)
    layer.update(k, k)
    st = layer.k_stream.store
    assert st.nbytes() == 2 * 64 * 64 * 4 // 8 + 2 * 64 * 2 * 2 * 2 + 64  # codes, scale and zero, fp32 table of 16


# -- generation: the fused decode path reads every format -----------------------------------------------------------
@pytest.mark.parametrize("name, bits", DEFAULT_CASES)
def test_generation_with_every_format(tiny, name, bits, monkeypatch):  # noqa: F811
    """backend=cpu and backend=torch generate the same tokens, decode steps go through the kernel, and the format
    changes the output (a 2-bit cache differs from fp8 on the same prompt, int from lut at 2 bits)."""
    calls = spy_cpu_kernel(monkeypatch)  # built views and kept calls
    ids = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(4))
    out = {}
    for backend in ("cpu", "torch"):
        cfg = CacheConfig(
            key=spec(name, bits, "channel"), value=spec(name, bits, "token"), mode="packed", exact_window=32,
            sink_tokens=2, backend=backend,
        )  # fmt: skip
        if refused(name, cfg):
            return
        out[backend] = gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids, 16)
    assert torch.equal(out["cpu"], out["torch"])
    assert len(calls) == 15 * 2  # every decode step after the first token, in both layers


# -- a format a kernel cannot read ---------------------------------------------------------------------------------
@pytest.fixture
def int_without_cpu(monkeypatch):
    """A registered format that refuses the C kernel (registered into a copy of the registry, restored after)."""
    monkeypatch.setattr(formats, "FORMATS", FORMATS.copy())
    monkeypatch.setattr(backends_mod, "_WARNED", set())

    @register_format("int_nocpu")
    @dataclass(frozen=True)
    class IntNoCpu(IntFormat):
        name: str = "int_nocpu"
        unsupported_backends = ("cpu",)

    return QuantSpec(2, 32, "token", "int_nocpu")


def test_auto_falls_back_with_one_warning_and_an_explicit_backend_fails(int_without_cpu, recwarn):
    s = int_without_cpu
    assert not code_format(s).supports("cpu") and code_format(s).supports("torch")
    if torch.cuda.is_available():
        pytest.skip("auto picks Triton here, which reads the format")
    with pytest.warns(
        UserWarning, match=r"the cpu kernels cannot read format=int_nocpu; .*PyTorch path \(backend=torch\)"
    ):
        assert get_backend("auto", (s, QuantSpec(2, 32, "channel"))).name == "torch"
    n = len(recwarn)
    assert get_backend("auto", (s,)).name == "torch" and len(recwarn) == n  # one warning, not one per layer
    assert get_backend("auto", (QuantSpec(2, 32, "channel"),)).name == "cpu"  # int alone keeps the kernel
    with pytest.raises(QuantConfigError, match="backend=cpu cannot read format=int_nocpu"):
        get_backend("cpu", (s,))
    layer = PackedLayer(CacheConfig(key=s, value=s, mode="packed", backend="auto"), None, PaddingState())
    assert layer.backend.name == "torch"


def test_an_explicit_backend_that_cannot_read_the_format_fails_before_model_load(int_without_cpu):
    from helpers_models import compose

    from kvq_lab.run.config import ConfigError, validate

    cfg = compose(["format=int_nocpu", "mode=packed", "exact_window=32", "backend=cpu", "model.path=/no/model"])
    with pytest.raises(ConfigError, match="backend=cpu cannot read format=int_nocpu") as e:
        validate(cfg)  # the model path is bad too: the backend and format checks come first
    assert "\n" not in str(e.value)
    ok = compose(["format=int_nocpu", "mode=packed", "exact_window=32", "backend=torch", "model.path=/no/model"])
    with pytest.raises(ConfigError, match="model.path='/no/model' does not exist"):
        validate(ok)


def test_cache_config_serialises_format_and_codebook():
    cb = (-1.0, -0.25, 0.5, 1.0)
    cfg = CacheConfig(key=QuantSpec(2, 32, "channel", "lut", [-1, -0.25, 0.5, 1]), value=spec("fp8_e5m2", 8, "token"))
    assert cfg.key.codebook == cb and {cfg.key: 1}  # a list becomes a tuple: the spec stays hashable
    back = json.loads(json.dumps(asdict(cfg)))
    assert back["key"]["format"] == "lut" and back["key"]["codebook"] == list(cb)
    assert back["value"] == {
        "bits": 8, "group_size": 32, "axis": "token", "format": "fp8_e5m2", "codebook": None, "tensor_scale": None
    }  # fmt: skip
    assert CacheConfig(key=QuantSpec(**back["key"]), value=QuantSpec(**back["value"])) == cfg
    # a fitted per-tensor scale (nvfp4's) travels the same way, as the fp32 value it is stored as
    fitted = CacheConfig(key=QuantSpec(4, 16, "token", "nvfp4", tensor_scale=0.1), value=cfg.value)
    back = json.loads(json.dumps(asdict(fitted)))
    assert back["key"]["tensor_scale"] == fitted.key.tensor_scale == float(torch.tensor(0.1, dtype=torch.float32))
    assert CacheConfig(key=QuantSpec(**back["key"]), value=QuantSpec(**back["value"])) == fitted
