"""`backend=cpu`: the C decode-attention kernel against the PyTorch path on awkward shapes, in generation, and
its build: a missing compiler fails with a message that names the fix (and `auto` falls back with a warning)."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded_prompts, spy_cpu_kernel, spy_kept_calls
from helpers_models import compose, gen

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.routing import backends as backends_mod
from kvq_lab.cache.routing.backends import get_backend
from kvq_lab.kernels import cpu_build, cpu_kernel
from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.quant.formats import FORMATS, default_bits, get_format
from kvq_lab.quant.spec import QuantSpec

# (key axis, value axis, key bits, value bits, sinks, R, D, G, query heads per kv head, batch, tokens)
CASES = [
    ("channel", "token", 2, 2, 0, 128, 64, 32, 3, 1, 420),  # the benchmark's setting, two chunks of 256
    ("token", "channel", 3, 4, 3, 32, 128, 32, 1, 2, 300),  # 3-bit words, D=128, no GQA, sinks
    ("channel", "channel", 1, 8, 2, 64, 64, 16, 4, 2, 300),
    ("token", "token", 4, 3, 0, 0, 64, 64, 3, 1, 600),  # R=0: every token quantized, three chunks
    ("channel", "token", 2, 2, 5, 0, 64, 32, 2, 2, 170),
]


def _layer(kax, vax, kb, vb, S, R, G, backend="cpu"):
    cfg = CacheConfig(
        key=QuantSpec(kb, G, kax), value=QuantSpec(vb, G, vax), mode="packed", exact_window=R, sink_tokens=S,
        backend=backend,
    )  # fmt: skip
    return PackedLayer(cfg, None, PaddingState())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"K{c[2]}{c[0][0]}-V{c[3]}{c[1][0]}-S{c[4]}-R{c[5]}-D{c[6]}")
def test_kernel_matches_the_pytorch_path(case):
    """Every segment (sinks, history of any axis and bits, window), T not a multiple of G, several chunks, GQA,
    bool and additive masks: measured against fp64 attention over the same dequantized K/V, the kernel's error is
    within the PyTorch path's own (fp32 rounding; an outlier channel makes scores large, so that is ~1e-5)."""
    kax, vax, kb, vb, S, R, D, G, r, B, T = case
    layer = _layer(kax, vax, kb, vb, S, R, G)
    g = torch.Generator().manual_seed(T)
    k, v = torch.randn(B, 2, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)
    k[..., 3] *= 20  # an outlier channel
    layer.update(k[:, :, :150], v[:, :, :150])
    checked, err_kernel, err_torch = 0, 0.0, 0.0
    for N in range(150, T):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        if (N - 150) % 37 and N != T - 1:
            continue
        q = torch.randn(B, 2 * r, 1, D, generator=g) * 3
        scale = D**-0.5
        K, V = layer.materialize()
        for mask in (None, torch.rand(B, 1, 1, N + 1, generator=g) > 0.3, torch.randn(B, 1, 1, N + 1, generator=g)):
            m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
            exact = torch.nn.functional.scaled_dot_product_attention(
                q.double(), K.double(), V.double(), attn_mask=m64, scale=scale, enable_gqa=True
            ).transpose(1, 2)
            got = cpu_kernel.decode_attention(layer.decode_view(), q, mask, scale)
            ours = decode_attention_torch(layer.decode_view(), q, mask, scale)
            torch.testing.assert_close(got, ours, rtol=1e-4, atol=1e-4)
            err_kernel = max(err_kernel, (got.double() - exact).abs().max().item())
            err_torch = max(err_torch, (ours.double() - exact).abs().max().item())
            checked += 1
    assert checked >= 6
    assert err_kernel <= 2 * err_torch + 1e-6, (err_kernel, err_torch)


@pytest.fixture(scope="module")
def portable_dir(tmp_path_factory):
    """One kernel cache for this module's portable builds: the first test to ask builds (~7 s), the others load it."""
    return tmp_path_factory.mktemp("portable")


def portable_build(monkeypatch, where) -> None:
    """Make the next kernel call build (or load, if built there before) `-DKVQ_PORTABLE` (plain C, no x86
    intrinsics) in `where`."""
    monkeypatch.setenv("KVQ_KERNEL_CACHE", str(where))
    monkeypatch.setenv("KVQ_KERNEL_CFLAGS", "-DKVQ_PORTABLE")
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_ERROR", None)


