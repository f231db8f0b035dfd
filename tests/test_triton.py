"""Triton kernels vs the PyTorch reference, on CPU under TRITON_INTERPRET=1 (small, awkward shapes).

Exact where the spec is exact: codes, fp16 parameters and dequantized values bit for bit; decode attention
within fp32 rounding of the reference computation.
"""

import os
import subprocess
import sys

# The interpreter must be chosen before triton is first imported (tl.min & co. are jit functions decorated at
# import). If another test module already imported it (transformers does), rerun this file in a fresh process.
_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

if _LATE and not torch.cuda.is_available():

    def test_kernels_in_a_fresh_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def _interpreter_only(request):
    if _LATE and not torch.cuda.is_available() and request.node.name != "test_kernels_in_a_fresh_interpreter":
        pytest.skip("runs in a fresh process: see test_kernels_in_a_fresh_interpreter")


from kvq_lab.cache import CacheConfig  # noqa: E402
from kvq_lab.cache.attention import PackedKV, kvq_sdpa_attention  # noqa: E402
from kvq_lab.cache.base import PaddingState  # noqa: E402
from kvq_lab.cache.packed import PackedLayer  # noqa: E402
from kvq_lab.kernels import triton_kernels as tk  # noqa: E402
from kvq_lab.kernels.torch_path import decode_attention_torch  # noqa: E402
from kvq_lab.quant.pack import PackedQTensor  # noqa: E402
from kvq_lab.quant.reference import dequantize, quantize  # noqa: E402
from kvq_lab.quant.spec import QuantSpec  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def inputs(B, H, T, D, seed, kind="randn", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g) * 2
    if kind == "outlier":
        x[..., 3] *= 50
    elif kind == "zeros":
        x.zero_()
    elif kind == "constant":
        x[:] = 1.375
    return x.to(dtype).to(DEV)


CASES = [
    # (bits, G, axis, T, D, kind, dtype, partial)
    (2, 32, "channel", 77, 64, "outlier", torch.float32, "zero"),
    (2, 32, "channel", 77, 64, "randn", torch.float32, "exclude"),
    (3, 16, "channel", 45, 128, "randn", torch.float16, "zero"),
    (4, 64, "channel", 70, 64, "randn", torch.float32, "zero"),
    (2, 32, "token", 77, 64, "outlier", torch.float32, "zero"),
    (3, 32, "token", 33, 128, "randn", torch.bfloat16, "zero"),
    (1, 16, "token", 40, 64, "constant", torch.float32, "zero"),
    (8, 64, "token", 31, 64, "zeros", torch.float32, "zero"),
]


@pytest.mark.parametrize("bits,G,axis,T,D,kind,dtype,partial", CASES)
def test_quantize_pack_and_dequantize_match_reference(bits, G, axis, T, D, kind, dtype, partial):
    spec = QuantSpec(bits, G, axis)
    x = inputs(1, 2, T, D, bits * 7 + T, kind, dtype)
    ref = quantize(x, spec, partial=partial)
    packed, scale, zero = tk.quantize_pack(x, spec, partial=partial)
    assert torch.equal(scale, ref.scale) and torch.equal(zero, ref.zero)
    want = PackedQTensor.from_qtensor(ref).packed
    assert torch.equal(packed, want)  # the same bytes as reference codes packed by pack.pack
    got = tk.dequantize_packed(packed, scale, zero, spec, T, dtype)
    assert torch.equal(got, dequantize(ref))


def test_quantize_pack_with_padding_mask():
    spec = QuantSpec(2, 32, "channel")
    x = inputs(2, 2, 64, 64, 3)
    x[0, :, :20] = 1e4  # padding with huge values: must not enter min/max
    valid = torch.ones(2, 1, 64, dtype=torch.bool, device=DEV)
    valid[0, :, :20] = False
    ref = quantize(x, spec, valid=valid)
    packed, scale, zero = tk.quantize_pack(x, spec, valid=valid)
    assert torch.equal(scale, ref.scale) and torch.equal(zero, ref.zero)
    assert torch.equal(packed, PackedQTensor.from_qtensor(ref).packed)


def _layers(kax, vax, backend, S=2, R=32):
    cfg = CacheConfig(
        key=QuantSpec(2, 32, kax), value=QuantSpec(3, 32, vax), mode="packed", residual_length=R, sink_tokens=S,
        backend=backend,
    )  # fmt: skip
    return PackedLayer(cfg, None, PaddingState())


