"""MXFP4 experts as tensor-core fragments (kernels/mxfp4_mma.py): the packed layout against the
checkpoint's dequantization, and the decode GEMV's sums, interpreted on the CPU (each lane's
share of an mma summed in float32 Triton operations, over the same operands the PTX takes)
against dequantize-then-matmul. On a CUDA machine the same tests run the inline mma.sync
(`pytest tests/unit/test_mxfp4_mma.py` there; tests/gpu/test_moe_triton_cuda.py has the real
shapes)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl  # noqa: E402

from noesis.kernels import moe_triton  # noqa: E402
from noesis.kernels.asm import bf16x2_asm  # noqa: E402
from noesis.kernels.frag_gemv import frag_gemv  # noqa: E402
from noesis.weights.mxfp4 import (  # noqa: E402
    Mxfp4Fragments,
    Mxfp4Weight,
    bits_of,
    dequantize_mxfp4,
    from_fragments,
    gate_up_rows,
    to_fragments,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _mxfp4(experts, rows, cols, seed=0, low=118, high=124):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                           generator=gen)  # fmt: skip
    scales = torch.randint(low, high, (experts, rows, cols // 32), dtype=torch.uint8,
                           generator=gen)  # fmt: skip
    return Mxfp4Weight(blocks.to(DEVICE), scales.to(DEVICE))


def test_every_code_bit_has_one_place_in_a_word():
    places = set()
    for register in range(4):
        for half in range(2):
            sign, mag = bits_of(register, half)
            places |= {sign, mag, mag + 1, mag + 2}
    assert places == set(range(32))


@pytest.mark.parametrize("rows, cols", [(32, 128), (20, 96), (16, 32)])
def test_fragments_hold_the_checkpoints_values(rows, cols):
    weight = _mxfp4(3, rows, cols, seed=rows)
    words, scales = to_fragments(weight.blocks, weight.scales)
    assert words.shape == (3, -(-rows // 16), -(-cols // 64), 32, 4) and words.dtype == torch.int32
    assert scales.shape == words.shape[:3] + (8,)
    assert torch.equal(from_fragments(words, scales, rows, cols), weight.dequantize())


def test_a_row_order_and_zero_rows_are_packed_in_place():
    weight = _mxfp4(2, 12, 64, seed=5)
    order = torch.tensor([5, -1, 0, 11, 3, -1, 7, 2, 1, 4, 6, 8, 9, 10, -1, -1])
    words, scales = to_fragments(weight.blocks, weight.scales, order)
    values = from_fragments(words, scales, 16, 64)
    dense = weight.dequantize()
    for row, source in enumerate(order.tolist()):
        expected = dense[:, source] if source >= 0 else torch.zeros_like(dense[:, 0])
        assert torch.equal(values[:, row], expected), row


@pytest.mark.parametrize("inner", [16, 20])
def test_gate_up_tiles_pair_each_columns_gate_and_up(inner):
    rows = gate_up_rows(inner, "cpu")
    tile = rows[:16]
    assert tile[:8].tolist() == list(range(8))
    assert tile[8:].tolist() == list(range(inner, inner + 8))
    weight = _mxfp4(2, 2 * inner, 64, seed=inner)
    packed = Mxfp4Fragments.pack(weight.blocks, weight.scales, gate_up=True)
    assert packed.shape == (2, 2 * inner, 64)
    assert torch.equal(packed.dequantize(), dequantize_mxfp4(weight.blocks, weight.scales))


@triton.jit
def sums_kernel(x_ptr, w_ptr, s_ptr, out_ptr, expert, NT: tl.constexpr, KC: tl.constexpr,
                K: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr, CH: tl.constexpr,
                NO_ASM: tl.constexpr, FORMAT: tl.constexpr = 0, GC: tl.constexpr = 1,
                NG: tl.constexpr = 1):  # fmt: skip
    """out[row] = frag_gemv's float32 sum of each packed row, as the lanes t = 0 hold them
    (FORMAT 0: MXFP4; test_int4_fragments.py runs the int4 formats)."""
    tile0 = tl.program_id(0) * WARPS
    sum_g, sum_h = frag_gemv(x_ptr, w_ptr, s_ptr, expert, tile0, NT, KC, K, WARPS, KSPLIT, CH,
                             NO_ASM, FORMAT, GC, NG)  # fmt: skip
    m = tl.arange(0, WARPS * 32)
    rows = (tile0 + m // 32) * 16 + (m % 32) // 4
    ok = (m % 4 == 0) & (tile0 + m // 32 < NT)
    tl.store(out_ptr + rows, sum_g, mask=ok)
    tl.store(out_ptr + rows + 8, sum_h, mask=ok)


@pytest.mark.parametrize("rows, cols, tiles", [(48, 288, (1, 2, 2)), (16, 64, (2, 1, 1)),
                                               (40, 96, (1, 4, 1)), (40, 640, (1, 2, 2)),
                                               (24, 1024, (2, 2, 2))])  # fmt: skip
def test_frag_gemv_sums_each_row_against_x(rows, cols, tiles):
    """Every row's sum in float32, before any rounding: the layout, the decode, the scales and
    the split over lanes, chunks and warps; padding rows and columns add nothing. The shapes
    give an iteration's chunks (split x chunks) a tail, none, whole iterations before a tail
    (640 columns: 10 chunks over 4), and whole iterations only (1024: 16 over 4)."""
    weight = _mxfp4(2, rows, cols, seed=cols, low=112, high=130)
    fragments = Mxfp4Fragments.pack(weight.blocks, weight.scales)
    xs = [torch.randn(cols, generator=torch.Generator().manual_seed(4)), torch.eye(cols)[cols - 5]]
    for x in (x.bfloat16().to(DEVICE) for x in xs):  # random, and one column: each code alone
        warps, split, chunks = tiles
        out = torch.zeros(fragments.tiles * 16, device=DEVICE)
        sums_kernel[(triton.cdiv(fragments.tiles, warps),)](
            x, fragments.words, fragments.scales, out, 1, NT=fragments.tiles,
            KC=fragments.chunks, K=cols, WARPS=warps, KSPLIT=split, CH=chunks,
            NO_ASM=not bf16x2_asm(x.device), num_warps=warps * split,
        )  # fmt: skip
        ref = weight.dequantize()[1].double() @ x.double()
        assert torch.allclose(out[:rows].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
        assert not out[rows:].any()


def _reference(x, ids, weights, gate_up, down, gate_bias, down_bias, limit=7.0, alpha=1.702):
    """gpt-oss's experts in float32, rounded to bfloat16 where the kernels round."""
    inner = down.shape[2]
    out = torch.zeros(x.shape[0], down.shape[1])
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[token, slot])
            h = x[token].float() @ gate_up.dequantize()[e].T
            h = (h + (gate_bias[e].float() if gate_bias is not None else 0)).bfloat16().float()
            gate, up = h[:inner].clamp(max=limit), h[inner:].clamp(-limit, limit)
            act = ((up + 1) * gate * torch.sigmoid(gate * alpha)).bfloat16().float()
            y = act @ down.dequantize()[e].T
            y = (y + (down_bias[e].float() if down_bias is not None else 0)).bfloat16().float()
            out[token] += weights[token, slot] * y
    return out.bfloat16().float()


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("tiles", [((1, 4, 4), (2, 4, 2)), ((2, 1, 1), (1, 2, 2))])
def test_the_fragment_experts_compute_gpt_oss_experts(biases, tiles, monkeypatch):
    """hidden 96 (a chunk and a half), inner 64 over tiles of 8 columns, two slots. Triton's
    interpreter truncates float32 to bfloat16 where a GPU rounds (four roundings in a row
    here), hence the tolerance; frag_gemv's own sums are checked exactly above."""
    monkeypatch.setattr(moe_triton, "FRAG_TILES", tiles)
    experts, hidden, inner = 4, 96, 64
    gen = torch.Generator().manual_seed(1)
    gate_up, down = _mxfp4(experts, 2 * inner, hidden, seed=2), _mxfp4(experts, hidden, inner, 3)
    x = torch.randn(1, hidden, generator=gen).bfloat16().to(DEVICE)
    ids = torch.tensor([[2, 0]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3]], device=DEVICE)
    gate_bias = down_bias = None
    if biases:
        gate_bias = (torch.randn(experts, 2 * inner, generator=gen) * 0.5).bfloat16().to(DEVICE)
        down_bias = (torch.randn(experts, hidden, generator=gen) * 0.5).bfloat16().to(DEVICE)
    ours = moe_triton.experts(
        x, ids, weights, Mxfp4Fragments.pack(gate_up.blocks, gate_up.scales, gate_up=True),
        Mxfp4Fragments.pack(down.blocks, down.scales), 7.0, 1.702, gate_bias, down_bias,
    ).float().cpu()
    ref = _reference(x.cpu(), ids.cpu(), weights.cpu(), *(
        Mxfp4Weight(w.blocks.cpu(), w.scales.cpu()) for w in (gate_up, down)),
        *(b.cpu() if b is not None else None for b in (gate_bias, down_bias)))  # fmt: skip
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 4e-2 * scale, ((ours - ref).abs().max(), scale)


