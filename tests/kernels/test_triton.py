"""Triton kernels vs the PyTorch reference, on CPU under TRITON_INTERPRET=1, compiled on a GPU where CUDA is present
(small, awkward shapes).

Exact where the spec is exact: codes, fp16 parameters and dequantized values bit for bit; decode attention
within fp32 rounding of the reference computation.
"""

import os
import subprocess
import sys

import torch

# The interpreter must be chosen before triton is first imported (tl.min & co. are jit functions decorated at
# import). If another test module already imported it (transformers does), rerun this file in a fresh process.
# With CUDA the kernels are compiled and run on the GPU (TRITON_INTERPRET unset): what a GPU check must test.
_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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
from kvq_lab.cache.layers.base import PaddingState  # noqa: E402
from kvq_lab.cache.layers.packed import PackedLayer  # noqa: E402
from kvq_lab.cache.routing.attention import PackedKV, kvq_sdpa_attention  # noqa: E402
from kvq_lab.kernels import cpu_kernel  # noqa: E402
from kvq_lab.kernels import triton as tk  # noqa: E402
from kvq_lab.kernels.torch_path import decode_attention_torch  # noqa: E402
from kvq_lab.kernels.triton import attention as tk_attention  # noqa: E402
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
        key=QuantSpec(2, 32, kax), value=QuantSpec(3, 32, vax), mode="packed", exact_window=R, sink_tokens=S,
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


