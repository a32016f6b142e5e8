"""PackedLinear: the packed layer equals the float layer of its dequantized weight, on the
portable path and through the Triton kernel (run by Triton's interpreter on a CPU).

The reference weight is computed here from the codes, zero points and scales directly (float64,
one column's group at a time), not by the library's unpacking."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from noesis.errors import CheckpointMismatch
from noesis.quant.linear import PackedLinear, dequantized_matmul
from noesis.quant.packing import pack, unpack
from noesis.quant.scheme import WeightQuant

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def packed_layer(n, k, bits, group_size, act_order=False, bias=False, parts=1, seed=0,
                 dtype=torch.float32):
    """A loaded PackedLinear with random codes, and its float64 reference weight [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    method = "gptq" if act_order or bits == 8 else "awq"
    quant = WeightQuant(method, bits, group_size)
    layer = PackedLinear(k, n, bias, quant, parts).to(dtype)
    group = quant.group_of(k)
    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(dtype)
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    g_idx = (torch.argsort(order) // group).to(torch.int32)  # column order[i] is in group i // g
    with torch.no_grad():
        layer.qweight.copy_(pack(codes, bits))
        layer.qzeros.copy_(zeros)
        layer.scales.copy_(scales)
        if layer.g_idx is not None:
            layer.g_idx.copy_(g_idx.expand(parts, k))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=gen))
    layer.check_loaded("layer")
    weight = torch.empty(n, k, dtype=torch.float64)
    for col in range(k):
        g = int(g_idx[col])
        weight[:, col] = (codes[:, col] - zeros[:, g]).double() * scales[:, g].double()
    return layer, weight


def test_pack_round_trip():
    for bits in (4, 8):
        values = torch.randint(0, 1 << bits, (3, 64))
        assert torch.equal(unpack(pack(values, bits), bits), values.int())
    assert pack(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]]), 4).item() == -(1 << 28)  # sign bit


@pytest.mark.parametrize(
    ("bits", "group_size", "act_order", "bias"),
    [(4, 32, False, False), (4, 16, True, True), (8, -1, False, True), (8, 32, True, False)],
    ids=["int4-g32", "int4-act-order-bias", "int8-per-channel", "int8-g32-act-order"],
)
def test_packed_layer_equals_dequantized_float_layer(bits, group_size, act_order, bias):
    layer, weight = packed_layer(48, 128, bits, group_size, act_order, bias)
    assert layer.act_order == act_order
    x = torch.randn(2, 5, 128)  # any leading dims
    expected = F.linear(x.double(), weight, None if layer.bias is None else layer.bias.double())
    got = layer(x)
    assert got.shape == (2, 5, 48)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dequantize().double(), weight.float().double())


def test_bfloat16_dequantizes_with_one_rounding():
    layer, weight = packed_layer(32, 64, 4, 32, dtype=torch.bfloat16)
    assert torch.equal(layer.dequantize(), weight.to(torch.bfloat16))


def test_fused_parts_must_share_g_idx():
    layer, _ = packed_layer(48, 64, 4, 16, act_order=True, parts=3)
    with torch.no_grad():
        layer.g_idx[1] = torch.roll(layer.g_idx[1], 1)
    with pytest.raises(CheckpointMismatch, match=r"proj\.g_idx: the fused projections' g_idx"):
        layer.check_loaded("model.layers.0.self_attn.qkv_proj")


# ---- the Triton kernel against the portable path ------------------------------------------------


@pytest.mark.parametrize(
    ("m", "n", "k", "bits", "group_size", "act_order"),
    [
        (1, 48, 256, 4, 64, False),  # decode, split over K
        (5, 40, 128, 4, 16, True),  # decode, act-order gather
        (3, 32, 96, 8, -1, False),  # int8 per channel, K not a multiple of the tile
        (40, 72, 256, 4, 128, False),  # prefill tiles
        (20, 64, 128, 8, 32, True),
    ],
)
def test_triton_kernel_matches_portable_path(m, n, k, bits, group_size, act_order):
    triton = pytest.importorskip("triton")
    assert triton is not None
    from noesis.quant import kernel

    layer, _ = packed_layer(n, k, bits, group_size, act_order)
    x = torch.randn(m, k)
    groups = layer.g_idx[0] if layer.act_order else None
    args = (layer.qweight, layer.scales, layer.qzeros, groups, layer.bits, layer.group_size)
    expected = dequantized_matmul(x, *args)
    got = kernel.packed_matmul(x, *args)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_triton_split_past_the_end_of_k():
    """Three K tiles over two splits: the second split's last tile lies past K, masked."""
    pytest.importorskip("triton")
    from noesis.quant import kernel

    layer, _ = packed_layer(64, 192, 4, 64)
    x = torch.randn(2, 192)
    args = (layer.qweight, layer.scales, layer.qzeros, None, 4, 64)
    config = kernel.GemvConfig(block_n=16, block_k=64, split_k=2)
    assert torch.allclose(kernel.packed_matmul(x, *args, config=config),
                          dequantized_matmul(x, *args), rtol=1e-5, atol=1e-4)
