"""Fitted and outlier methods on plain tensors: nuq codebooks (KVQuant), dense-and-sparse outliers (KVQuant), innerq
(InnerQ) and rotatekv (RotateKV). For each: a reference on a hand-computed case, a direction test on synthetic data with
outlier channels measured where the tensors are consumed (`kvq_lab.probes.errors.layer_errors`: attention scores for
keys, attention output for values), each paired with a case that must differ; and the byte accounting.

Fitted methods are fitted with `kvq_lab.fit.calibration.fit` on synthetic "captures" drawn independently of the data the
errors are measured on (never the evaluated tensors), as calibration fits them on other text.
"""

from __future__ import annotations

import pytest
import torch

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.accounting import tensor_bits
from kvq_lab.fit.calibration import fit
from kvq_lab.probes.capture import LayerCapture
from kvq_lab.probes.errors import layer_errors
from kvq_lab.probes.settings import ProbeSettings
from kvq_lab.quant.formats import get_format
from kvq_lab.quant.formats.lut import normal_float_codebook
from kvq_lab.quant.formats.nuq import fit_codebook
from kvq_lab.quant.outliers import Outliers, fake_quant, fit_thresholds
from kvq_lab.quant.rounding import fp16_round_down, fp16_round_up
from kvq_lab.quant.spec import QuantConfigError, QuantSpec
from kvq_lab.quant.transforms import get_transform
from kvq_lab.quant.transforms.hadamard import matrix
from kvq_lab.quant.transforms.innerq import InnerQ
from kvq_lab.quant.transforms.rotatekv import RotateKV, deal

H, HKV, T, D = 4, 2, 128, 64


def keys(seed: int, outlier_channels=(3, 17), gain=20.0, spikes: float = 0.0) -> torch.Tensor:
    """[1, HKV, T, D] keys with large outlier channels (as LLM keys have), optionally sparse huge spikes."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HKV, T, D, generator=g)
    k[..., list(outlier_channels)] *= gain
    if spikes:
        hit = torch.rand(k.shape, generator=g) < spikes
        k = torch.where(hit, k.sign() * 60.0, k)
    return k


def capture_of(k: torch.Tensor, v: torch.Tensor, seed: int = 0) -> dict:
    """A synthetic calibration capture of one layer (no RoPE: keys as they are; unit gradients)."""
    return {"key_pre": k, "value": v, "g_key_pre": torch.ones_like(k), "g_value": torch.ones_like(v),
            "positions": torch.arange(k.shape[2])[None]}  # fmt: skip


def errors(cache: CacheConfig, k: torch.Tensor, v: torch.Tensor, seed: int = 1) -> dict:
    """Probe errors of one layer: queries random, keys/values given [1, HKV, T, D]."""
    q = torch.randn(H, T, D, generator=torch.Generator().manual_seed(seed))
    cap = LayerCapture(0, q, k[0], v[0], torch.zeros(H, T, D), D**-0.5, H // HKV)
    return layer_errors(cap, cache, ProbeSettings())


def rel(e: dict, quantity: str) -> float:
    return float(e[quantity]["rel_fro"].mean())


def fitted(cache: CacheConfig, k_cal: torch.Tensor, v_cal: torch.Tensor) -> CacheConfig:
    return fit(cache, [capture_of(k_cal, v_cal)], rope=None)


# --- nuq ---------------------------------------------------------------------------------------------------------


def test_fit_codebook_hand_case():
    """u = [0.12, 0.2, 0.6, 0.7], weights [1, 3, 1, 1], 2 bits: the fixed levels 0 and 1 and two fitted ones.
    Lloyd from the weighted quantiles converges to {0.12, 0.2} -> (0.12 + 3 * 0.2) / 4 = 0.18 and {0.6, 0.7} -> 0.65.
    Without the weights the first level is the plain mean 0.16: the weights decide."""
    u = torch.tensor([0.12, 0.2, 0.6, 0.7])
    got = fit_codebook(u, torch.tensor([1.0, 3.0, 1.0, 1.0]), 2)
    assert got == pytest.approx((0.0, 0.18, 0.65, 1.0), abs=1e-6)
    assert fit_codebook(u, None, 2) == pytest.approx((0.0, 0.16, 0.65, 1.0), abs=1e-6)
    assert fit_codebook(u, None, 1) == (0.0, 1.0)  # 1 bit: the group's min and max, nothing to fit


def test_fit_codebook_gives_a_valid_lut_codebook():
    u = torch.zeros(100)  # every value at one point: levels must still be distinct and inside (0, 1)
    cb = fit_codebook(u, None, 4)
    assert len(cb) == 16 and cb[0] == 0 and cb[-1] == 1
    assert all(b > a for a, b in zip(cb, cb[1:], strict=False))
    get_format("lut", 4, codebook=cb)  # accepted as a lut codebook


def test_nuq_is_lut_at_1_to_4_bits():
    """Unfitted nuq is lut's NormalFloat; widths beyond 4 and 16 bits are refused (the config test covers 16)."""
    f = get_format("nuq", 3)
    cb = torch.tensor(normal_float_codebook(3))
    torch.testing.assert_close(f.table(), ((cb - cb[0]) / (cb[-1] - cb[0])).float())
    assert f.params == ("scale", "zero") and f.table_bytes == 32
    with pytest.raises(QuantConfigError, match="format=nuq takes 1, 2, 3, 4 bits; bits=8 conflicts") as e:
        get_format("nuq", 8)
    assert "\n" not in str(e.value)