@pytest.mark.parametrize("kax,vax", [("channel", "token"), ("token", "channel")])
def test_cache_with_triton_backend_stores_the_same_bits(kax, vax):
    """The cache streaming through the kernels stores exactly what the PyTorch path stores; decode attention
    over the packed layer (GQA 3:1, D=64, sinks, history, window) matches within fp32 rounding."""
    k, v = inputs(1, 2, 110, 64, 1), inputs(1, 2, 110, 64, 2)
    tl_, th = _layers(kax, vax, "triton"), _layers(kax, vax, "torch")
    for layer in (tl_, th):
        layer.update(k[:, :, :70], v[:, :, :70])
    for N in range(70, 110):
        for layer in (tl_, th):
            layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        if N % 13 and N != 109:
            continue
        for a, b in ((tl_.k_stream.store, th.k_stream.store), (tl_.v_stream.store, th.v_stream.store)):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
        Kt, Vt = tl_.materialize()
        Kh, Vh = th.materialize()
        assert torch.equal(Kt, Kh) and torch.equal(Vt, Vh)
        q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(N)).to(DEV)
        ref = decode_attention_torch(th.decode_view(), q, None, 0.125)
        got = tk.decode_attention(tl_.decode_view(), q, None, 0.125)
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, Kh, Vh, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(got, sdpa.transpose(1, 2), rtol=2e-5, atol=2e-6)


def test_pre_rope_decode_matches_the_pytorch_path():
    """rope=pre: keys are re-rotated after dequantization, which the fused kernel does not do, so decode
    attention hands those layers to the PyTorch path: with backend=triton, the same output as backend=torch."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvq_lab.cache.rope import RopeHelper

    rope = RopeHelper(LlamaRotaryEmbedding(LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64)).to(DEV))
    layers = {}
    for backend in ("triton", "torch"):
        cfg = CacheConfig(mode="packed", residual_length=32, rope="pre", backend=backend)
        layers[backend] = PackedLayer(cfg, rope, PaddingState())
    k, v = inputs(1, 2, 80, 64, 3), inputs(1, 2, 80, 64, 4)
    for layer in layers.values():
        layer.update(k[:, :, :70], v[:, :, :70])
        for N in range(70, 80):
            layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(1)).to(DEV)
    handle = PackedKV(layers["triton"])
    got, _ = kvq_sdpa_attention(None, q, handle, handle, None, scaling=0.125)
    assert torch.equal(got, decode_attention_torch(layers["torch"].decode_view(), q, None, 0.125))


# ----------------------------------------------------------------------------------------------------------------
# every registered code format (small: the interpreter is slow)
# ----------------------------------------------------------------------------------------------------------------
from kvq_lab.quant.formats import FORMATS, default_bits  # noqa: E402

FORMAT_NAMES = sorted(FORMATS)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_dequantizes_bit_for_bit(name, axis):
    """Reference codes packed by pack.pack, unpacked and dequantized by the kernel (a table gather, no zero point
    for fp8): the reference's values exactly."""
    spec = QuantSpec(default_bits(name), 32, axis, name)
    x = inputs(1, 2, 45, 64, 11, "outlier")
    ref = quantize(x, spec)
    p = PackedQTensor.from_qtensor(ref)
    got = tk.dequantize_packed(p.packed, p.scale, p.zero, spec, 45)
    assert torch.equal(got, dequantize(ref))
    assert not torch.equal(got, x)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_in_the_cache(name):
    """backend=triton stores what the PyTorch path stores (other formats than int quantize with the reference), and
    its fused decode attention over the packed view matches the PyTorch path (GQA 3:1, sinks, history, window)."""
    bits = default_bits(name)
    layers = {}
    for backend in ("triton", "torch"):
        cfg = CacheConfig(
            key=QuantSpec(bits, 32, "channel", name), value=QuantSpec(bits, 32, "token", name), mode="packed",
            residual_length=32, sink_tokens=2, backend=backend,
        )  # fmt: skip
        layers[backend] = PackedLayer(cfg, None, PaddingState())
    k, v = inputs(1, 2, 75, 64, 5), inputs(1, 2, 75, 64, 6)
    for layer in layers.values():
        layer.update(k[:, :, :70], v[:, :, :70])
        for N in range(70, 75):
            layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    tl_, th = layers["triton"], layers["torch"]
    for a, b in ((tl_.k_stream.store, th.k_stream.store), (tl_.v_stream.store, th.v_stream.store)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        assert (a.zero is None and b.zero is None) or torch.equal(a.zero, b.zero)
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(7)).to(DEV)
    ref = decode_attention_torch(th.decode_view(), q, None, 0.125)
    got = tk.decode_attention(tl_.decode_view(), q, None, 0.125)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)