def test_portable_build_matches(monkeypatch, portable_dir):
    """The plain-C fp16 conversion (what a CPU without F16C, or a build without -march=native, uses) gives the
    same outputs as the default build: fp16 -> fp32 is exact both ways, subnormals and negative zero included."""
    layer = _layer("token", "channel", 2, 3, 1, 32, 32)  # per-token keys: one conversion per group per row
    k, v = torch.randn(1, 2, 140, 64), torch.randn(1, 2, 140, 64)
    k[:, :, :, 32:] *= 1e-6  # tiny groups: subnormal fp16 scales
    v[:, :, 70:100] = -0.0
    layer.update(k, v)
    q = torch.randn(1, 4, 1, 64)
    default = cpu_kernel.decode_attention(layer.decode_view(), q, None, 0.125)
    portable_build(monkeypatch, portable_dir)
    portable = cpu_kernel.decode_attention(layer.decode_view(), q, None, 0.125)
    assert len(list(portable_dir.glob("cpu_kernel-*.so"))) == 1
    assert torch.equal(portable, default)
    assert bool((layer.k_stream.store.scale.float().abs() < 6.1e-5).any())  # subnormals were really there


@pytest.mark.parametrize("key,value,D", [
    (QuantSpec(8, 32, "channel", "fp8_e4m3"), QuantSpec(8, 32, "token", "fp8_e5m2"), 64),  # fp8: from the bits
    (QuantSpec(4, 32, "token", "lut"), QuantSpec(2, 32, "channel", "lut"), 64),  # <= 16 entries: lane permutes
    (QuantSpec(3, 32, "channel", "lut"), QuantSpec(1, 32, "token", "lut"), 64),  # 8 entries, 2 (a padded table)
    # 40 channels: 16 + 16 at a time, then 8 (AVX-512 builds), and per-token groups of 8: the 8-wide loop alone
    (QuantSpec(8, 32, "channel", "fp8_e5m2"), QuantSpec(8, 8, "token", "fp8_e4m3"), 40),
    (QuantSpec(2, 32, "channel", "lut"), QuantSpec(4, 8, "token", "lut"), 40),
    # 5-bit codes: 40-bit words of 5 bytes, 32-entry tables (the scalar lookup in both builds)
    (QuantSpec(5, 32, "channel", "q5_1"), QuantSpec(5, 32, "token", "q5_0"), 64),
])  # fmt: skip
def test_portable_build_matches_for_table_formats(monkeypatch, portable_dir, key, value, D):
    """The vector paths for formats with a table (fp8 values computed from the code bits, small tables looked up by
    lane permutes, 16 or 8 channels at a time) give exactly the portable build's scalar lookups, negative zero and
    subnormal codes included."""
    cfg = CacheConfig(key=key, value=value, mode="packed", exact_window=32, sink_tokens=1, backend="cpu")
    layer = PackedLayer(cfg, None, PaddingState())
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(1, 2, 150, D, generator=g), torch.randn(1, 2, 150, D, generator=g)
    k[:, :, :, 7] *= 30  # an outlier channel: small codes elsewhere (fp8 subnormals)
    v[:, :, 40:60] = -0.0
    layer.update(k, v)
    q = torch.randn(1, 4, 1, D, generator=g)
    assert cpu_kernel.supports(layer.decode_view(), q) and layer.k_stream.n_quantized(150) > 0
    default = cpu_kernel.decode_attention(layer.decode_view(), q, None, 0.125)
    portable_build(monkeypatch, portable_dir)
    portable = cpu_kernel.decode_attention(layer.decode_view(), q, None, 0.125)
    assert torch.equal(portable, default)
    torch.testing.assert_close(default, decode_attention_torch(layer.decode_view(), q, None, 0.125), rtol=1e-4,
                               atol=1e-4)  # fmt: skip


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_fp8_tables_are_decoded_from_their_bits(monkeypatch, portable_dir):
    """Where the build has the vector paths (-march=native on an x86 CPU with AVX2 and F16C), both fp8 formats'
    tables are recognised as their bit decodings (3 / 2 mantissa bits), so their codes are computed, not looked up one
    by one (the decoder is checked against all 256 entries of the table at every call: a wrong one would fall back to
    the slow scalar loop silently, not give wrong values); other tables are looked up. The portable build has none."""
    lib = cpu_kernel.load()
    tables = {name: get_format(name, 8).build_table().contiguous() for name in ("fp8_e4m3", "fp8_e5m2")}
    lut = torch.linspace(-1, 1, 256).contiguous()
    flags = _cpu_flags()
    width = lib.kvq_simd_width()
    if {"avx2", "f16c"} <= flags:
        assert width == (16 if "avx512f" in flags else 8)
    if width:
        assert lib.kvq_fp8_decoding(tables["fp8_e4m3"].data_ptr()) == 3
        assert lib.kvq_fp8_decoding(tables["fp8_e5m2"].data_ptr()) == 2
    assert lib.kvq_fp8_decoding(lut.data_ptr()) == 0
    portable_build(monkeypatch, portable_dir)
    lib = cpu_kernel.load()
    assert lib.kvq_simd_width() == 0 and lib.kvq_fp8_decoding(tables["fp8_e4m3"].data_ptr()) == 0