def test_pre_rope_decode_goes_through_the_kernel(monkeypatch):
    """rope=pre with backend=triton: the routed decode step hands the kernel the pre-RoPE codes with a `RopeView`
    (keys rotated in the kernel), and the result is backend=torch's (history dequantized and re-rotated in Python)
    within fp32 rounding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvq_lab.cache.routing.rope import RopeHelper

    rope = RopeHelper(LlamaRotaryEmbedding(LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64)).to(DEV))
    layers = {}
    for backend in ("triton", "torch"):
        cfg = CacheConfig(mode="packed", exact_window=32, rope="pre", backend=backend)
        layers[backend] = PackedLayer(cfg, rope, PaddingState())
    k, v = inputs(1, 2, 80, 64, 3), inputs(1, 2, 80, 64, 4)
    for layer in layers.values():
        layer.update(k[:, :, :70], v[:, :, :70])
        for N in range(70, 80):
            layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    seen = []
    real = tk.decode_attention
    monkeypatch.setattr(tk, "decode_attention", lambda view, *a: seen.append(view.rope) or real(view, *a))
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(1)).to(DEV)
    handle = PackedKV(layers["triton"])
    got, _ = kvq_sdpa_attention(None, q, handle, handle, None, scaling=0.125)
    assert len(seen) == 1 and seen[0] is not None
    ref = decode_attention_torch(layers["torch"].decode_view(), q, None, 0.125)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6)


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
    got = tk.dequantize_packed(p.packed, *p.read_params(), spec, 45)  # parameters as read (one-byte ones widened)
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
            exact_window=32, sink_tokens=2, backend=backend,
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


# ----------------------------------------------------------------------------------------------------------------
# rope=pre keys, left-padded rows and fp16 / bf16 models in the decode kernel (the C kernel's semantics)
# ----------------------------------------------------------------------------------------------------------------
ROPE = frozenset({"rope"})
PLAIN: frozenset[str] = frozenset()


def rotary(D: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvq_lab.cache.routing.rope import RopeHelper

    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=2048)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return RopeHelper(LlamaRotaryEmbedding(cfg).to(DEV))


def fp64_attention(q, K, V, mask, scale):
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), K.double(), V.double(), attn_mask=m, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def streamed(cfg, D, B, L, T, dtype, seed, padding=None, ids=None):
    """A packed layer (backend=torch: the same bits as triton, quantized without the interpreter) fed a prompt of L
    tokens, then one token per step up to T; K/V with an outlier channel."""
    layer = PackedLayer(cfg, rotary(D), padding or PaddingState())
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, 2, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)
    k[..., 5] *= 8
    k, v = k.to(dtype).to(DEV), v.to(dtype).to(DEV)
    kw = {} if ids is None else {"position_ids": ids}
    layer.update(k[:, :, :L], v[:, :, :L], **kw)
    for N in range(L, T):
        kw = {} if ids is None else {"position_ids": ids[:, -1:] + 1 + N - L}
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1], **kw)
    return layer, g


# (key spec, value spec, R, sinks, D, query heads per kv head, batch, prompt, tokens, dtype, positions per program)
ROPE_CASES = [
    ((2, 32, "channel"), (2, 32, "token"), 32, 0, 64, 3, 1, 101, 131, torch.float32, 64),  # GQA 3 (a padded head)
    ((3, 16, "token"), (4, 32, "channel"), 0, 3, 128, 1, 2, 37, 70, torch.float32, None),  # 3-bit words, R=0, MHA
    ((2, 16, "channel"), (3, 32, "token"), 16, 2, 64, 4, 1, 61, 90, torch.bfloat16, 32),  # bf16, GQA 4, 3 chunks
    ((4, 32, "channel"), (2, 32, "token"), 32, 5, 64, 2, 1, 45, 53, torch.float16, None),  # fp16, sinks
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"K{c[0][0]}{c[0][2][0]}-R{c[2]}-S{c[3]}-D{c[4]}-r{c[5]}-"
                         f"{str(c[9])[6:]}")  # fmt: skip
def test_rope_pre_in_the_kernel_matches_the_pytorch_path(case):
    """rope=pre keys rotated in the kernel (`view.rope`) give the PyTorch path's output (history dequantized and
    re-rotated in Python) within rounding, with and without a mask, in one program or several chunks; in fp32 within
    twice the PyTorch path's error of fp64 attention. The view read without its rotation, or with the inverse
    rotation (the table's sin negated), differs: the kernel reads the table."""
    key, value, R, S, D, r, B, L, T, dtype, chunk = case
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend="torch", rope="pre")  # fmt: skip
    layer, g = streamed(cfg, D, B, L, T, dtype, T + D)
    view = layer.view_for(ROPE)
    assert view.rope is not None and view.keys.history is None and view.keys.n > 0  # the kernel reads the codes
    q = (torch.randn(B, 2 * r, 1, D, generator=g) * 2).to(dtype).to(DEV)
    scale, N = D**-0.5, layer.N
    assert tk.supports(view, q, None)
    mask = torch.randn(B, 1, 1, N, generator=g).to(DEV)
    tol = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]  # fp32 rounding; one ulp of half
    for m in (None, mask):
        got = tk.decode_attention(view, q, m, scale, chunk=chunk)
        assert got.dtype == dtype and got.shape == (B, 1, 2 * r, D)
        ours = decode_attention_torch(layer.view_for(PLAIN), q, m, scale)
        torch.testing.assert_close(got.float(), ours.float(), rtol=tol, atol=tol)
        if dtype == torch.float32:
            K, V = layer.materialize()
            exact = fp64_attention(q, K, V, m, scale)
            err_kernel = (got.double() - exact).abs().max().item()
            err_torch = (ours.double() - exact).abs().max().item()
            assert err_kernel <= 2 * err_torch + 5e-6, (err_kernel, err_torch)
    ref = decode_attention_torch(layer.view_for(PLAIN), q, None, scale).float()
    unrotated = tk.decode_attention(view._replace(rope=None), q, None, scale, chunk=chunk).float()
    inverse = view._replace(rope=view.rope._replace(sin=-view.rope.sin))
    inverted = tk.decode_attention(inverse, q, None, scale, chunk=chunk).float()
    assert (unrotated - ref).abs().max() > 1e-2 and (inverted - ref).abs().max() > 1e-2


# (key spec, value spec, R, sinks, rope, pads per row, prompt length, tokens, dtype, positions per program)
PAD_CASES = [
    # rope=pre, row 2's first chunk all padding (40 pads > 32 positions per program)
    ((2, 32, "channel"), (2, 32, "token"), 32, 2, "pre", [0, 5, 40], 75, 100, torch.float32, 32),
    ((3, 32, "token"), (2, 16, "channel"), 0, 3, "post", [9, 0, 72], 75, 90, torch.float32, None),  # a row < sinks+R
    ((2, 32, "channel"), (4, 32, "token"), 32, 4, "pre", [0, 71], 74, 84, torch.bfloat16, None),  # 3 real tokens, bf16
]


