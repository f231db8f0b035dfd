"""Bit packing: lossless round trips, the documented layout, exact byte accounting."""

import pytest
import torch

from kvq_lab.quant.formats import tensor_nbytes
from kvq_lab.quant.pack import BLOCK, PackedQTensor, pack, packed_rows, qtensor_nbytes, unpack, word_layout
from kvq_lab.quant.reference import code_format, dequantize, quantize
from kvq_lab.quant.spec import INT_BITS, QuantSpec

BITS = (1, 2, 3, 4, 5, 8)


def spec_at(bits: int, axis: str) -> QuantSpec:
    """A spec whose format takes `bits`: int, or q5_1 at 5 bits (int has no 5-bit width)."""
    return QuantSpec(bits, 32, axis, "int" if bits in INT_BITS else "q5_1")


@pytest.mark.parametrize("bits", BITS)
def test_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 3 * BLOCK, 24), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 3 * BLOCK * bits // 8, 24)
    assert torch.equal(unpack(packed, bits), codes)
    # a strided view of a larger buffer (how the cache reads its storage) unpacks the same
    big = torch.zeros(2, 3, packed.shape[2] + 40, 24, dtype=torch.uint8)
    big[:, :, : packed.shape[2]] = packed
    assert torch.equal(unpack(big[:, :, : packed.shape[2]], bits), codes)


def test_layout_by_hand():
    # 2 bits: 4 planes of 8 tokens; byte r of channel d holds tokens r, r+8, r+16, r+24 at bits 0, 2, 4, 6
    codes = torch.zeros(1, 1, BLOCK, 1, dtype=torch.uint8)
    codes[0, 0, [3, 11, 19, 27], 0] = torch.tensor([1, 2, 3, 1], dtype=torch.uint8)
    p = pack(codes, 2)
    assert p.shape == (1, 1, 8, 1)
    assert p[0, 0, 3, 0].item() == 1 | 2 << 2 | 3 << 4 | 1 << 6
    assert int(p.sum()) == p[0, 0, 3, 0].item()
    # 3 bits: 8 codes in a 24-bit little-endian word, 3 byte planes of 4 rows each
    codes = torch.zeros(1, 1, BLOCK, 1, dtype=torch.uint8)
    codes[0, 0, [1 + 4 * k for k in range(8)], 0] = torch.arange(8, dtype=torch.uint8)
    p = pack(codes, 3)
    word = sum(k << (3 * k) for k in range(8))
    assert [p[0, 0, 1 + 4 * i, 0].item() for i in range(3)] == [(word >> (8 * i)) & 0xFF for i in range(3)]
    # 5 bits: 8 codes in a 40-bit little-endian word, 5 byte planes of 4 rows each; the top code (31, token 30)
    # sits at bits 35-39, beyond an int32
    codes = torch.zeros(1, 1, BLOCK, 1, dtype=torch.uint8)
    codes[0, 0, [2 + 4 * k for k in range(8)], 0] = torch.tensor([1, 2, 3, 5, 8, 13, 21, 31], dtype=torch.uint8)
    p = pack(codes, 5)
    assert p.shape == (1, 1, 20, 1)
    word = sum(c << (5 * k) for k, c in enumerate([1, 2, 3, 5, 8, 13, 21, 31]))
    assert [p[0, 0, 2 + 4 * i, 0].item() for i in range(5)] == [(word >> (8 * i)) & 0xFF for i in range(5)]
    assert torch.equal(unpack(p, 5), codes)


def test_word_layout():
    assert [word_layout(b) for b in BITS] == [(8, 1), (4, 1), (8, 3), (2, 1), (8, 5), (1, 1)]
    for bits in (6, 7, 16):
        with pytest.raises(ValueError, match=f"cannot pack bits={bits}; allowed: 1, 2, 3, 4, 5, 8"):
            word_layout(bits)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", BITS)
def test_packed_qtensor_round_trip(bits, axis):
    x = torch.randn(1, 2, 77, 64, generator=torch.Generator().manual_seed(0))  # 77: not a multiple of G or BLOCK
    q = quantize(x, spec_at(bits, axis))
    p = PackedQTensor.from_qtensor(q)
    back = p.to_qtensor()
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(dequantize(back), dequantize(q))


def test_three_bits_per_element_at_2bit_g32():
    spec = QuantSpec(2, 32, "token")
    T, D = 4 * BLOCK, 128
    q = quantize(torch.randn(1, 1, T, D), spec)
    p = PackedQTensor.from_qtensor(q)
    assert p.nbytes() == qtensor_nbytes(T, D, spec) == T * D * 3 // 8  # 2 bits + 2 fp16 per 32 elements
    assert p.fp16_nbytes() / p.nbytes() == pytest.approx(16 / 3)
    spec_c = QuantSpec(2, 32, "channel")
    assert qtensor_nbytes(T, D, spec_c) == T * D * 3 // 8
    # 3 bits: no wasted bits (8 codes in 3 bytes)
    assert packed_rows(BLOCK, 3) * D == BLOCK * D * 3 // 8
    # partial blocks are allocated whole
    assert packed_rows(BLOCK + 1, 2) == 2 * BLOCK * 2 // 8


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("name, bpe", [("q5_0", 5.5), ("q5_1", 6.0)])
def test_five_bit_codes_take_five_bits(name, bpe, axis):
    """5-bit codes cost 5 bits each (8 to a 40-bit word) plus the fp16 parameters: 5 + 16/32 bits per element for
    q5_0 (scale), 5 + 32/32 for q5_1 (scale and minimum), as `nbytes()` and both byte formulas count them."""
    T, D = 4 * BLOCK, 64
    spec = QuantSpec(5, 32, axis, name)
    p = PackedQTensor.from_qtensor(quantize(torch.randn(1, 1, T, D), spec))
    assert p.packed.shape[-2] == T * 5 // 8 == packed_rows(T, 5)
    assert p.nbytes() == qtensor_nbytes(T, D, spec) == tensor_nbytes(code_format(spec), 32, axis, T, D)
    assert p.nbytes() * 8 == T * D * bpe