def test_generation_matches_the_pytorch_path(tiny, monkeypatch):  # noqa: F811
    """Same greedy tokens with backend=cpu and backend=torch, and decode steps really go through the kernel."""
    calls = spy_cpu_kernel(monkeypatch)
    ids = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(4))
    out = {}
    for backend in ("cpu", "torch"):
        cfg = CacheConfig(
            key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed", exact_window=32,
            sink_tokens=2, backend=backend,
        )  # fmt: skip
        out[backend] = gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids, 40)
    assert torch.equal(out["cpu"], out["torch"])
    assert len(calls) == 39 * 2  # every decode step after the first token, in both layers


def test_hadamard_generation_maps_in_the_kernel(tiny, monkeypatch):  # noqa: F811
    """hadamard on keys and values with backend=cpu: every decode step hands the kernel `DecodeView.hadamard` (the
    query and output maps made there), and the greedy tokens are backend=torch's (the maps made by kvq_sdpa)."""
    seen = spy_cpu_kernel(monkeypatch, lambda view: view.hadamard)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(6))
    out = {}
    for backend in ("cpu", "torch"):
        cfg = CacheConfig(
            key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed", exact_window=32,
            sink_tokens=1, backend=backend, key_transform=("hadamard",), value_transform=("hadamard",),
        )  # fmt: skip
        out[backend] = gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids, 24)
    assert torch.equal(out["cpu"], out["torch"])
    assert seen and all(h == (64, 64) for h in seen)


def test_pre_rope_keys_match_the_pytorch_path(tiny):  # noqa: F811
    """rope=pre: the kernel rotates the keys itself (tests/kernels/test_cpu_kernel_configs.py); same greedy tokens as
    backend=torch."""
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(5))
    out = {}
    for backend in ("cpu", "torch"):
        cfg = CacheConfig(mode="packed", exact_window=32, rope="pre", backend=backend)
        out[backend] = gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids, 20)
    assert torch.equal(out["cpu"], out["torch"])