@pytest.mark.parametrize("case", PAD_CASES, ids=lambda c: f"K{c[0][0]}{c[0][2][0]}-R{c[2]}-S{c[3]}-{c[4]}-B{len(c[5])}-"
                         f"{str(c[8])[6:]}")  # fmt: skip
def test_padded_rows_in_the_kernel_match_attention_over_the_padded_cache(case):
    """A left-padded batch: each row read with its own padding, sinks, history and window (per-row starts and
    counts), rope=pre keys at each row's own position ids, against SDPA over the materialized cache with the padding
    mask (bool and additive): within rounding, and in fp32 within twice its error of fp64. The same view read as if
    unpadded differs (the kernel reads the pads)."""
    key, value, R, S, rope, pads, L, T, dtype, chunk = case
    B, D, r = len(pads), 64, 3
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend="torch", rope=rope)  # fmt: skip
    padding = PaddingState()
    real = torch.arange(L)[None] >= torch.tensor(pads)[:, None]  # [B, L] 0...0 1...1
    padding.prompt_mask = real.long().to(DEV)
    ids = (real.cumsum(1) - 1).clamp(min=0).to(DEV)  # the position ids generate gives a left-padded prompt
    layer, g = streamed(cfg, D, B, L, T, dtype, L + T, padding, ids)
    view = layer.view_for(frozenset({"rope", "rows"}))
    assert view.pads is not None and (view.rope is not None) == (rope == "pre")
    q = (torch.randn(B, 2 * r, 1, D, generator=g) * 2).to(dtype).to(DEV)
    scale, N = D**-0.5, layer.N
    K, V = layer.materialize()
    valid = torch.cat([real, torch.ones(B, N - L, dtype=torch.bool)], 1)[:, None, None, :].to(DEV)  # [B, 1, 1, N]
    additive = torch.where(valid, torch.randn(B, 1, 1, N, generator=g).to(DEV), float("-inf"))
    # bf16: `materialize` rounds the re-rotated history to the model's dtype, the kernel attends to it in fp32
    # (as the PyTorch path does): up to ~1.2e-2 apart here
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for mask in (valid, additive):
        assert tk.supports(view, q, mask)
        got = tk.decode_attention(view, q, mask, scale, chunk=chunk)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.float(), K.float(), V.float(), attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(got.float(), sdpa, rtol=tol, atol=tol)
        if dtype == torch.float32:
            exact = fp64_attention(q, K, V, mask, scale)
            err_kernel = (got.double() - exact).abs().max().item()
            assert err_kernel <= 2 * (sdpa.double() - exact).abs().max().item() + 5e-6
    if DEV == "cpu" and cpu_kernel.build_error() is None:  # the C kernel's semantics: the same result on this view
        c = cpu_kernel.decode_attention(view, q, additive, scale)
        torch.testing.assert_close(got, c, rtol=tol / 4, atol=tol / 4)
    unpadded = view._replace(pads=torch.zeros_like(view.pads))
    assert (tk.decode_attention(unpadded, q, valid, scale, chunk=chunk) - got).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN-poisoned rows, on purpose
def test_what_the_kernel_refuses():
    """A mask per query head is not the kernel's: a plain view takes the PyTorch path (same result), a view with
    rope=pre or pads is refused (it would be read wrongly there). rope=pre ids outside the table are refused on CPU
    tensors and poison the output (NaN) in the kernel itself, never a silent wrong answer."""
    cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                      exact_window=32, backend="torch", rope="pre")  # fmt: skip
    layer, g = streamed(cfg, 64, 1, 70, 72, torch.float32, 5)
    q = torch.randn(1, 4, 1, 64, generator=g).to(DEV)
    per_head = torch.randn(1, 4, 1, layer.N, generator=g).to(DEV)
    view = layer.view_for(ROPE)
    plain = view._replace(rope=None)  # the codes as stored, read by either path
    assert not tk.supports(plain, q, per_head) and tk.supports(view, q, None)
    fallback = tk.decode_attention(plain, q, per_head, 0.125)
    assert torch.equal(fallback, decode_attention_torch(plain, q, per_head, 0.125))
    with pytest.raises(ValueError, match="cannot take this query, mask or view"):
        tk.decode_attention(view, q, per_head, 0.125)
    bad = view._replace(rope=view.rope._replace(pos=view.rope.pos + view.rope.cos.shape[0]))
    if DEV == "cpu":
        with pytest.raises(ValueError, match="position ids outside the RopeView table"):
            tk.decode_attention(bad, q, None, 0.125)
        tk_attention._check_rope_ids, real = (lambda view: None), tk_attention._check_rope_ids
        try:
            assert tk.decode_attention(bad, q, None, 0.125).isnan().all()
        finally:
            tk_attention._check_rope_ids = real
    else:
        assert tk.decode_attention(bad, q, None, 0.125).isnan().all()