@pytest.mark.parametrize("tokens, top_k, dtype", [(5, 4, torch.float32), (1, 2, torch.float32),
                                                  (3, 4, torch.float16)])  # fmt: skip
def test_the_sorted_layout_reads_fragments(tokens, top_k, dtype, monkeypatch):
    """More pairs than the GEMV layout takes, or an x the mma cannot multiply (float32 and
    float16 here): pairs sorted by expert, tl.dot over tiles decoded from the words."""
    from noesis.kernels import moe

    monkeypatch.setattr(moe_triton, "FRAG_SORTED_TILES", (2, 2))
    experts, hidden, inner = 8, 96, 64
    gen = torch.Generator().manual_seed(tokens)
    gate_up, down = _mxfp4(experts, 2 * inner, hidden, seed=4), _mxfp4(experts, hidden, inner, 5)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    gate_bias = (torch.randn(experts, 2 * inner, generator=gen) * 0.5).to(dtype).to(DEVICE)
    down_bias = (torch.randn(experts, hidden, generator=gen) * 0.5).to(dtype).to(DEVICE)
    ids, weights = ids.to(DEVICE), weights.to(DEVICE)
    frags = (Mxfp4Fragments.pack(gate_up.blocks, gate_up.scales, gate_up=True),
             Mxfp4Fragments.pack(down.blocks, down.scales))  # fmt: skip
    ours = moe_triton.experts(x, ids, weights, *frags, 7.0, 1.702, gate_bias, down_bias)
    dense = [w.dequantize(dtype) for w in (gate_up, down)]
    ref = moe.gathered(x, ids, weights, *dense, moe.Activation(7.0), gate_bias, down_bias)
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours.float() - ref.float()).abs().max().item() <= tol * scale


def test_projections_packed_for_the_other_place_are_refused():
    gate_up, down = _mxfp4(2, 64, 32), _mxfp4(2, 32, 32)
    as_down = Mxfp4Fragments.pack(gate_up.blocks, gate_up.scales)  # gate_up=False
    x = torch.randn(1, 32, device=DEVICE).bfloat16()
    one = torch.ones(1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="gate_up's fragments were packed as down's"):
        moe_triton.experts(x, one.long() * 0, one, as_down,
                           Mxfp4Fragments.pack(down.blocks, down.scales), 7.0, 1.702)  # fmt: skip