def test_unsupported_inputs_fall_back():
    layer = _layer("channel", "token", 2, 2, 0, 32, 32)
    k = torch.randn(1, 2, 70, 64)
    layer.update(k, k)
    q = torch.randn(1, 4, 1, 64)
    assert cpu_kernel.supports(layer.decode_view(), q)
    per_head = torch.rand(1, 4, 1, 70) > 0.5  # a mask that differs between heads: PyTorch path
    torch.testing.assert_close(
        cpu_kernel.decode_attention(layer.decode_view(), q, per_head, 0.125),
        decode_attention_torch(layer.decode_view(), q, per_head, 0.125),
    )
    fp64 = _layer("channel", "token", 2, 2, 0, 32, 32)  # a dtype the kernel does not read (fp16 and bf16 it does)
    fp64.update(k.double(), k.double())
    assert not cpu_kernel.supports(fp64.decode_view(), q.double())


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A fresh kernel cache dir, no loaded kernel, and a C compiler that does not exist."""
    monkeypatch.setenv("KVQ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_ERROR", None)
    monkeypatch.setattr(backends_mod, "_WARNED", set())


def test_auto_picks_the_kernel_on_cpu():
    assert get_backend("auto").name == ("triton" if torch.cuda.is_available() else "cpu")


def test_missing_compiler_names_the_fix(no_compiler):
    with pytest.raises(cpu_kernel.KernelBuildError, match="install gcc, or set backend=torch"):
        get_backend("cpu")
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="uses the PyTorch path"):
            assert get_backend("auto").name == "torch"


def test_failed_build_names_the_fix(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: error: no such instruction' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("KVQ_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_ERROR", None)
    with pytest.raises(cpu_kernel.KernelBuildError, match="set backend=torch") as e:
        cpu_kernel.load()
    assert "no such instruction" in str(e.value)  # the compiler's own words come with it


def test_backend_cpu_without_compiler_fails_before_model_load(no_compiler):
    from kvq_lab.run.config import ConfigError, validate

    cfg = compose(["mode=packed", "exact_window=32", "backend=cpu", "model.path=/nonexistent/model"])
    with pytest.raises(ConfigError, match="backend=cpu: cannot run the C compiler"):
        validate(cfg)  # the model path is bad too: the backend check comes first, before anything is loaded


def test_kernel_is_built_once_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("KVQ_KERNEL_CFLAGS", "-O0")  # what is cached, not its speed: a quicker build
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_ERROR", None)
    cpu_kernel.load()
    built = list(tmp_path.glob("cpu_kernel-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(cpu_build, "_LIB", None)
    monkeypatch.setattr(cpu_build, "_compile", lambda out: pytest.fail("rebuilt although cached"))
    cpu_kernel.load()


@pytest.mark.parametrize("k_t, v_t, maps", [
    (("hadamard",), ("hadamard",), (64, 64)),
    (("hadamard",), (), (64, 0)),
    ((), ("hadamard:16",), (0, 16)),
    (("hadamard:32",), ("hadamard",), (32, 64)),
    (("rotatekv",), ("hadamard",), (0, 64)),  # another foldable map (fitted below): kvq_sdpa maps the query
])  # fmt: skip
def test_the_kernel_maps_the_hadamard_query_and_output(k_t, v_t, maps):
    """A layer whose pipeline is the hadamard transform alone hands the kernel `DecodeView.hadamard`; the kernel then
    maps the query and the output itself, with the same bits (fp32) as the maps kvq_sdpa makes around it, sinks
    included. The PyTorch path refuses such a view rather than ignore it."""
    from kvq_lab.kernels.view import Unsupported
    from kvq_lab.quant.transforms.rotatekv import RotateKV

    if k_t == ("rotatekv",):
        k_t = (RotateKV.example().spelling,)  # a fitted channel order
    cfg = CacheConfig(
        key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed", exact_window=32,
        sink_tokens=1, backend="cpu", key_transform=k_t, value_transform=v_t,
    )  # fmt: skip
    layer = PackedLayer(cfg, None, PaddingState())
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(1, 2, 150, 64, generator=g), torch.randn(1, 2, 150, 64, generator=g)
    layer.update(k, v)
    view = layer.decode_view()
    assert view.hadamard == maps
    q = torch.randn(1, 4, 1, 64, generator=g)
    kp, vp = layer.k_pipe, layer.v_pipe
    q_in = kp.fold_query(q) if kp is not None and not maps[0] else q  # what kvq_sdpa hands the kernel
    got = cpu_kernel.decode_attention(view, q_in, None, 0.125)
    if vp is not None and not maps[1]:
        got = vp.fold_output(got)
    plain = cpu_kernel.decode_attention(view._replace(hadamard=None), kp.fold_query(q) if kp else q, None, 0.125)
    assert torch.equal(got, vp.fold_output(plain) if vp is not None else plain)
    with pytest.raises(Unsupported):
        decode_attention_torch(view, q, None, 0.125)


# --- kept calls: the argument block of an earlier step's view, what moves written in ------------------------------


def _kept_variants() -> dict[str, dict]:
    from kvq_lab.quant.transforms.rotatekv import RotateKV

    return {
        "plain": {},
        "sinks": {"sink_tokens": 3},
        "rope_pre": {"rope": "pre", "sink_tokens": 2},
        # per-token keys, no window: the history reaches the rope position buffer's new columns one step after it
        # grew, before any store grows
        "rope_pre_tokens": {"rope": "pre", "sink_tokens": 2, "exact_window": 0, "key_axis": "token"},
        "hadamard": {"key_transform": ("hadamard",), "value_transform": ("hadamard",), "sink_tokens": 2},
        # a foldable key pipeline kvq_sdpa maps (the query folded, the sinks mapped every step), values in the kernel
        "folded": {"key_transform": (RotateKV.example().spelling,), "value_transform": ("hadamard",), "sink_tokens": 2},
    }


def _step_logits(model, cfg: CacheConfig, ids: torch.Tensor, steps: int, mask=None) -> torch.Tensor:
    """Greedy decode, the last position's logits of the prefill and of every step: [B, steps, vocab]. mask: a
    left-padded batch's [B, T] (1 = token), declared to the cache, with position ids counted from each row's first
    token (as `generate` does)."""
    from kvq_lab.models.loading import cache_kwarg

    cache = QuantizedKVCache.for_model(model, cfg)
    kw = {cache_kwarg(): cache, "use_cache": True}
    if mask is not None:
        cache.set_padding(mask)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kw.update(attention_mask=mask, position_ids=pos)
    out = []
    with torch.no_grad():
        logits = model(ids, **kw).logits[:, -1:]
        for _ in range(steps):
            out.append(logits)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                kw.update(attention_mask=mask, position_ids=kw["position_ids"][:, -1:] + 1)
            logits = model(logits.argmax(-1), **kw).logits[:, -1:]
    return torch.cat(out, 1)


KEPT_VARIANTS = ["plain", "sinks", "rope_pre", "rope_pre_tokens", "hadamard", "folded"]
# The variants exercise the kept call's bookkeeping (sinks, rope position buffers, maps), the format the codes it
# decodes: every variant with int, the default; every registered format with `plain` and one other variant in turn
# (each variant with two or three formats), not the full product (84 cases, ~7 min on 2 cores)
KEPT_CASES = sorted(
    {("int", v) for v in KEPT_VARIANTS}
    | {(f, v) for i, f in enumerate(sorted(FORMATS)) for v in ("plain", KEPT_VARIANTS[1 + i % 5])}
)


@pytest.mark.parametrize("fmt, variant", KEPT_CASES)
def test_kept_calls_give_what_built_views_give(tiny, fmt, variant, monkeypatch):  # noqa: F811
    """A layer keeps its kernel call between decode steps (`cpu_kernel.KeptCall`); every step's logits are, bit for
    bit, those of building each step's view (keeping switched off), for every registered format, sinks, rope=pre,
    the hadamard maps in the kernel and a pipeline kvq_sdpa folds; across window flushes, store growth, rope position
    buffer growth and a history that appears after the call was kept (a prompt shorter than the window). And the kept
    calls are what ran: the view is built again only when a store grew (or the call handed a step back)."""
    if "cpu" in FORMATS[fmt].unsupported_backends:  # its refusal is checked by tests/quant/test_format_matrix.py
        pytest.skip(f"format={fmt} refuses the C kernel (unsupported_backends)")
    kw = {"exact_window": 32, **_kept_variants()[variant]}
    bits = default_bits(fmt)
    cfg = CacheConfig(
        key=QuantSpec(bits, 32, kw.pop("key_axis", "channel"), fmt), value=QuantSpec(bits, 32, "token", fmt),
        mode="packed", backend="cpu", **kw,
    )  # fmt: skip
    kept = []
    spy_kept_calls(monkeypatch, lambda call: kept.append(1))
    # rope=pre: past 256 positions, where its position buffer grows; else two window flushes and two store growths
    # (32-token blocks) after either prompt
    steps = 250 if cfg.rope == "pre" else 70
    for prompt in (20, 75):  # 20: no value history yet when the first call is kept
        ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        with_kept = _step_logits(tiny, cfg, ids, steps)  # window flushes and store growth every 32 tokens
        assert len(kept) > 0.75 * steps * tiny.config.num_hidden_layers, len(kept)
        monkeypatch.setattr(backends_mod.CpuBackend, "keep", staticmethod(lambda view, query: None))
        assert torch.equal(with_kept, _step_logits(tiny, cfg, ids, steps))
        monkeypatch.undo()
        spy_kept_calls(monkeypatch, lambda call: kept.append(1))
        kept.clear()


@pytest.mark.parametrize("rope", ["post", "pre"])
@pytest.mark.parametrize("fmt", ["int", "fp8_e4m3"])
def test_kept_calls_in_a_left_padded_batch(tiny, fmt, rope, monkeypatch):  # noqa: F811
    """A left-padded batch keeps its kernel call between decode steps too: each step rewrites the per-row layouts
    (starts and counts) the kept block points at. Every step's logits are, bit for bit, those of building each
    step's view, across window flushes and store growth, and the kept calls are what ran."""
    bits = default_bits(fmt)
    cfg = CacheConfig(
        key=QuantSpec(bits, 32, "channel", fmt), value=QuantSpec(bits, 32, "token", fmt), mode="packed",
        backend="cpu", exact_window=32, sink_tokens=2, rope=rope,
    )  # fmt: skip
    kept = []
    spy_kept_calls(monkeypatch, lambda call: kept.append(call.rows is not None))
    ids, mask = left_padded_prompts([70, 41, 66, 12])
    steps = 75
    with_kept = _step_logits(tiny, cfg, ids, steps, mask)
    assert len(kept) > 0.75 * steps * tiny.config.num_hidden_layers and all(kept), len(kept)
    monkeypatch.setattr(backends_mod.CpuBackend, "keep", staticmethod(lambda view, query: None))
    assert torch.equal(with_kept, _step_logits(tiny, cfg, ids, steps, mask))


