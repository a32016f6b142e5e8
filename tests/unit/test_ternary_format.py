"""The packed ternary format and the quantizers: round trips, layout, and clear errors."""

from __future__ import annotations

import pytest
import torch

from noesis.ternary.quant import (
    TernaryFormatError,
    absmean_ternary,
    check_packed,
    dequantize,
    pack,
    quantize_activations,
    unpack,
)


@pytest.mark.parametrize("shape", [(1, 1), (3, 4), (5, 7), (16, 130), (64, 384)])
def test_pack_unpack_round_trip(shape):
    torch.manual_seed(sum(shape))
    ternary = torch.randint(-1, 2, shape, dtype=torch.int8)
    packed = pack(ternary)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], -(-shape[1] // 4))
    assert torch.equal(unpack(packed, shape[1]), ternary)


def test_layout_is_four_codes_per_byte_low_bits_first():
    ternary = torch.tensor([[-1, 0, 1, 1, 0]], dtype=torch.int8)  # codes 0, 1, 2, 2 | 1 (+pad 1s)
    packed = pack(ternary)
    assert packed.tolist() == [[0 | 1 << 2 | 2 << 4 | 2 << 6, 1 | 1 << 2 | 1 << 4 | 1 << 6]]


def test_pack_rejects_non_ternary_values():
    with pytest.raises(ValueError, match="-1, 0, 1"):
        pack(torch.tensor([[0, 2]], dtype=torch.int8))


def test_unpack_rejects_code_three():
    packed = pack(torch.zeros(2, 8, dtype=torch.int8))
    packed[1, 1] |= 0b11 << 4
    with pytest.raises(TernaryFormatError, match="code 3"):
        unpack(packed, 8)


@pytest.mark.parametrize(
    ("packed", "message"),
    [
        (torch.zeros(4, 3, dtype=torch.uint8), r"shape \[4, 3\], expected \[4, 2\]"),
        (torch.zeros(4, 2, dtype=torch.int8), "must be uint8"),
        (torch.zeros(4, 2, 1, dtype=torch.uint8), "shape"),
    ],
)
def test_misshaped_or_mistyped_packed_tensor(packed, message):
    with pytest.raises(TernaryFormatError, match=message):
        check_packed(packed, 4, 8)


def test_absmean_ternarization():
    weight = torch.tensor([[0.5, -0.1, 0.0, -2.0], [0.2, 0.3, -0.4, 0.1]])
    ternary, scale = absmean_ternary(weight)
    assert scale.item() == pytest.approx(weight.abs().mean().item())
    # w / scale = [1.11, -0.22, 0, -4.44], [0.44, 0.67, -0.89, 0.22] -> round, clip to [-1, 1]
    assert ternary.tolist() == [[1, 0, 0, -1], [0, 1, -1, 0]]
    assert absmean_ternary(torch.zeros(2, 2))[0].abs().sum() == 0  # no division by zero


def test_activation_quantization_per_token_absmax():
    x = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-254.0, 1.0, 127.0]])
    q, s = quantize_activations(x)
    assert q.tolist()[0] == [127, -64, 32]  # 63.5 rounds half to even -> 64 (-63.5 -> -64)
    assert q.tolist()[1] == [0, 0, 0]
    assert q.tolist()[2] == [-127, 0, 64]  # 0.5 -> 0 (half to even), 63.5 -> 64
    assert torch.allclose(q / s, x, atol=x.abs().amax(-1, keepdim=True).max().item() / 254 + 1e-6)


def test_dequantize_applies_row_scales():
    ternary = torch.tensor([[1, -1, 0], [0, 1, 1]], dtype=torch.int8)
    weight = dequantize(pack(ternary), torch.tensor([0.5, 2.0]), 3)
    assert weight.tolist() == [[0.5, -0.5, 0.0], [0.0, 2.0, 2.0]]