@pytest.mark.slow  # ~20 s of CPU under the interpreter (the quantize kernels run every step too)
def test_padded_generation_goes_through_the_kernel(monkeypatch, rope="pre"):
    """A left-padded batch of 3 prompts on a tiny Llama (GQA 2, D=64), rope=pre: backend=triton generates
    backend=torch's greedy tokens (which materializes the padded cache for the model's SDPA), every decode step of
    every layer through the kernel with a padded view and a rope view."""
    from conftest import left_padded_prompts, padded_packed_cache, tiny_llama

    model = tiny_llama().to(DEV)
    calls = []
    real = tk.decode_attention
    monkeypatch.setattr(tk, "decode_attention", lambda view, *a: calls.append((view.pads, view.rope)) or real(view, *a))
    ids, mask = (t.to(DEV) for t in left_padded_prompts([45, 12, 38]))
    out = {}
    for backend in ("triton", "torch"):
        cache = padded_packed_cache(model, mask, rope, backend)
        with torch.no_grad():
            out[backend] = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                                          min_new_tokens=8, do_sample=False)[:, 45:]  # fmt: skip
    assert torch.equal(out["triton"], out["torch"])
    assert len(calls) == 7 * model.config.num_hidden_layers
    assert all(p is not None and (r is not None) == (rope == "pre") for p, r in calls)


# ----------------------------------------------------------------------------------------------------------------
# the tensor-core route (`attention_tc`): fp16 / bf16 models, int codes, rope=post
# ----------------------------------------------------------------------------------------------------------------
def half_attention(q, K, V, mask, scale, dtype):
    """Attention as a half-precision GPU kernel computes it: q, K, V in the model's dtype, scores and sums in fp32,
    the softmax weights rounded to the model's dtype before the product with V (FlashAttention's precision)."""
    r = q.shape[1] // K.shape[1]
    qh, Kh, Vh = (t.to(dtype).double() for t in (q, K.repeat_interleave(r, 1), V.repeat_interleave(r, 1)))
    sc = (qh @ Kh.transpose(-1, -2)).float().double() * scale
    if mask is not None:
        sc = sc + (torch.zeros_like(mask, dtype=torch.double).masked_fill(~mask, float("-inf")) if mask.dtype ==
                   torch.bool else mask.double())  # fmt: skip
    mx = sc.amax(-1, keepdim=True)
    e = torch.exp(sc - mx)
    return ((e.to(dtype).double() @ Vh) / e.sum(-1, keepdim=True)).to(dtype).transpose(1, 2)


def exact_view_attention(view, q, mask, scale):
    """fp64 attention over the view's K/V as the PyTorch path assembles them (fp32 dequantized history)."""
    from kvq_lab.kernels.torch_path import _assemble

    K = _assemble(view.keys, view.N, view.sink_tokens, "k").clone()
    V = _assemble(view.values, view.N, view.sink_tokens, "v").clone()
    return fp64_attention(q, K, V, mask, scale), K, V


