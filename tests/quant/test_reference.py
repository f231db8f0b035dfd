"""The reference quantizer against hand-computed cases, its error bound, and the direction of the axis ablation."""

from __future__ import annotations

import pytest
import torch

from kvq_lab.quant import QuantConfigError, QuantSpec, dequantize, fake_quant, quantize, step_size


def t4(rows):
    """[T, D] list -> [1, 1, T, D] fp32."""
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def test_per_token_hand_computed():
    # one token, one group of 4 channels, 2 bits: min 0, max 3 -> scale 1, codes = values
    x = t4([[0.0, 1.0, 2.0, 3.0]])
    q = quantize(x, QuantSpec(2, 4, "token"))
    assert q.codes.tolist() == [[[[0, 1, 2, 3]]]]
    assert q.scale.item() == 1.0 and q.zero.item() == 0.0
    assert torch.equal(dequantize(q), x)


def test_round_half_to_even():
    # (x - 0) / 1 = 0.5 -> 0 (even), 1.5 -> 2, 2.5 -> 2; the max 3 pins scale = 1
    x = t4([[0.5, 1.5, 2.5, 3.0]])
    q = quantize(x, QuantSpec(2, 4, "token"))
    # min 0.5 -> zero 0.5, scale (3-0.5)/3 = 0.8333 -> codes round(0, 1.2, 2.4, 3) = 0, 1, 2, 3
    assert q.codes.flatten().tolist() == [0, 1, 2, 3]
    x = t4([[0.0, 0.5, 1.5, 3.0]])
    q = quantize(x, QuantSpec(2, 4, "token"))
    assert q.codes.flatten().tolist() == [0, 0, 2, 3]  # 0.5 -> 0 and 1.5 -> 2: half to even


def test_per_channel_groups_run_along_tokens():
    # 4 tokens x 2 channels, G=2 tokens: channel 0 groups (0,1),(2,3); channel 1 groups (10,30),(20,40)
    x = t4([[0.0, 10.0], [1.0, 30.0], [2.0, 20.0], [3.0, 40.0]])
    q = quantize(x, QuantSpec(1, 2, "channel"))
    assert q.scale.shape == (1, 1, 2, 2)  # [B, H, T/G, D]
    assert q.zero[0, 0].tolist() == [[0.0, 10.0], [2.0, 20.0]]
    assert q.scale[0, 0].tolist() == [[1.0, 20.0], [1.0, 20.0]]
    assert torch.equal(dequantize(q), x)  # 1-bit is exact for two-valued groups


def test_partial_group_zero_padded_like_kivi():
    # T=3, G=4: the pad token is a 0 inside the group's min/max -> min 0, max 6, 2-bit scale 2
    x = t4([[2.0], [4.0], [6.0]])
    q = quantize(x, QuantSpec(2, 4, "channel"), partial="zero")
    assert q.zero.item() == 0.0 and q.scale.item() == 2.0
    assert q.codes.flatten().tolist() == [1, 2, 3, 0]
    assert dequantize(q).shape == x.shape
    # excluded: min 2, max 6, scale 4/3 (rounded up to fp16)
    q = quantize(x, QuantSpec(2, 4, "channel"), partial="exclude")
    assert q.zero.item() == 2.0
    assert q.scale.item() == pytest.approx(4 / 3, rel=1e-3) and q.scale.item() >= 4 / 3


def test_zero_width_group_is_exact_and_finite():
    for x in (torch.zeros(1, 2, 64, 32), torch.full((1, 2, 64, 32), 3.7)):
        for axis in ("token", "channel"):
            y = fake_quant(x, QuantSpec(2, 32, axis))
            assert torch.isfinite(y).all()
            assert torch.equal(y, x.to(torch.float16).float()) or torch.allclose(y, x, atol=2e-3)
    # exactly representable constant: bit-exact
    x = torch.full((1, 1, 32, 32), 0.25)
    assert torch.equal(fake_quant(x, QuantSpec(2, 32, "channel")), x)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_at_most_half_a_step(axis, bits, dtype):
    g = torch.Generator().manual_seed(bits)
    # awkward shape: T=37 is not a multiple of G, GQA-like 3 heads, an outlier channel
    x = torch.randn(2, 3, 37, 64, generator=g) * 2
    x[..., 5] *= 40
    x = x.to(dtype)
    spec = QuantSpec(bits, 32, axis)
    q = quantize(x, spec, partial="exclude")
    y = dequantize(q).float()
    err = (y - x.float()).abs()
    # half a step, plus the rounding of the fp32 result to the input dtype (half an ulp of the result)
    bound = step_size(q) / 2 * (1 + 1e-6) + y.abs() * torch.finfo(dtype).eps / 2 + 1e-6
    assert (err <= bound).all(), (err - bound).max()
    assert q.codes.max() <= spec.levels


def test_valid_mask_keeps_padding_out_of_min_max():
    x = torch.randn(1, 1, 8, 32)
    padded = torch.cat([torch.full((1, 1, 4, 32), 1e4), x], dim=2)  # 4 huge pad tokens in front
    valid = torch.tensor([[False] * 4 + [True] * 8])[:, None]
    for axis in ("token", "channel"):
        spec = QuantSpec(2, 4, axis)
        a = fake_quant(padded, spec, valid=valid)[..., 4:, :]
        b = fake_quant(x, spec)
        assert torch.equal(a, b)


def test_identity_and_validation():
    x = torch.randn(1, 1, 5, 8)
    assert fake_quant(x, QuantSpec(16, 32, "token")) is x
    with pytest.raises(QuantConfigError, match="axis='chanel'.*token, channel"):
        QuantSpec(2, 32, "chanel")
    with pytest.raises(QuantConfigError, match=r"bits=6 is not supported; allowed: 1, 2, 3, 4, 5, 8, 16"):
        QuantSpec(6, 32, "token")
    with pytest.raises(QuantConfigError, match=r"format=int takes 1, 2, 3, 4, 8 bits; bits=5 conflicts"):
        fake_quant(x, QuantSpec(5, 8, "token"))  # a width some format takes (q5_0), not int
    with pytest.raises(QuantConfigError, match="does not divide head_dim=8"):
        fake_quant(x, QuantSpec(2, 3, "token"))


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    """The direction KIVI's axis argument rests on: keys with fixed outlier channels quantize better per-channel."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 4, 256, 64, generator=g)
    k[..., [3, 17, 40]] = k[..., [3, 17, 40]] * 0.2 + torch.tensor([15.0, -12.0, 20.0])  # fixed outlier channels
    err = {a: (fake_quant(k, QuantSpec(2, 32, a)) - k).norm() / k.norm() for a in ("token", "channel")}
    assert err["channel"] < 0.5 * err["token"], err
