"""Residual corrections (`kvq_lab.quant.residuals`): every registered one through the chain, simulated mode, the
packed store and its byte count (driven by `RESIDUALS`, so a new correction is tested with no edit), plus QJL's
unbiasedness (and that a wrong constant is caught) and the sparse term's hand case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.accounting import tensor_bits
from kvq_lab.cache.knobs import cache_config
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.cache.layers.simulated_stream import simulate
from kvq_lab.common.errors import ConfigError
from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.quant.formats import tensor_nbytes
from kvq_lab.quant.layout import padded_tokens
from kvq_lab.quant.outliers import fake_quant
from kvq_lab.quant.reference import code_format
from kvq_lab.quant.residuals import RESIDUALS, Chain, build_chain, check_residuals, get_residual
from kvq_lab.quant.residuals.qjl import QJL
from kvq_lab.quant.residuals.sparse import Sparse
from kvq_lab.quant.spec import QuantConfigError, QuantSpec

CASES = [pytest.param(name, id=name) for name in sorted(RESIDUALS)]


def data(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    x[..., 3] *= 15  # an outlier channel
    x[:, :, T // 2] = 0.0  # a zero token: a zero residual
    return x


@pytest.mark.parametrize("name", CASES)
def test_encoding_is_what_decoding_reads(name):
    """Bytes of the declared size per unit of `block` tokens, a round trip through the spelling, a correction that
    depends on the stored bytes alone (decode(encode(r)) is what the chain returns), and a zero residual (one unit)
    rebuilt as zero."""
    c = RESIDUALS[name].example()
    assert get_residual(c.spelling) == c and check_residuals([c.spelling], "key_residual") == (c.spelling,)
    n = c.block
    for D in (64, 128):
        r = data(2, 3, 17 * n, D, 1)
        r[:, :, 8 * n : 9 * n] = 0.0
        stored = c.encode(r)
        assert stored.dtype == torch.uint8 and stored.shape == (2, 3, 17, c.unit_bytes(D))
        back = c.decode(stored, D)
        assert back.shape == r.shape and back.dtype == torch.float32
        assert torch.equal(back[:, :, 8 * n : 9 * n], torch.zeros(2, 3, n, D))
        chain = Chain((c,))
        st, corr = chain.encode(r)
        assert torch.equal(st, stored) and torch.equal(corr, back) and torch.equal(chain.decode(st, D), corr)
        assert not torch.equal(back, torch.zeros_like(back))  # the oracle can fail: it rebuilds something


def test_a_chain_encodes_what_the_previous_ones_left():
    r = data(1, 2, 9, 64, 2)
    chain = build_chain(("sparse:0.05", "qjl:64"))
    st, corr = chain.encode(r)
    first = Sparse(0.05).decode(Sparse(0.05).encode(r), 64)
    second = QJL(64).decode(QJL(64).encode(r - first), 64)
    assert st.shape[-1] == Sparse(0.05).unit_bytes(64) + QJL(64).unit_bytes(64) == 9 + 10
    assert torch.equal(corr, first + second) and torch.equal(chain.decode(st, 64), corr)


def _qjl_mean(r: torch.Tensor, q: torch.Tensor, seeds: int) -> tuple[float, float]:
    est = torch.stack([q @ QJL(64, s).decode(QJL(64, s).encode(r), 64) for s in range(seeds)])
    return est.mean().item(), est.std().item() / seeds**0.5


def test_qjl_is_unbiased_and_a_wrong_constant_is_caught(monkeypatch):
    """Over 3000 sketches (seeds), the mean of <q, r^> is within 4 standard errors of <q, r> (the fp16 norm's rounding,
    < 1e-3 relative, is far below the standard error); with the constant 1 instead of sqrt(pi/2) it is off by ~20%."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, generator=g)
    q = r + 0.5 * torch.randn(64, generator=g)
    exact = (q @ r).item()
    mean, se = _qjl_mean(r, q, 3000)
    assert abs(mean - exact) < 4 * se and se < 0.02 * abs(exact), (mean, exact, se)
    monkeypatch.setattr(QJL, "scale", 1.0)
    wrong, se = _qjl_mean(r, q, 3000)
    assert abs(wrong - exact) > 10 * se, (wrong, exact, se)