@pytest.mark.parametrize("R, key_axis", [(32, "channel"), (32, "token"), (0, "channel"), (0, "token")])
def test_hadamard_steps_write_key_and_value_into_the_window(tiny, R, key_axis, monkeypatch):  # noqa: F811
    """Under one hadamard pipeline, a decode step's transformed key and value are written by the native transform
    straight into the rows of the window buffers they go to (`Stream.slot`): every step's logits are, bit for bit,
    those of transforming into new tensors that the window then copies; and the rows were written in place (where
    both streams keep a window: not with R = 0 and per-token values, which keep none)."""
    from kvq_lab.cache.storage import streams

    cfg = CacheConfig(
        key=QuantSpec(2, 32, key_axis), value=QuantSpec(2, 32, "token"), mode="packed", backend="cpu",
        exact_window=R, sink_tokens=2, key_transform=("hadamard",), value_transform=("hadamard",),
    )  # fmt: skip
    pushes = {"in place": 0, "copied": 0}
    push = streams._Window.push

    def counted(self, x):
        pushes["in place" if x is self.slot() else "copied"] += 1
        return push(self, x)

    monkeypatch.setattr(streams._Window, "push", counted)
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(3))
    steps = 70  # past window flushes and the window buffers' rewinds (every R/16 steps)
    written = _step_logits(tiny, cfg, ids, steps)
    in_place = pushes["in place"]
    assert in_place == steps * 2 * tiny.config.num_hidden_layers if R else in_place == 0, pushes
    monkeypatch.setattr(PackedLayer, "_slots", lambda self, x: None)
    assert torch.equal(written, _step_logits(tiny, cfg, ids, steps))