def laplace(seed: int, outlier_channels=(3, 17), gain=20.0) -> torch.Tensor:
    """[1, HKV, T, D] heavy-tailed (Laplace) data with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(1, HKV, T, D, generator=g).log() * torch.sign(torch.rand(1, HKV, T, D, generator=g) - 0.5)
    x[..., list(outlier_channels)] *= gain
    return x


def test_nuq_lowers_the_value_output_error_and_the_key_reconstruction_error():
    """Direction, heavy-tailed data, 2 bits, codebooks fitted on other draws (unit sensitivity: no model here):
    normalized groups bunch in the middle of their range, where the fitted codebook puts its levels. Measured (rel_fro,
    int2 -> nuq2): values 0.465 -> 0.436, attn_out_v 0.457 -> 0.428; keys 0.479 -> 0.467. What it does NOT do here:
    key attention scores (0.586 -> 0.576 at 2 bits, 0.274 -> 0.308 at 3 bits, worse on Gaussian keys): the fit
    minimizes squared error, pulling levels to the middle, while softmax is decided by the largest keys, near their
    groups' extremes. KVQuant's Fisher weights are what is meant to put that sensitivity in; on the real model
    calibration uses them (experiments/methods)."""
    k, v = laplace(1), laplace(2, gain=1.0)
    k_cal, v_cal = laplace(11), laplace(12, gain=1.0)
    int2 = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"))
    f = fitted(CacheConfig(QuantSpec(2, 32, "channel", "nuq"), QuantSpec(2, 32, "token", "nuq")), k_cal, v_cal)
    for tensor in ("key", "value"):
        assert getattr(f.layers[0], tensor).format == "lut"  # stored and executed as lut
        assert getattr(f.layers[0], tensor).codebook != tuple(normal_float_codebook(2))
    e, b = errors(f, k, v), errors(int2, k, v)
    assert rel(e, "attn_out_v") < 0.95 * rel(b, "attn_out_v")
    assert rel(e, "value") < 0.95 * rel(b, "value")
    assert rel(e, "key") < 0.99 * rel(b, "key")
    only_v = fitted(CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token", "nuq")), k_cal, v_cal)
    assert rel(errors(only_v, k, v), "attn_score") == rel(b, "attn_score")  # keys untouched


# --- outliers ----------------------------------------------------------------------------------------------------


def test_outliers_hand_case():
    """One token [0, 1, 2, 100] in one group of 4, 2-bit int, one outlier per token (round(0.25 * 4) = 1): 100 stays
    exact and out of min/max, so the group [0, 1, 2] gets zero 0, scale fp16_up(2 / 3) and codes 0, 1, 3."""
    x = torch.tensor([0.0, 1.0, 2.0, 100.0]).view(1, 1, 1, 4)
    spec = QuantSpec(2, 4, "token")
    out = Outliers(0.25, "token")
    assert out.mask(x).view(-1).tolist() == [False, False, False, True]
    s = float(fp16_round_up(torch.tensor(2.0 / 3)))
    z = float(fp16_round_down(torch.tensor(0.0)))
    want = torch.tensor([z, 1 * s + z, 3 * s + z, 100.0])
    assert torch.equal(fake_quant(x, spec, out).view(-1), want)
    plain = fake_quant(x, spec, None).view(-1)  # without: the step is 100 / 3, and 1 and 2 collapse to 0
    assert plain[1] == plain[2] == 0 and plain[3] != 100.0 or plain[3] == pytest.approx(100.0, abs=0.02)


def test_outlier_masks_and_thresholds():
    x = torch.arange(1.0, 101.0).view(1, 1, 100, 1)  # one channel, values 1..100
    (t,) = fit_thresholds(x, 0.01)
    assert t == pytest.approx(99.01)  # the 0.99 quantile, linear interpolation between 99 and 100
    assert Outliers(0.01, "channel", (t,)).mask(x).sum() == 1  # only 100 is above
    two_heads = torch.cat([x, -x], 1)  # thresholds fitted for one head apply to every head
    assert Outliers(0.01, "channel", (t,)).mask(two_heads).sum() == 2
    tie = torch.ones(1, 1, 1, 8)  # ties go to the lower channel: the mask depends on the token alone
    assert Outliers(0.2, "token").mask(tie).view(-1).tolist() == [True, True] + [False] * 6
    with pytest.raises(QuantConfigError, match="key_outliers needs per-channel thresholds"):
        Outliers(0.01, "channel").mask(x)


def test_key_outliers_lower_the_attention_score_error():
    """Direction: keys with sparse huge spikes (1%) spread every per-channel group's range; 1% kept exact (thresholds
    fitted on other data) gives the others back their step. Measured attn_score rel_fro 0.509 -> 0.340 (int2 K-C)."""
    k, v = keys(3, spikes=0.01), keys(4, gain=1.0)
    k_cal = keys(13, spikes=0.01)
    base = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"))
    out = fitted(CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), key_outliers=0.01), k_cal, k_cal)
    assert len(out.layers[0].key_outlier_thresholds) == HKV * D
    assert rel(errors(out, k, v), "attn_score") < 0.75 * rel(errors(base, k, v), "attn_score")
    assert rel(errors(out, k, v), "attn_out_v") == rel(errors(base, k, v), "attn_out_v")


def test_value_outliers_lower_the_attention_output_error():
    """Direction: values with one huge channel per token stretch each per-token group; keeping the top |v| of each
    token exact (round(0.01 * 64) = 1 per token) removes it. Measured attn_out_v rel_fro 0.328 -> 0.083."""
    k, v = keys(5), keys(6, outlier_channels=(9,), gain=30.0)
    base = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"))
    out = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), value_outliers=0.01)
    assert rel(errors(out, k, v), "attn_out_v") < 0.5 * rel(errors(base, k, v), "attn_out_v")
    assert rel(errors(out, k, v), "attn_score") == rel(errors(base, k, v), "attn_score")


# --- innerq ------------------------------------------------------------------------------------------------------


def test_innerq_hand_case_and_exact_scores():
    """Channel absmax [3, 0.3, 0, 1] -> s = 2^round(log2) = [4, 0.25, 1 (a zero channel), 1]; keys / s, query * s,
    and q·k unchanged bit for bit (power-of-two scales are exact)."""
    x = torch.tensor([[3.0, -0.3, 0.0, 1.0], [-1.0, 0.1, 0.0, 0.5]]).view(1, 1, 2, 4)
    t = InnerQ().fit(x)
    assert t.scale.view(-1).tolist() == [4.0, 0.25, 1.0, 1.0]
    assert get_transform(t.spelling) is t and t.spelling.startswith("innerq@")
    q = torch.randn(1, 2, 3, 4)  # two query heads on one kv head (GQA)
    assert torch.equal(t.fold_query(q)[..., None, :] * t.forward(x), q[..., None, :] * x)
    assert torch.equal(t.inverse(t.forward(x)), x)
    with pytest.raises(QuantConfigError, match="innerq has no fitted scales"):
        get_transform("innerq").forward(x)


def test_innerq_lowers_per_token_key_error():
    """Direction: per-token key groups take their range from the outlier channels; innerq gives every channel the same
    range first. Measured attn_score rel_fro 0.869 -> 0.761 (K-T); per-channel keys (K-C) gain nothing (0.448 both:
    a channel's group only scales)."""
    k, v = keys(7), keys(8, gain=1.0)
    k_cal = keys(17)

    def pair(axis):
        base = CacheConfig(QuantSpec(2, 32, axis), QuantSpec(2, 32, "token"))
        iq = fitted(CacheConfig(QuantSpec(2, 32, axis), QuantSpec(2, 32, "token"), key_transform="innerq"), k_cal, v)
        return rel(errors(base, k, v), "attn_score"), rel(errors(iq, k, v), "attn_score")

    b, g = pair("token")
    assert g < 0.9 * b, (g, b)
    b, g = pair("channel")
    assert abs(g - b) < 0.05 * b


def test_innerq_partial_scale_hand_case_and_spelling():
    """alpha = 0.5: channel absmax [4, 0.25, 0, 1] -> s = 2^round(0.5 * log2) = [2, 0.5, 1 (a zero channel), 1]
    (alpha = 1 would give [4, 0.25, 1, 1]); the spelling carries alpha and round-trips; alpha outside (0, 1] fails in
    one line."""
    x = torch.tensor([[4.0, -0.25, 0.0, 1.0], [-1.0, 0.1, 0.0, 0.5]]).view(1, 1, 2, 4)
    half = get_transform("innerq:0.5").fit(x)
    assert half.scale.view(-1).tolist() == [2.0, 0.5, 1.0, 1.0]
    assert InnerQ().fit(x).scale.view(-1).tolist() == [4.0, 0.25, 1.0, 1.0]
    assert half.spelling.startswith("innerq:0.5@") and get_transform(half.spelling) is half
    assert half.label == "innerq0.5" and get_transform("innerq:1").spelling == "innerq"
    assert torch.equal(half.inverse(half.forward(x)), x)
    for bad in ("0", "1.5", "x", "nan"):
        with pytest.raises(QuantConfigError, match=rf"^innerq:{bad} needs a migration strength alpha in \(0, 1\]"):
            get_transform(f"innerq:{bad}")


def test_innerq_partial_scale_wins_when_queries_share_the_key_outliers():
    """Direction, and why full normalization can hurt: a channel's score error is its query times its key error, and
    full normalization multiplies the big channels' key error by their scale s. With queries that are large on the
    keys' outlier channels (as LLM queries are), full normalization (alpha = 1) doubles the attention-score error of
    plain per-token keys, while with isotropic queries it lowers it: the order of the two flips. alpha = 0.5 errs
    least in both. Measured (2-bit K-T, rel_fro of scores; none / alpha 1 / alpha 0.5): aligned queries (x20 on the
    outlier channels) 0.434 / 1.014 / 0.295; isotropic 0.869 / 0.761 / 0.402."""
    k, v, k_cal = keys(7), keys(8, gain=1.0), keys(17)
    spec = (QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token"))
    base = CacheConfig(*spec)
    full = fitted(CacheConfig(*spec, key_transform="innerq"), k_cal, v)
    half = fitted(CacheConfig(*spec, key_transform="innerq:0.5"), k_cal, v)

    def score_err(cache, q_gain):
        q = torch.randn(H, T, D, generator=torch.Generator().manual_seed(1))
        q[..., [3, 17]] *= q_gain  # the keys' outlier channels (`keys`)
        cap = LayerCapture(0, q, k[0], v[0], torch.zeros(H, T, D), D**-0.5, H // HKV)
        return rel(layer_errors(cap, cache, ProbeSettings()), "attn_score")

    b, f, h = (score_err(c, 20.0) for c in (base, full, half))
    assert f > 2 * b and h < 0.8 * b, (b, f, h)
    b, f, h = (score_err(c, 1.0) for c in (base, full, half))
    assert f < 0.95 * b and h < 0.6 * f, (b, f, h)


# --- rotatekv ----------------------------------------------------------------------------------------------------


def test_deal_and_rotation_hand_case():
    """Channels ranked [3, 2, 1, 0] dealt to 2 blocks: ranks 0, 2 (channels 3, 1) to block 0, ranks 1, 3 (channels 2,
    0) to block 1 -> perm [3, 1, 2, 0]; the rotation is x[..., perm] times the block-diagonal H_2 / sqrt(2)."""
    assert deal(torch.tensor([[3, 2, 1, 0]]), 2).tolist() == [[3, 1, 2, 0]]
    x = torch.randn(1, 1, 5, 4)
    x[..., 3] *= 10
    t = RotateKV(2).fit(x)  # channel 3 is the largest: rank 0
    assert t.perm[0, 0] == 3
    p = t.perm[0]
    ref = torch.block_diag(matrix(2), matrix(2))
    torch.testing.assert_close(t.forward(x), x[..., p] @ ref)
    torch.testing.assert_close(t.inverse(t.forward(x)), x)


def test_rotatekv_beats_a_shared_rotation_when_outliers_share_a_block():
    """Direction: four outlier channels side by side (0-3) land in one 16-channel Hadamard block of the shared
    rotation, whose outputs then dominate their per-token group; rotatekv deals them to four blocks. Measured
    (2-bit K-T, blocks of 16) key rel_fro 0.312 -> 0.204, attn_score 0.631 -> 0.425; with one outlier channel
    0.497 vs 0.494."""
    k, v = keys(9, outlier_channels=(0, 1, 2, 3)), keys(10, gain=1.0)
    k_cal = keys(19, outlier_channels=(0, 1, 2, 3))
    shared = CacheConfig(QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token"), key_transform="hadamard:16")
    rkv = fitted(
        CacheConfig(QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token"), key_transform="rotatekv:16"), k_cal, v
    )
    assert rel(errors(rkv, k, v), "attn_score") < 0.8 * rel(errors(shared, k, v), "attn_score")
    # with one outlier channel there is nothing to balance: the two rotations err alike
    k1, c1 = keys(9, outlier_channels=(0,)), keys(19, outlier_channels=(0,))
    rkv1 = fitted(CacheConfig(QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token"), key_transform="rotatekv:16"), c1, v)
    a, b = rel(errors(rkv1, k1, v), "attn_score"), rel(errors(shared, k1, v), "attn_score")
    assert abs(a - b) < 0.05 * b


# --- accounting --------------------------------------------------------------------------------------------------


def test_bits_count_everything_stored():
    """int2 G32 K-C: 2 + 32/32 = 3 bits; 1% key outliers add 0.01 * 48; a fitted 3-bit codebook adds 32 bytes per
    layer; sinks and the packed window count 16 bits per element over N tokens."""
    base = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"))
    assert tensor_bits(base, "key", 1024, 2, 64) == 3.0
    out = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), key_outliers=0.01)
    assert tensor_bits(out, "key", 1024, 2, 64) == pytest.approx(3.0 + 0.48)
    vout = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), value_outliers=0.01)
    assert tensor_bits(vout, "value", 1024, 2, 64) == pytest.approx(3.0 + 48 / 64)  # one value per token of 64
    nuq = CacheConfig(QuantSpec(3, 32, "channel", "lut", tuple(i / 7 for i in range(8))), QuantSpec(2, 32, "token"))
    assert tensor_bits(nuq, "key", 1024, 2, 64) == pytest.approx(3 + 1 + 8 * 32 / (2 * 1024 * 64))
    kivi = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), mode="packed", exact_window=128,
                       sink_tokens=4)  # fmt: skip
    assert tensor_bits(kivi, "key", 1024, 2, 64) == pytest.approx((132 * 16 + 892 * 3) / 1024)
    m = QuantizedKVCache.stored_bits(base, 1024)
    assert m["cache/bits_total"] == 3.0 and m["cache/bits_tokens"] == 1024


# --- packed mode -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S", [0, 2])
def test_packed_outliers_agree_with_simulated(S):
    """Where both modes quantize the same tokens with the same groups (R = 0), the packed store (codes + sparse fp16
    outliers in the model's dtype) reads back what simulated mode computes, bit for bit (the same mask, the same
    quantizer call), and its bytes count every outlier (value + int32 index: 8 bytes in fp32); without outliers the
    values differ."""
    from kvq_lab.cache.layers.base import PaddingState
    from kvq_lab.cache.layers.packed import PackedLayer
    from kvq_lab.cache.layers.simulated import SimulatedLayer

    k, v = keys(21, spikes=0.01), keys(22, outlier_channels=(9,), gain=30.0)
    th = fit_thresholds(keys(23, spikes=0.01), 0.01)
    kw = dict(key_outliers=0.01, value_outliers=0.01, key_outlier_thresholds=th, sink_tokens=S)
    kspec, vspec = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    sim = SimulatedLayer(CacheConfig(kspec, vspec, **kw), None, PaddingState())
    pk = PackedLayer(CacheConfig(kspec, vspec, mode="packed", backend="auto", **kw), None, PaddingState())
    plain = PackedLayer(CacheConfig(kspec, vspec, mode="packed", sink_tokens=S, backend="torch"), None, PaddingState())
    L = 64 + S
    for layer in (sim, pk, plain):
        layer.update(k[:, :, :L], v[:, :, :L])
    for N in range(L, T):
        ks, vs = sim.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        pk.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        plain.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    K, V = pk.materialize()
    whole = S + (T - S) // 32 * 32
    assert torch.equal(K[:, :, :whole], ks[:, :, :whole]) and torch.equal(V, vs)
    assert not torch.equal(plain.materialize()[1], vs)
    n_out = pk.k_stream.store.out_val.numel() + pk.v_stream.store.out_val.numel()
    assert n_out > 0 and pk.nbytes()[0] - plain.nbytes()[0] == 8 * n_out
