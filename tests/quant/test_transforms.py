"""Transforms around the quantizer (`kvq_lab.quant.transforms`), driven by the registry.

Every registered transform (its default spelling) and every row of OPTIONS is checked without a test edit: its round
trip, the fold contract where it declares one, lossless attention through both cache modes at 16 bits, fused decode
== materialized decode, simulated == packed where both quantize the same tokens, and the packed cache reading its
exact tokens back as the model made them. Then hadamard's own arithmetic and direction, the knobs, and runs.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from conftest import spy_kept_calls
from helpers_models import compose, tiny_args
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.cache.routing.rope import RopeHelper
from kvq_lab.kernels import cpu_kernel
from kvq_lab.probes.capture import LayerCapture
from kvq_lab.probes.errors import layer_errors
from kvq_lab.probes.settings import ProbeSettings
from kvq_lab.quant.spec import QuantConfigError, QuantSpec
from kvq_lab.quant.transforms import TRANSFORMS, get_transform
from kvq_lab.quant.transforms.hadamard import fwht
from kvq_lab.run.config import ConfigError, config_hash, validate

OPTIONS = ["hadamard:16", "rhadamard:7"]  # spellings with an option, beside every registered name
# fitted transforms (innerq, rotatekv) by an instance fitted on synthetic keys: their bare spelling has no parameters
SPELLINGS = [TRANSFORMS[n].example().spelling for n in sorted(TRANSFORMS)] + OPTIONS
FOLDABLE = [s for s in SPELLINGS if get_transform(s).foldable]
# (spelling, tensor) for every tensor a transform may wrap
APPLIES = [(s, t) for s in SPELLINGS for t in ("key", "value") if t in get_transform(s).tensors]


def transforms_of(spelling: str, tensor: str) -> dict:
    """CacheConfig keyword arguments putting `spelling` around `tensor`'s quantizer ("both": every tensor it takes)."""
    tensors = get_transform(spelling).tensors if tensor == "both" else (tensor,)
    return {f"{t}_transform": spelling for t in tensors}