def test_qjl_hand_case():
    """The stored bits are sign(S r) and the norm |r| in fp16."""
    S = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    r = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 3
    stored = QJL(8).encode(r[None])[0]
    bits = [(int(stored[0]) >> j) & 1 for j in range(8)]
    assert bits == [int(v >= 0) for v in (S @ r).tolist()]
    assert stored[1:3].clone().view(torch.float16).item() == torch.tensor(r.norm().item(), dtype=torch.float16).item()
    s = torch.tensor(bits, dtype=torch.float32) * 2 - 1
    norm = stored[1:3].clone().view(torch.float16).float()
    want = (torch.pi / 2) ** 0.5 / 8 * norm * (s @ S)
    torch.testing.assert_close(QJL(8).decode(stored[None], 16)[0], want)


def test_sparse_hand_case():
    """The k largest |r| kept as fp16 with their channels (ties to the lower channel), zero elsewhere."""
    r = torch.zeros(1, 64)
    r[0, [5, 9, 40]] = torch.tensor([-3.0, 2.0, 2.0])
    r[0, 0] = 0.1
    got = Sparse(0.03).decode(Sparse(0.03).encode(r), 64)  # k = round(1.92) = 2: channel 5, then 9 (tie with 40)
    want = torch.zeros(1, 64)
    want[0, [5, 9]] = torch.tensor([-3.0, 2.0])
    assert torch.equal(got, want)
    assert Sparse(0.03).unit_bytes(64) == 2 * 3 and Sparse(0.03).unit_bytes(512) == Sparse(0.03).k(512) * 4


def _configs(name, S, mode, **kw):
    sp = RESIDUALS[name].example().spelling
    ks, vs = QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token")
    return CacheConfig(ks, vs, mode=mode, sink_tokens=S, key_residual=(sp,), value_residual=(sp,), **kw)