def test_a_kept_call_hands_back_what_it_cannot_take(tiny):  # noqa: F811
    """A kept call returns None (the layer then builds the view) for a query of another dtype or shape, a history
    where the kept view had none, a mask that differs between query heads, and a padded batch's per-row layouts where
    the kept view had none; and runs for the same query."""
    layer = PackedLayer(
        CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                    exact_window=32, backend="cpu"), None, PaddingState())  # fmt: skip
    g = torch.Generator().manual_seed(2)
    layer.update(torch.randn(1, 2, 20, 64, generator=g), torch.randn(1, 2, 20, 64, generator=g))
    view, q = layer.decode_view(), torch.randn(1, 4, 1, 64, generator=g)
    call = cpu_kernel.KeptCall.make(view, q)
    ks, vs = layer.k_stream.moving(layer.N)[:3], layer.v_stream.moving(layer.N)[:3]  # no padding: no rows
    parts = (layer.N, 0, (*ks, layer.sink_k, None), (*vs, layer.sink_v, None))
    assert torch.equal(call(q, None, 0.125, *parts), cpu_kernel.decode_attention(view, q, None, 0.125))
    assert call(q.double(), None, 0.125, *parts) is None
    assert call(torch.randn(1, 4, 1, 64)[:, :2], None, 0.125, *parts) is None
    assert call(q, torch.zeros(1, 4, 1, layer.N, dtype=torch.bool), 0.125, *parts) is None
    grown = (layer.N, 0, (*ks, layer.sink_k, None), (1, *vs[1:], layer.sink_v, None))  # values' history: none kept
    assert call(q, None, 0.125, *grown) is None
    padded = (layer.N, 0, (*ks, layer.sink_k, ([2], [0])), (*vs, layer.sink_v, ([2], [0])))  # per-row layouts
    assert call(q, None, 0.125, *padded) is None