def outliers(shape, seed: int) -> torch.Tensor:
    """Random [B, H, T, D] with one huge outlier channel, as LLM keys have."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3
    x[..., 5] *= 20
    return x


@pytest.fixture(scope="module")
def rope(tiny_model):
    return RopeHelper(tiny_model.model.rotary_emb)


def positions(rope, x: torch.Tensor, offsets=(0, 5)):
    """Positions of x's tokens [B, T]; row b starts at offsets[b] (as a left-padded row's ids do)."""
    B, _, T, _ = x.shape
    ids = torch.arange(T)[None] + torch.tensor(offsets[:B])[:, None]
    return rope.positions(x, ids)


# --- the protocol, for every transform ------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_inverse_undoes_forward(spelling, rope):
    t = get_transform(spelling)
    x = outliers((2, 3, 37, 64), 0)
    pos = positions(rope, x)
    y = t.forward(x, pos)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max() > 1e-2 * x.abs().max()  # it does something: the round trip below can fail
    err = (t.inverse(y, pos) - x).abs().max()
    assert err <= 2e-6 * x.abs().max(), err  # fp32 rounding (measured: <= 5e-7 relative)
    xb = x.to(torch.bfloat16)
    assert t.forward(xb, pos).dtype == t.inverse(xb, pos).dtype == torch.bfloat16  # the model's dtype out
    assert get_transform(t.spelling) == t  # the spelling round-trips (records and labels hold it)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_positions_are_required_exactly_where_declared(spelling):
    t = get_transform(spelling)
    x = outliers((1, 2, 8, 64), 1)
    if t.positional:
        with pytest.raises(ValueError, match="rotary") as e:
            t.forward(x)
        assert "\n" not in str(e.value)
    else:
        assert torch.equal(t.forward(x), t.forward(x, None))


@pytest.mark.parametrize("spelling", FOLDABLE)
def test_foldable_transforms_keep_scores_and_fold_the_output(spelling):
    """What `foldable` promises kvq_sdpa, to fp32 precision: fold_query(q)·forward(k) = q·k (for an orthogonal map
    the query map is the keys' map: fold_query(q) == forward(q)); and fold_output(A forward(v)) = A v."""
    t = get_transform(spelling)
    q, k, v = outliers((1, 2, 4, 64), 2), outliers((1, 2, 30, 64), 3), outliers((1, 2, 30, 64), 4)
    if t.name != "innerq":  # innerq's map is diagonal, not orthogonal: its query map is the inverse one
        torch.testing.assert_close(t.fold_query(q), t.forward(q), rtol=1e-5, atol=1e-5 * q.abs().max())
    s = q @ k.transpose(-1, -2)
    folded = t.fold_query(q) @ t.forward(k).transpose(-1, -2)
    torch.testing.assert_close(folded, s, rtol=1e-5, atol=1e-5 * s.abs().max())
    a = torch.softmax(s / 100, -1)
    o = a @ v
    torch.testing.assert_close(t.fold_output(a @ t.forward(v)), o, rtol=1e-5, atol=1e-5 * o.abs().max())
    assert (t.fold_output(a @ v) - o).abs().max() > 1e-2 * o.abs().max()  # the output map does something


# --- through the caches ---------------------------------------------------------------------------------------


def logits_per_step(model, cache, ids, steps=4):
    """Prefill logits, then `steps` greedy decode steps' logits: [steps + 1] tensors."""
    out = []
    with torch.no_grad():
        lg = model(ids, past_key_values=cache).logits[:, -1]
        out.append(lg)
        for _ in range(steps):
            lg = model(lg.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
            out.append(lg)
    return out


@pytest.mark.parametrize("mode", ["simulated", "packed"])
@pytest.mark.parametrize("spelling,tensor", APPLIES)
def test_transform_alone_leaves_attention_unchanged(tiny_model, mode, spelling, tensor):
    """16-bit quantizers with the transform: DynamicCache's logits to fp32 precision; 2 bits with it: not."""
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    ref = logits_per_step(tiny_model, DynamicCache(config=tiny_model.config), ids)
    fp = CacheConfig(QuantSpec(16), QuantSpec(16), mode=mode, backend="torch", **transforms_of(spelling, tensor))
    got = logits_per_step(tiny_model, QuantizedKVCache.for_model(tiny_model, fp), ids)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    spec = QuantSpec(2, 32, "token")
    low = CacheConfig(spec, spec, mode=mode, backend="torch", **transforms_of(spelling, tensor))
    got = logits_per_step(tiny_model, QuantizedKVCache.for_model(tiny_model, low), ids)
    assert (got[-1] - ref[-1]).abs().max() > 1e-2


BACKENDS = ["torch"] + (["cpu"] if cpu_kernel.build_error() is None else [])
TRITON = importlib.util.find_spec("triton") and os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it, no CUDA
# Triton under the interpreter (~15 s a case): each way a pipeline meets the kernel, folded around it (the first and
# the last foldable spelling) or read by it (rope_pre); torch and cpu take every spelling
TRITON_SPELLINGS = sorted({FOLDABLE[0], FOLDABLE[-1], "rope_pre"})
FUSED_CASES = [(s, b) for s in SPELLINGS for b in BACKENDS] + [
    pytest.param(s, "triton", marks=pytest.mark.slow) for s in TRITON_SPELLINGS if TRITON
]


@pytest.mark.parametrize("spelling, backend", FUSED_CASES)
def test_fused_decode_equals_materialized_decode(tiny_model, spelling, backend, monkeypatch):
    """Packed mode: the fused decode path (kvq_sdpa; a foldable transform maps the query and the output around the
    kernel, another comes undone in the view) gives the logits of attention over the materialized cache."""
    calls = []  # fused steps: a view built, or a call kept from an earlier step's view that ran (backend=cpu)
    view = PackedLayer.decode_view
    monkeypatch.setattr(PackedLayer, "decode_view", lambda self: calls.append(1) or view(self))
    spy_kept_calls(monkeypatch, lambda call: calls.append(1))
    kspec, vspec = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    cfg = CacheConfig(kspec, vspec, mode="packed", exact_window=32, sink_tokens=2, backend=backend,
                      **transforms_of(spelling, "both"))  # fmt: skip
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(6))
    fused = QuantizedKVCache.for_model(tiny_model, cfg)  # routes the model through kvq_sdpa
    plain = QuantizedKVCache(cfg, tiny_model.config.num_hidden_layers, tiny_model.model.rotary_emb)  # not routed
    steps = 2 if backend == "triton" else 6  # the interpreter runs a launch in seconds: two steps reach the kernel
    a = logits_per_step(tiny_model, fused, ids, steps=steps)
    assert len(calls) == steps * tiny_model.config.num_hidden_layers  # every decode step of every layer went fused
    b = logits_per_step(tiny_model, plain, ids, steps=steps)
    assert len(calls) == steps * tiny_model.config.num_hidden_layers
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("S", [0, 2])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_packed_agrees_with_simulated(spelling, S, rope):
    """Where both modes quantize the same tokens with the same groups (R = 0: per-token values on arrival,
    per-channel keys once a group is whole) they hold the same values, bit for bit, transforms undone alike."""
    G = 32
    kspec, vspec = QuantSpec(2, G, "channel"), QuantSpec(2, G, "token")
    kw = dict(sink_tokens=S, **transforms_of(spelling, "both"))
    sim = SimulatedLayer(CacheConfig(kspec, vspec, mode="simulated", **kw), rope, PaddingState())
    pk = PackedLayer(CacheConfig(kspec, vspec, mode="packed", backend="torch", **kw), rope, PaddingState())
    k, v = outliers((1, 2, 130, 64), 7), outliers((1, 2, 130, 64), 8)
    L = 64 + S
    sim.update(k[:, :, :L], v[:, :, :L])
    pk.update(k[:, :, :L], v[:, :, :L])
    for N in range(L, 130):
        ks, vs = sim.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        pk.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        K, V = pk.materialize()
        whole = S + (N + 1 - S) // G * G
        assert torch.equal(K[:, :, :whole], ks[:, :, :whole]), N
        assert torch.equal(V, vs), N
        exact = k[:, :, whole : N + 1]  # packed keeps the partial group exact: k to the transform's round trip
        torch.testing.assert_close(K[:, :, whole:], exact, rtol=0, atol=2e-6 * k.abs().max())


@pytest.mark.parametrize("kax", ["channel", "token"])
@pytest.mark.parametrize("spelling,tensor", APPLIES)
def test_packed_reads_back_what_the_model_made(spelling, tensor, kax, rope):
    """Sinks exactly, the full-precision window to fp32 rounding, the history within the quantizer's error, for every
    position of a packed cache whose quantizer is wrapped in the transform (rope_pre once returned its window
    un-rotated: this is the test that would have caught it)."""
    spec = QuantSpec(8, 32, kax)
    cfg = CacheConfig(spec, spec, mode="packed", exact_window=32, sink_tokens=2, backend="torch",
                      **transforms_of(spelling, tensor))  # fmt: skip
    layer = PackedLayer(cfg, rope, PaddingState())
    k, v = outliers((1, 2, 120, 64), 9), outliers((1, 2, 120, 64), 10)
    layer.update(k[:, :, :75], v[:, :, :75])
    for N in range(75, 120):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    x = (k if tensor == "key" else v)[:, :, :120]
    got = layer.materialize()[0 if tensor == "key" else 1]
    stream = layer.k_stream if tensor == "key" else layer.v_stream
    q = stream.n_quantized(120)
    assert torch.equal(got[:, :, :2], x[:, :, :2])  # sinks
    torch.testing.assert_close(got[:, :, 2 + q :], x[:, :, 2 + q :], rtol=0, atol=1e-5 * x.abs().max())  # window
    hist = (got[:, :, 2 : 2 + q] - x[:, :, 2 : 2 + q]).abs()
    assert 0 < hist.max() < 0.02 * x.abs().max()  # 8-bit codes: quantized, and close


# --- hadamard -------------------------------------------------------------------------------------------------


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("block", [None, 2, 16, 64])
def test_hadamard_is_the_sylvester_rotation(block):
    x = outliers((2, 3, 11, 64), 11)
    n = block or 64
    ref = (x.view(2, 3, 11, 64 // n, n) @ sylvester(n)).view(2, 3, 11, 64) / math.sqrt(n)
    t = get_transform("hadamard" if block is None else f"hadamard:{block}")
    torch.testing.assert_close(t.forward(x), ref, rtol=1e-5, atol=1e-5 * x.abs().max())
    assert torch.equal(fwht(x, n), fwht(x.flip(0), n).flip(0))  # butterflies only: no dependence on neighbours


def test_hadamard_bits_do_not_depend_on_the_batch():
    """Each token's rotation comes out bit for bit the same whatever else is in the tensor: this is why simulated
    mode (whole history), packed mode (a token at a time) and the probes (one head at a time) agree exactly."""
    t = get_transform("hadamard")
    x = outliers((3, 2, 50, 64), 12)
    y = t.forward(x)
    assert torch.equal(t.forward(x[1:2]), y[1:2])
    assert torch.equal(t.forward(x[:, :, 17:18]), y[:, :, 17:18])
    assert torch.equal(t.forward(x[:, 1:, 3:40].contiguous()), y[:, 1:, 3:40])


def test_hadamard_lowers_per_token_key_error_on_outlier_channels():
    """Direction (QuaRot's reason): keys with two huge outlier channels put every per-token group's range on them;
    a rotation spreads them over all channels, so per-token 2-bit keys reconstruct better, and the attention scores
    and outputs as the probes measure them (`kvq_lab.probes`) err less. Per-channel groups already isolate the
    outlier channels: the rotation gains them next to nothing. Measured here (rel_fro, mean over heads): per-token
    key 0.533 -> 0.299, attn_score 0.784 -> 0.577, attn_out_k 0.776 -> 0.587; per-channel key 0.404 -> 0.398."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, T, D = 4, 2, 96, 64
    k = torch.randn(Hkv, T, D, generator=g)
    k[:, :, [3, 17]] *= 20
    cap = LayerCapture(0, torch.randn(H, T, D, generator=g), k, torch.randn(Hkv, T, D, generator=g),
                       torch.zeros(H, T, D), D**-0.5, H // Hkv)  # fmt: skip
    v = QuantSpec(2, 32, "token")

    def errors(axis, transform):
        return layer_errors(cap, CacheConfig(QuantSpec(2, 32, axis), v, key_transform=transform), ProbeSettings())

    base, had = errors("token", "none"), errors("token", "hadamard")
    for q, ratio in (("key", 0.7), ("attn_score", 0.85), ("attn_out_k", 0.85)):
        assert had[q]["rel_fro"].mean() < ratio * base[q]["rel_fro"].mean(), q
        assert had[q]["sqnr_db"].mean() > base[q]["sqnr_db"].mean() + 2, q
    assert torch.equal(had["value"]["rel_fro"], base["value"]["rel_fro"])  # values untouched
    gain_t = base["key"]["rel_fro"].mean() - had["key"]["rel_fro"].mean()
    gain_c = errors("channel", "none")["key"]["rel_fro"].mean() - errors("channel", "hadamard")["key"]["rel_fro"].mean()
    assert gain_c < 0.2 * gain_t


# --- knobs ----------------------------------------------------------------------------------------------------


def test_labels_of_existing_configs_are_unchanged_and_new_transforms_show():
    assert CacheConfig().label() == "K2b-C32_V2b-T32_sim"
    assert CacheConfig(rope="pre", mode="packed").label() == "K2b-C32_V2b-T32_pac_R0_preRoPE"
    assert CacheConfig(rope="pre") == CacheConfig(key_transform="rope_pre") == CacheConfig(key_transform=["rope_pre"])
    both = CacheConfig(rope="pre", key_transform="hadamard", value_transform="hadamard:16")
    assert both.key_transform == ("rope_pre", "hadamard") and both.label().endswith("_preRoPE_Khad_Vhad16")
    assert CacheConfig(key_transform="none").label() == CacheConfig().label()


def test_rope_pre_is_rope_pre_however_spelled(data_dir):
    a = compose(["rope=pre", f"data_dir={data_dir}"])
    b = compose(["key_transform=rope_pre", f"data_dir={data_dir}"])
    assert validate(a).cache == validate(b).cache and config_hash(a) == config_hash(b)
    assert validate(compose(["transform=hadamard", f"data_dir={data_dir}"])).cache.value_transform == ("hadamard",)


BAD = [
    (["transform=rope_pre"], r"transform=rope_pre: rope_pre transforms keys only.*key_transform=rope_pre"),
    (["value_transform=rope_pre"], r"value_transform=rope_pre: rope_pre transforms keys only"),
    (["key_transform=[hadamard,rope_pre]"], r"rope_pre must come first.*\[rope_pre,hadamard\]"),
    (["key_transform=rotate"], r"key_transform='rotate' is not a registered transform; allowed: none, hadamard"),
    (["key_transform=[hadamard,hadamard:16]"], r"key_transform lists hadamard twice"),
    (["key_transform=hadamard:48"], r"key_transform=hadamard:48 has a block that is not a power of two"),
    (["key_transform=hadamard", "model.head_dim=96"], r"key_transform=hadamard: .*power-of-two head dim.*hadamard:32"),
    (["value_transform=hadamard:64", "model.head_dim=96"], r"block 64 does not divide head_dim=96.*hadamard:32"),
    (["transform=hadamard", "key_transform=none"], r"transform=hadamard and key_transform=none disagree"),
    (["key_transform=3"], r"key_transform=3: give transform names"),
    (["key_transform=rope_pre:2"], r"rope_pre:2 gives an argument, but rope_pre takes none"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_transform_settings_fail_in_one_line_before_load(overrides, message, data_dir):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose([*overrides, f"data_dir={data_dir}"]))
    assert "\n" not in str(e.value)


# --- runs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [["mode=packed", "exact_window=32", "backend=torch"], ["mode=simulated", "probe=true"]],
    ids=["packed", "simulated+probe"],
)
@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_key_transform_hadamard_runs(tiny_model_dir, data_dir, tmp_path, extra):
    from kvq_lab.run.runner import run

    probes = ["probes.n_prompts=1", "probes.max_tokens=32", "probes.figures=false"]
    m = run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir) + ["key_transform=hadamard", *extra, *probes]))
    assert math.isfinite(m["ppl/ppl"])
    if "probe=true" in extra:
        assert m["probe/key/rel_fro/mean"] > 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "_Khad" in run_dir.name


def test_rope_helper_reuses_cos_sin_only_for_equal_ids(tiny_model):
    """Every layer of a forward asks for the same ids: one rotary call serves them all, with the module's own values;
    other ids (or a RoPE type that rescales with the length) call the module again."""
    helper = RopeHelper(tiny_model.model.rotary_emb)
    like = torch.zeros(1)
    calls = []
    real = helper.rotary_emb
    helper.rotary_emb = lambda x, ids: calls.append(ids.clone()) or real(x, ids)
    ids = torch.tensor([[7], [3]])
    cos, sin = helper.cos_sin(like, ids)
    again = helper.cos_sin(like, ids.clone())  # equal values, another tensor (each layer expands its own)
    assert len(calls) == 1 and again[0] is cos and again[1] is sin
    ref_cos, ref_sin = real(like, ids)
    assert torch.equal(cos, ref_cos.float().unsqueeze(1)) and torch.equal(sin, ref_sin.float().unsqueeze(1))
    other = helper.cos_sin(like, torch.tensor([[8], [4]]))
    assert len(calls) == 2 and not torch.equal(other[0], cos)
    assert torch.equal(helper.cos_sin(like, ids.int())[0], cos) and len(calls) == 3  # another dtype: called again
    helper.rotary_emb = type("Dyn", (), {"rope_type": "dynamic", "__call__": lambda self, x, i: real(x, i)})()
    helper._last = None
    helper.cos_sin(like, ids)
    assert helper._last is None  # never kept for a length-dependent RoPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_rotations_are_the_attention_formula_bit_for_bit(dtype):
    """rotate / unrotate take rotate_half(k) * sin as roll(k) * (sin, first half negated), with cos^2 + sin^2 and the
    signed sin kept for the latest cos/sin (the layers of a step share them): the same bits as the formula, on the
    first call and on a reused one, and fresh values for new cos/sin."""
    from kvq_lab.quant.transforms import rope_pre as rp

    g = torch.Generator().manual_seed(3)
    k = (torch.randn(2, 3, 7, 64, generator=g) * 5).to(dtype)
    k[0, 0, 0, :4] = 0.0  # signed zeros go through the negation too
    for scale in (1.0, 1.3):  # attention scaling folded into cos/sin (some RoPE variants)
        ang = torch.randn(2, 1, 7, 32, generator=g) * 100
        cos, sin = (torch.cat([f(ang), f(ang)], -1) * scale for f in (torch.cos, torch.sin))
        kf = k.float()
        want_r = (kf * cos + rp.rotate_half(kf) * sin).to(dtype)
        want_u = ((kf * cos - rp.rotate_half(kf) * sin) / (cos * cos + sin * sin)).to(dtype)
        for _ in range(2):  # computed, then reused
            assert torch.equal(rp.rotate(k, cos, sin), want_r)
            assert torch.equal(rp.unrotate(k, cos, sin), want_u)


def test_step_position_ids_are_computed_once_per_forward(tiny_model):
    """The layers of one forward pass the same position_ids tensor: one int32 conversion and max for all of them,
    recomputed for another tensor, an in-place change, another start, or an inference tensor whose values changed."""
    from kvq_lab.cache.routing.rope import step_position_ids

    helper = RopeHelper(tiny_model.model.rotary_emb)
    pos = torch.tensor([[5], [9]])
    ids, top = step_position_ids(helper, {"position_ids": pos}, 2, 10, 1, pos.device)
    assert ids.dtype == torch.int32 and ids.tolist() == [[5], [9]] and top == 9
    again = step_position_ids(helper, {"position_ids": pos}, 2, 10, 1, pos.device)
    assert again[0] is ids  # every layer gets the same tensor (and RopeHelper.cos_sin reuses its cos/sin)
    pos += 1  # in place: a new version
    assert step_position_ids(helper, {"position_ids": pos}, 2, 10, 1, pos.device)[1] == 10
    other = torch.tensor([[6], [10]])
    assert step_position_ids(helper, {"position_ids": other}, 2, 10, 1, pos.device)[0] is not ids
    ranged, top = step_position_ids(helper, {}, 1, 4, 3, pos.device)  # no position_ids: the cache's range
    assert ranged.tolist() == [[4, 5, 6]] and top == 6
    assert step_position_ids(helper, {}, 1, 7, 3, pos.device)[1] == 9  # another start
    with torch.inference_mode():
        inf = torch.tensor([[3]])
        first = step_position_ids(helper, {"position_ids": inf}, 1, 3, 1, inf.device)[0]
        assert step_position_ids(helper, {"position_ids": inf}, 1, 3, 1, inf.device)[0] is first
        inf += 4  # no version counter: the values are compared
        assert step_position_ids(helper, {"position_ids": inf}, 1, 3, 1, inf.device)[1] == 7


# --- rhadamard -------------------------------------------------------------------------------------------------
def test_rhadamard_is_random_signs_then_the_sylvester_rotation():
    from kvq_lab.quant.transforms.hadamard import matrix
    from kvq_lab.quant.transforms.rhadamard import signs

    x = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(0))
    for seed in (0, 3):
        t = get_transform("rhadamard" if seed == 0 else f"rhadamard:{seed}")
        s = signs(seed, 64, "cpu")
        assert set(s.tolist()) == {-1.0, 1.0}
        torch.testing.assert_close(t.forward(x), (x * s) @ matrix(64))  # matrix: H / sqrt(n)
        torch.testing.assert_close(t.inverse(t.forward(x)), x)
    assert not torch.equal(signs(0, 64, "cpu"), signs(3, 64, "cpu"))


def test_rhadamard_flattens_a_coordinate_distribution_that_hadamard_keeps():
    """A vector aligned with a Hadamard row stays a spike under `hadamard` (all its energy in one coordinate) but
    spreads under random signs: the point of the randomization."""
    from kvq_lab.quant.transforms.hadamard import matrix

    row = matrix(64)[5].reshape(1, 1, 1, 64)
    had, rhad = get_transform("hadamard").forward(row), get_transform("rhadamard").forward(row)
    assert had.abs().max() == pytest.approx(1.0)  # |row| = 1, all in one coordinate
    assert rhad.abs().max() < 0.5


def test_rhadamard_seed_is_checked():
    with pytest.raises(QuantConfigError, match=r"rhadamard:x needs a seed"):
        get_transform("rhadamard:x")


def test_interleave_is_llama_cpps_key_layout():
    """interleave(k) is the key that llama.cpp's GGUF converter's permuted W_k makes (convert_hf_to_gguf.py's
    `permute`: per head, rows reshaped (2, D/2), swapped to (D/2, 2)), and what a block of 32 then groups is whole
    RoPE pairs: channel 2i and 2i + 1 are the pair (i, i + D/2) of transformers' rotate_half."""
    from kvq_lab.quant.transforms import get_transform

    H, D, hidden = 3, 64, 48
    w = torch.randn(H * D, hidden)  # W_k in transformers' layout
    gguf = w.reshape(H, 2, D // 2, hidden).swapaxes(1, 2).reshape(H * D, hidden)  # llama.cpp's rows
    x = torch.randn(5, hidden)
    k_hf = (x @ w.T).reshape(5, H, D).transpose(0, 1)[None]  # [1, H, T, D]
    k_gguf = (x @ gguf.T).reshape(5, H, D).transpose(0, 1)[None]
    t = get_transform("interleave")
    assert torch.equal(t.forward(k_hf), k_gguf) and torch.equal(t.inverse(k_gguf), k_hf)
    i = torch.arange(D // 2)
    assert torch.equal(t.forward(torch.arange(float(D)))[2 * i], i.float())
    assert torch.equal(t.forward(torch.arange(float(D)))[2 * i + 1], (i + D // 2).float())