@pytest.mark.parametrize("S", [0, 3])
@pytest.mark.parametrize("name", CASES)
def test_packed_reads_back_what_simulated_mode_computes(name, S):
    """With R = 0 both modes quantize the same tokens with the same groups: the packed store's codes plus stored
    corrections read back simulated mode's values bit for bit (every per-token and whole per-channel group), its bytes
    are the layout's arithmetic plus the correction's units (and an incomplete unit's fp16 error), decode attention
    over its view matches SDPA over the materialized cache, and without the correction the values differ."""
    k, v = data(1, 2, 140, 64, 3), data(1, 2, 140, 64, 4)
    sim = SimulatedLayer(_configs(name, S, "simulated"), None, PaddingState())
    pk = PackedLayer(_configs(name, S, "packed", backend="auto"), None, PaddingState())
    assert pk.backend.name == "torch"
    plain_cfg = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), mode="packed", sink_tokens=S)
    plain = PackedLayer(plain_cfg, None, PaddingState())
    L = 70
    for layer in (sim, pk, plain):
        layer.update(k[:, :, :L], v[:, :, :L])
    for N in range(L, 140):
        ks, vs = sim.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        pk.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        plain.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    K, V = pk.materialize()
    whole = S + (140 - S) // 32 * 32
    assert torch.equal(K[:, :, :whole], ks[:, :, :whole]) and torch.equal(V, vs)
    assert not torch.equal(V, plain.materialize()[1])
    chain = build_chain((RESIDUALS[name].example().spelling,))
    for st, s in ((pk.k_stream.store, pk.cfg.key), (pk.v_stream.store, pk.cfg.value)):
        n = padded_tokens(st.length) if s.axis == "token" else st.length
        arithmetic = 2 * tensor_nbytes(code_format(s), 32, s.axis, n, 64)
        units = -(-padded_tokens(st.length) // chain.block)
        pending = st.length % chain.block if s.axis == "token" else 0
        assert st.nbytes() == arithmetic + 2 * (units * chain.unit_bytes(64) + pending * 64 * 2)
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(5))
    want = F.scaled_dot_product_attention(q, K, V, scale=0.125, enable_gqa=True).transpose(1, 2)
    got = decode_attention_torch(pk.decode_view(), q, None, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_simulate_adds_the_correction_around_the_outliers(name):
    """`simulate` (the probes' path) is fake quant plus the rebuild of the error, outliers kept exact after it."""
    from kvq_lab.quant.outliers import Outliers

    chain = build_chain((RESIDUALS[name].example().spelling,))
    x = data(1, 2, 64, 64, 6)
    spec = QuantSpec(2, 32, "token")
    out = Outliers(0.02, "token")
    got = simulate(x, spec, outliers=out, residual=chain)
    m = out.mask(x)
    deq = fake_quant(x, spec, out)
    base = torch.where(m, 0.0, x - torch.where(m, 0.0, deq))  # the error the codes leave, 0 at outliers
    want = torch.where(m, x, torch.where(m, x, deq) + chain.correction(base))
    assert torch.equal(got, want)
    assert not torch.equal(got, deq)


def test_bits_count_the_corrections():
    """int2 G32: 3 bits; qjl:64 on D = 64 adds (8 + 2) bytes per token: 1.25 bits; sparse:0.05 keeps 3 entries of
    3 bytes: 1.125 bits."""
    c = cache_config({"key_residual": "qjl:64", "value_residual": "sparse:0.05"})
    assert tensor_bits(c, "key", 1024, 3, 64) == pytest.approx(3 + 1.25)
    assert tensor_bits(c, "value", 1024, 3, 64) == pytest.approx(3 + 1.125)


def test_lowrank_hand_case():
    """A rank-1 error is rebuilt to fp16 precision by lowrank:1 and not by a rank-1 fit of noise; a block's factors
    cost 2 r (n + D) bytes; the tokens of an open block are read with their fp16 error (GEAR's buffer) and counted at
    16 bits; a rank not below the head dim fails in one line."""
    from kvq_lab.quant.residuals.lowrank import LowRank

    g = torch.Generator().manual_seed(9)
    u, v = torch.randn(1, 1, 64, 1, generator=g), torch.randn(1, 1, 1, 64, generator=g)
    r = u * v  # [1, 1, 64, 64], rank 1: two blocks of 32 tokens
    c = LowRank(1, 32)
    assert c.unit_bytes(64) == 2 * (32 + 64) and c.encode(r).shape == (1, 1, 2, 192)
    torch.testing.assert_close(c.decode(c.encode(r), 64), r, rtol=0, atol=2e-3 * r.abs().max().item())
    noise = torch.randn(1, 1, 64, 64, generator=g)
    assert (c.decode(c.encode(noise), 64) - noise).norm() > 0.5 * noise.norm()
    chain = build_chain(("lowrank:1",))
    corr = chain.correction(r[:, :, :40])  # one whole block, 8 tokens of an open one
    assert torch.equal(corr[:, :, 32:], r[:, :, 32:40].half().float())
    assert torch.equal(corr[:, :, :32], chain.correction(r[:, :, :32]))
    cfg = cache_config({"key_residual": "lowrank:1"})
    assert tensor_bits(cfg, "key", 1024, 3, 64) == pytest.approx(3 + 0.75)
    assert tensor_bits(cfg, "key", 1000, 3, 64) == pytest.approx(3 + (992 * 0.75 + 8 * 16) / 1000)
    with pytest.raises(QuantConfigError) as e:
        cache_config({"value_residual": "lowrank:64:128"}).check_head_dim(64)
    assert "rank 64 is not below the head dim 64" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"key_residual": "qjl:60"}, "key_residual=qjl:60 needs the sketch size m, a multiple of 8"),
        ({"residual": "sparse:0.5"}, "residual=sparse:0.5 needs the fraction kept, in (0, 0.5)"),
        ({"key_residual": "svd:4"}, "key_residual='svd:4' is not a registered residual correction"),
        ({"key_residual": "lowrank"}, "key_residual=lowrank needs a rank r >= 1"),
        ({"value_residual": "lowrank:64:64"}, "value_residual=lowrank:64:64 needs a rank r >= 1"),
        (
            {"mode": "packed", "exact_window": 32, "key_residual": "lowrank:2:64"},
            "per-channel keys are flushed 32 at a time (exact_window=32, group_size=32): make exact_window a "
            "multiple of 64",
        ),
        ({"key_residual": "qjl:64", "key_bits": 16}, "keys are not quantized (key_bits=16): unset key_residual"),
        ({"value_residual": ["qjl:64", "sparse:0.1", "sparse:0.1"]}, "value_residual lists sparse:0.1 twice"),
        ({"residual": "qjl:64", "key_residual": "qjl:32"}, "residual=qjl:64 and key_residual=qjl:32 disagree"),
        ({"mode": "recompute", "key_residual": "qjl:64"}, "residual corrections and per-layer configs do not apply"),
    ],
)
def test_bad_residuals_fail_in_one_line(knobs, message):
    with pytest.raises(ConfigError) as e:
        cache_config(knobs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_labels_and_spellings():
    assert cache_config({"residual": "qjl:64"}).label() == "K2b-C32_V2b-T32_sim_Kqjl64_Vqjl64"
    assert QJL.parse("64:7") == QJL(64, 7) and QJL(64, 7).spelling == "qjl:64:7"
    with pytest.raises(QuantConfigError, match="qjl:<m>"):
        QJL.parse(None)