# (key spec, value spec, R, sinks, D, query heads per kv head, prompt, tokens, splits, mask)
TC_CASES = [
    ((2, 32, "channel"), (2, 32, "token"), 32, 2, 64, 4, 101, 131, None, None),  # KIVI's, GQA 4
    ((2, 32, "channel"), (2, 32, "token"), 32, 2, 64, 4, 101, 131, 3, "float"),  # 3 history splits, a mask
    ((2, 32, "channel"), (4, 32, "token"), 128, 0, 128, 8, 300, 301, 1, None),  # D 128, GQA 8, one split
    ((4, 64, "channel"), (2, 64, "channel"), 0, 4, 64, 3, 150, 157, 2, None),  # V per-channel: folded on the output
    ((2, 32, "token"), (2, 16, "token"), 0, 0, 64, 1, 77, 79, None, None),  # both per-token, no window, MHA
    ((1, 32, "token"), (8, 32, "channel"), 32, 1, 64, 2, 60, 100, 2, None),  # 1- and 8-bit codes
    ((2, 128, "channel"), (2, 32, "token"), 128, 0, 256, 2, 256, 257, None, None),  # D 256, G 128
    ((2, 32, "channel"), (2, 32, "token"), 32, 0, 64, 3, 1, 2, None, None),  # two tokens: no history at all
    ((2, 32, "channel"), (2, 32, "token"), 0, 3, 64, 3, 35, 36, None, "bool"),  # R 0: history after the sinks
]


@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: f"K{c[0][0]}{c[0][2][0]}{c[0][1]}-V{c[1][0]}{c[1][2][0]}"
                         f"{c[1][1]}-R{c[2]}-S{c[3]}-D{c[4]}-r{c[5]}-N{c[7]}-s{c[8]}-{c[9]}")  # fmt: skip
def test_tensor_core_route_matches_attention_in_half_precision(case):
    """fp16 model, int codes: the tensor-core route (codes made half by the magic number, per-channel parameters
    folded into the query or the product, both products as tl.dot) against fp64 attention over the same stored K/V:
    at most twice the error of attention computed in the model's half precision, on awkward lengths (one token,
    no history, a history not a multiple of the tile, one and several splits). The general route gives the same
    answer within that rounding."""
    key, value, R, S, D, r, L, T, splits, mask_kind = case
    dtype = torch.float16
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend="torch")  # fmt: skip
    layer, g = streamed(cfg, D, 1, L, T, dtype, T + D + r)
    view = layer.decode_view()
    q = (torch.randn(1, 2 * r, 1, D, generator=g) * 2).to(dtype).to(DEV)
    N, scale = layer.N, D**-0.5
    mask = {None: None, "float": torch.randn(1, 1, 1, N, generator=g).to(DEV),
            "bool": (torch.rand(1, 1, 1, N, generator=g) > 0.2).to(DEV)}[mask_kind]  # fmt: skip
    assert tk.supports(view, q, mask) == "tensor_cores"
    got = tk.decode_attention(view, q, mask, scale, splits=splits)
    assert got.dtype == dtype and got.shape == (1, 1, 2 * r, D)
    exact, K, V = exact_view_attention(view, q, mask, scale)
    err = (got.double() - exact).abs().max().item()
    err_half = (half_attention(q, K, V, mask, scale, dtype).double() - exact).abs().max().item()
    assert err <= 2 * err_half + 1e-4, (err, err_half)
    general = tk.decode_attention(view, q, mask, scale, route="general")
    torch.testing.assert_close(got.float(), general.float(), rtol=4e-3, atol=4e-3)


# (key spec, value spec, R, sinks, pads per row, prompt, tokens)
TC_PAD_CASES = [
    ((2, 32, "channel"), (2, 32, "token"), 32, 2, [0, 5, 40], 75, 100),  # row 3: pads longer than the window
    ((2, 32, "token"), (4, 32, "token"), 32, 0, [9, 0], 75, 90),  # both per-token: the run starts after the pads
    ((4, 32, "token"), (2, 32, "channel"), 0, 3, [0, 70, 33], 75, 80),  # a row of 5 real tokens
]


