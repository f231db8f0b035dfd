"""llama.cpp's block types (`q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `iq4_nl`) against ggml itself: the `gguf` package's
numpy port of ggml's reference quantizers is the oracle. A group of 32 along a row (`group_size=32`, per-token) is one
ggml block: our fp16 parameters and codes, laid out as ggml's block bytes, must equal `gguf.quants.quantize` byte for
byte, and `gguf.quants.dequantize` of those bytes must equal our dequantization. gguf has no quantizer for iq4_nl: its
blocks are ggml's C quantizer's, kept in tests/quant/data/ by tests/quant/ggml_reference.py."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from kvq_lab.quant.formats import get_format

TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1, "iq4_nl": T.IQ4_NL}
QUANTIZED_BY_GGUF = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]  # gguf's port has their quantizers


def blocks(name: str, codes: torch.Tensor, scale: torch.Tensor, zero) -> np.ndarray:
    """Our (codes [n, 32], scale [n], zero [n] or None) as ggml block bytes [n, block bytes]."""
    d = scale.numpy().astype(np.float16).view(np.uint8).reshape(-1, 2)
    c = codes.numpy().astype(np.uint8)
    if name == "q8_0":
        qs = (c.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    else:  # the low 4 bits: element j in the low nibble of byte j, element j + 16 in its high nibble
        qs = (c[:, :16] & 0xF) | ((c[:, 16:] & 0xF) << 4)
    if name.startswith("q5"):  # the fifth bit of element j is bit j of a little-endian uint32 `qh`, before `qs`
        qs = np.concatenate([np.packbits(c >> 4, axis=1, bitorder="little"), qs], axis=1)
    parts = [d] + ([zero.numpy().astype(np.float16).view(np.uint8).reshape(-1, 2)] if zero is not None else [])
    return np.concatenate([*parts, qs], axis=1)


def awkward(seed: int) -> torch.Tensor:
    """[n, 32] fp32 rows: gaussian, heavy tails, one outlier, ties of magnitude (+-m), constants, zeros, tiny values
    whose fp16 scale is subnormal, values on ggml's rounding boundaries (4- and 5-bit steps), negatives only, an
    outlier near fp16's largest value."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(40, 32, generator=g), torch.randn(8, 32, generator=g) ** 3 * 5]
    out = torch.randn(4, 32, generator=g)
    out[:, 5] = 300.0
    tie = torch.randn(4, 32, generator=g)
    tie[:, 3], tie[:, 9] = 2.5, -2.5  # two elements of the same largest magnitude: the first one decides
    tie[:, 4:9] = tie[:, 4:9].clamp(-2, 2)
    tie[:, 10:] = tie[:, 10:].clamp(-2, 2)
    steps = torch.arange(32, dtype=torch.float32).repeat(4, 1) / 31 * 15 - 7.5  # k / 2 steps: rounding ties
    rows += [out, tie, torch.full((2, 32), 3.7), torch.zeros(2, 32), torch.randn(4, 32, generator=g) * 1e-6, steps]
    # 5-bit boundaries: q5_0 with d = 1 (m = -16) and q5_1 with d = 1 (min 0, max 31) at half steps, where ggml's
    # x / d + 16.5 and (x - min) / d + 0.5 land exactly on an integer
    half = torch.arange(32, dtype=torch.float32) + 0.5
    q5_0_steps = torch.cat([torch.tensor([-16.0]), half[:31] - 16])
    q5_1_steps = torch.cat([torch.tensor([0.0, 31.0]), half[:30]])
    negatives = -torch.randn(4, 32, generator=g).abs()
    huge = torch.randn(2, 32, generator=g)
    huge[:, 17] = torch.tensor([6e4, -6e4])  # near fp16's largest value: every other element in the middle codes
    rows += [q5_0_steps[None], -q5_0_steps[None], q5_1_steps[None], negatives, huge]
    return torch.cat(rows)


@pytest.mark.parametrize("name", QUANTIZED_BY_GGUF)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_codes_and_parameters_are_ggmls_bytes(name, seed):
    x = awkward(seed)
    codes, scale, zero = get_format(name).quantize_groups(x[None])
    ours = blocks(name, codes[0], scale[0], None if zero is None else zero[0])
    theirs = quants.quantize(x.numpy(), TYPES[name]).reshape(ours.shape)
    bad = np.nonzero((ours != theirs).any(1))[0]
    assert not len(bad), f"{name}: rows {bad[:5].tolist()} differ from ggml's blocks"


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantization_is_ggmls(name):
    x = awkward(3)
    fmt = get_format(name)
    codes, scale, zero = fmt.quantize_groups(x[None])
    ours = fmt.dequantize_groups(codes, scale, zero)[0].numpy()
    theirs = quants.dequantize(blocks(name, codes[0], scale[0], None if zero is None else zero[0]), TYPES[name])
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))


def test_iq4_nl_blocks_are_ggmls_cache_quantizer():
    from ggml_reference import REFERENCE

    ref = np.load(REFERENCE)
    x = torch.from_numpy(ref["x"])
    codes, scale, _ = get_format("iq4_nl").quantize_groups(x[None])
    ours = blocks("iq4_nl", codes[0], scale[0], None)
    bad = np.nonzero((ours != ref["blocks"]).any(1))[0]
    assert not len(bad), f"iq4_nl: rows {bad[:5].tolist()} differ from ggml's quantize_row_iq4_nl_ref"


def test_iq4_nl_table_is_ggmls_and_its_fitted_scale_beats_the_absmax_one():
    from kvq_lab.quant.formats.iq4_nl import VALUES, nearest

    assert tuple(quants.IQ4_NL.kvalues) == VALUES
    assert nearest(torch.tensor([-200.0, -115.5, 7.0, 12.0, 113.0, 500.0])).tolist() == [0, 1, 9, 9, 15, 15]
    x = awkward(4)[:48]
    fmt = get_format("iq4_nl")
    codes, scale, _ = fmt.quantize_groups(x[None])
    err = (fmt.dequantize_groups(codes, scale, None)[0] - x).pow(2).mul(x * x).sum()
    d0 = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -127  # the largest magnitude on the table's end -127
    assert torch.equal(codes[0].long(), nearest(x / d0))  # the codes are d0's; only the scale is fitted
    plain = (torch.tensor(VALUES)[nearest(x / d0)] * d0 - x).pow(2).mul(x * x).sum()
    assert err < plain  # the weighted least-squares scale for those codes does better than d0