@pytest.mark.parametrize("case", TC_PAD_CASES, ids=lambda c: f"K{c[0][2][0]}V{c[1][2][0]}-R{c[2]}-S{c[3]}-B{len(c[4])}")
def test_tensor_core_route_reads_left_padded_rows(case):
    """A left-padded batch on the tensor-core route (each row's own sinks, history and window; a per-token stream
    read at the per-channel stream's offsets) against fp64 attention over the materialized padded cache with its
    padding mask: within twice the half-precision error, and the general route's answer within rounding."""
    key, value, R, S, pads, L, T = case
    B, D, r, dtype = len(pads), 64, 4, torch.float16
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend="torch")  # fmt: skip
    padding = PaddingState()
    real = torch.arange(L)[None] >= torch.tensor(pads)[:, None]
    padding.prompt_mask = real.long().to(DEV)
    ids = (real.cumsum(1) - 1).clamp(min=0).to(DEV)
    layer, g = streamed(cfg, D, B, L, T, dtype, L + T + B, padding, ids)
    view = layer.view_for(frozenset({"rows"}))
    assert view.pads is not None
    q = (torch.randn(B, 2 * r, 1, D, generator=g) * 2).to(dtype).to(DEV)
    N, scale = layer.N, D**-0.5
    valid = torch.cat([real, torch.ones(B, N - L, dtype=torch.bool)], 1)[:, None, None, :].to(DEV)
    assert tk.supports(view, q, valid) == "tensor_cores"
    got = tk.decode_attention(view, q, valid, scale, splits=2)
    K, V = layer.materialize()  # the model's dtype: the history rounded once more than the kernel reads it
    exact = fp64_attention(q, K, V, valid, scale)
    err = (got.double() - exact).abs().max().item()
    err_half = (half_attention(q, K, V, valid, scale, dtype).double() - exact).abs().max().item()
    assert err <= 2 * err_half + 2e-3, (err, err_half)
    general = tk.decode_attention(view, q, valid, scale, route="general")
    torch.testing.assert_close(got.float(), general.float(), rtol=4e-3, atol=4e-3)


def test_which_route_runs():
    """`supports` names the route: tensor cores for fp16 int codes at rope=post; the general route for an fp32 model,
    rope=pre keys, table formats, 3-bit words and per-channel groups of 16; bf16 only compiled (the interpreter's
    bf16 arithmetic is wrong). Asking for the tensor-core route where it cannot run is an error naming why."""

    def view_q(dtype=torch.float16, key=(2, 32, "channel"), value=(2, 32, "token"), rope="post"):
        cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=32,
                          backend="torch", rope=rope)  # fmt: skip
        layer, g = streamed(cfg, 64, 1, 70, 72, dtype, 1)
        return layer.view_for(frozenset({"rope"})), torch.randn(1, 4, 1, 64, generator=g).to(dtype).to(DEV)

    assert tk.supports(*view_q()) == "tensor_cores"
    for kw in (dict(dtype=torch.float32), dict(rope="pre"), dict(key=(2, 32, "channel", "lut")),
               dict(value=(3, 32, "token")), dict(key=(2, 16, "channel"))):  # fmt: skip
        view, q = view_q(**kw)
        assert tk.supports(view, q) == "general", kw
        with pytest.raises(ValueError, match="tensor-core route cannot take this view"):
            tk.decode_attention(view, q, None, 0.125, route="tensor_cores")
    view, q = view_q(dtype=torch.bfloat16)
    assert tk.supports(view, q) == ("tensor_cores" if DEV == "cuda" else "general")


@pytest.mark.slow  # ~30 s of CPU under the interpreter
def test_fp16_generation_takes_the_tensor_core_route(monkeypatch):
    """A tiny fp16 Llama (GQA 2, D=64) generating through a packed 2-bit cache with backend=triton: every decode step
    of every layer takes the tensor-core route (left-padded batch of 2, rope=post), and each step's next-token logits
    stay within half-precision rounding of backend=torch's on the same cache contents (the first step: later ones
    read K/V that depend on earlier rounding). Measured: 0.0098 apart on logits up to 15.6, about one fp16 ulp."""
    from conftest import left_padded_prompts, padded_packed_cache, tiny_llama

    model = tiny_llama().to(DEV).half()
    routes = []
    real = tk.decode_attention
    monkeypatch.setattr(tk, "decode_attention", lambda view, q, *a: routes.append(tk.supports(view, q, a[0]))
                        or real(view, q, *a))  # fmt: skip
    ids, mask = (t.to(DEV) for t in left_padded_prompts([70, 41]))
    logits = {}
    for backend in ("triton", "torch"):
        cache = padded_packed_cache(model, mask, "post", backend)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        logits[backend] = out.logits[1].float()  # the first decode step's
    assert len(routes) == 3 * model.config.num_hidden_layers and set(routes) == {"tensor_cores"}
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=2e-2)
