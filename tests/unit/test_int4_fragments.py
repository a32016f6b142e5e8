"""int4 group-quantized weights as tensor-core fragments (quant/int4_fragments.py,
kernels/int4_mma.py through kernels/frag_gemv.py): the layout against the stored layout's
dequantization, and the decode GEMV's float32 sums against float64, interpreted on the CPU (each
lane's share of an mma in float32 Triton operations, over the operands the PTX takes). On a CUDA
machine the same tests run the inline mma.sync."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET)
from test_mxfp4_mma import sums_kernel  # noqa: E402

from noesis.kernels.asm import bf16x2_asm  # noqa: E402
from noesis.kernels.frag_gemv import INT4_BF16, INT4_F16  # noqa: E402
from noesis.quant import kernel  # noqa: E402
from noesis.quant.int4_fragments import Int4Fragments  # noqa: E402
from noesis.quant.linear import dequantize, group_index  # noqa: E402
from noesis.quant.packing import pack  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _int4(rows, cols, group, dtype, seed=0):
    """A PackedLinear's int4 tensors (codes, scales, zero points) and the codes [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32, generator=gen)
    groups = cols // group
    scales = (torch.rand(rows, groups, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (rows, groups), generator=gen).to(dtype)
    return pack(codes, 4), scales, zeros, codes


def _exact(codes, scales, zeros, group):
    """(code - zero) * scale in float64 [N, K]."""
    per = lambda t: t.double().repeat_interleave(group, dim=1)  # noqa: E731
    return (codes.double() - per(zeros)) * per(scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, cols, group", [(48, 256, 128), (40, 192, 64), (16, 128, 128)])
def test_the_layout_holds_every_code_scale_and_zero(dtype, rows, cols, group):
    qweight, scales, zeros, codes = _int4(rows, cols, group, dtype, seed=rows + cols)
    frags = Int4Fragments.pack(qweight, scales, zeros, group)
    assert frags.words.shape == (-(-rows // 16), cols // 64, 32, 4)
    assert frags.params.shape == (-(-rows // 16), cols // group, 8, 2)
    assert torch.equal(frags.dequantize().double(), _exact(codes, scales, zeros, group))
    # the stored layout's own dequantization, rounded to the dtype as it rounds
    stored = dequantize(qweight, scales, zeros, group_index(None, cols, group, "cpu"), 4)
    assert torch.equal(frags.dequantize(dtype), stored)
    # a code moved by one nibble is found
    bad = frags.words.clone()
    bad[0, 0, 5, 1] ^= 0x10
    moved = Int4Fragments(bad, frags.params, rows, cols, group, dtype)
    assert not torch.equal(moved.dequantize(), frags.dequantize())


def test_packing_in_blocks_of_rows_gives_the_same_layout(monkeypatch):
    """Int4Fragments.pack works PACK_ROWS rows at a time (bounded temporaries at load): blocks
    of 16 rows, the last one partial, give what one block gives."""
    from noesis.quant import int4_fragments

    qweight, scales, zeros, _ = _int4(56, 128, 64, torch.bfloat16, seed=4)
    whole = Int4Fragments.pack(qweight, scales, zeros, 64)
    monkeypatch.setattr(int4_fragments, "PACK_ROWS", 16)
    blocks = Int4Fragments.pack(qweight, scales, zeros, 64)
    assert torch.equal(blocks.words, whole.words) and torch.equal(blocks.params, whole.params)
    assert blocks.words.shape[0] == 4


def test_what_the_layout_cannot_hold_is_refused():
    qweight, scales, zeros, _ = _int4(16, 128, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 64"):
        Int4Fragments.pack(qweight, scales, zeros, 32)
    qweight, scales, zeros, _ = _int4(16, 128, 128, torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Int4Fragments.pack(qweight, scales, zeros, 128)


@pytest.mark.parametrize("dtype, form", [(torch.bfloat16, INT4_BF16), (torch.float16, INT4_F16)])
@pytest.mark.parametrize("rows, cols, group, tiles", [
    (48, 256, 128, (1, 2, 1)), (40, 384, 64, (2, 1, 2)), (24, 128, 128, (1, 1, 1)),
    (32, 256, 256, (1, 2, 2)),
])  # fmt: skip
def test_frag_gemv_sums_each_row_against_x(dtype, form, rows, cols, group, tiles):
    """Every row's sum in float32 before any rounding: codes less zeros times x, each group
    scaled once, split over lanes, chunks and warps; padding rows add nothing."""
    qweight, scales, zeros, codes = _int4(rows, cols, group, dtype, seed=cols + group)
    frags = Int4Fragments.pack(qweight, scales, zeros, group)
    gen = torch.Generator().manual_seed(7)
    for x in (torch.randn(cols, generator=gen), torch.eye(cols)[cols - 3]):
        x = x.to(dtype).to(DEVICE)  # random, and one column: each code alone
        warps, split, chunks = tiles
        out = torch.zeros(frags.tiles * 16, device=DEVICE)
        sums_kernel[(triton.cdiv(frags.tiles, warps),)](
            x, frags.words.to(DEVICE), frags.params.to(DEVICE), out, 0, NT=frags.tiles,
            KC=frags.chunks, K=cols, WARPS=warps, KSPLIT=split, CH=chunks,
            NO_ASM=not bf16x2_asm(x.device), FORMAT=form, GC=group // 64, NG=frags.groups,
            num_warps=warps * split,
        )  # fmt: skip
        ref = _exact(codes, scales, zeros, group) @ x.cpu().double()
        assert torch.allclose(out[:rows].cpu().double(), ref, rtol=1e-5,
                              atol=1e-5 * ref.abs().max())  # fmt: skip
        assert not out[rows:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fragment_gemv_equals_the_stored_layouts_matmul(dtype):
    """The launch wrapper over rows of x, against dequantize-then-matmul in float32 (rounded once
    at the end; the interpreter truncates where a GPU rounds, hence 1%)."""
    rows, cols, group = 40, 256, 128
    qweight, scales, zeros, codes = _int4(rows, cols, group, dtype, seed=3)
    frags = Int4Fragments.pack(qweight, scales, zeros, group)
    frags.words, frags.params = frags.words.to(DEVICE), frags.params.to(DEVICE)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ref = x.cpu().double() @ _exact(codes, scales, zeros, group).T
    y = kernel.fragment_gemv(x, frags)
    assert y.shape == (3, rows) and y.dtype == dtype
    assert torch.allclose(y.cpu().double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())
    with pytest.raises(ValueError, match="does not match"):
        kernel.fragment_gemv(x.float(), frags)


@pytest.mark.parametrize("rows, tiles, dtype", [
    (1, (1, 2, 1, 1), torch.bfloat16), (6, (2, 1, 2, 1), torch.float16),
    (13, (1, 2, 1, 2), torch.bfloat16), (13, (1, 1, 1, 2, 8), torch.float16)])  # fmt: skip
def test_fragment_rows_put_each_row_of_x_in_its_own_mma_column(rows, tiles, dtype):
    """Several rows of x at once (x's rows as the mma's B columns, eight a group, a weight chunk
    decoded once for all groups): every output against dequantize-then-matmul, across partial
    groups, two groups a program, a partial last tile, K split over warps, two tiles a warp
    (40 columns: three tiles, the fourth past the end), and two programs along M (at most 8
    rows a program: the tiles' fifth element)."""
    n, cols, group = 40, 128, 64
    qweight, scales, zeros, codes = _int4(n, cols, group, dtype, seed=rows)
    frags = Int4Fragments.pack(qweight, scales, zeros, group)
    frags.words, frags.params = frags.words.to(DEVICE), frags.params.to(DEVICE)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = kernel.fragment_rows(x.to(DEVICE), frags, tiles)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = x.double() @ _exact(codes, scales, zeros, group).T
    assert torch.allclose(y.cpu().double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())


@pytest.mark.parametrize("rows, n, k, group", [(5, 40, 256, 128), (20, 48, 192, 64)])
def test_fragment_matmul_equals_dequantize_then_matmul(rows, n, k, group):
    """Many rows through tl.dot over decoded fragment tiles, K in one program or split over
    two or three (float16: the interpreter's bfloat16 tl.dot is wrong; a GPU runs both)."""
    dtypes = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    for dtype in dtypes:
        qweight, scales, zeros, codes = _int4(n, k, group, dtype, seed=rows)
        frags = Int4Fragments.pack(qweight, scales, zeros, group)
        frags.words, frags.params = frags.words.to(DEVICE), frags.params.to(DEVICE)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)).to(dtype)
        weight = frags.dequantize(dtype).double().cpu()  # rounded as the kernel rounds it
        ref = x.double() @ weight.T
        for split in (1, 2, 3):  # K over programs: 4 chunks in 1, 2, 2; 3 chunks in 1, 1, 3
            y = kernel.fragment_matmul(x.to(DEVICE), frags, split)
            assert y.shape == (rows, n) and y.dtype == dtype
            assert torch.allclose(y.cpu().double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())


@pytest.mark.parametrize("n, k, group", [(40, 256, 128), (48, 192, 64)])
def test_fragment_dequantize_and_the_dense_prefill(n, k, group, monkeypatch):
    """The fragments dequantized on their device equal Int4Fragments.dequantize (float16 on the
    CPU: the interpreter's bfloat16 conversion truncates; a GPU runs both), and from
    FRAG_DENSE_ROWS rows fragment_linear multiplies x by them (a partial last tile included)."""
    monkeypatch.setattr(kernel, "FRAG_DENSE_ROWS", kernel.FRAG_ROWS_MAX + 1)
    for dtype in [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []):
        qweight, scales, zeros, codes = _int4(n, k, group, dtype, seed=n)
        frags = Int4Fragments.pack(qweight, scales, zeros, group)
        want = frags.dequantize(dtype)
        frags.words, frags.params = frags.words.to(DEVICE), frags.params.to(DEVICE)
        assert torch.equal(kernel.fragment_dequantize(frags, dtype).cpu(), want)
        x = torch.randn(kernel.FRAG_ROWS_MAX + 1, k, generator=torch.Generator().manual_seed(3))
        y = kernel.fragment_linear(x.to(dtype).to(DEVICE), frags)
        ref = x.to(dtype).double() @ want.double().T
        assert torch.allclose(y.cpu().double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())


def _packed_linear(k, n, bits, group, dtype=torch.bfloat16):
    from noesis.quant.linear import PackedLinear
    from noesis.quant.scheme import WeightQuant

    layer = PackedLinear(k, n, False, WeightQuant("awq", bits, group)).to(dtype)
    gen = torch.Generator().manual_seed(9)
    groups = k // layer.group_size
    layer.qweight.data = pack(torch.randint(0, 1 << bits, (n, k), dtype=torch.int32,
                                            generator=gen), bits)  # fmt: skip
    layer.scales.data = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(dtype)
    layer.qzeros.data = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(dtype)
    return layer


def test_packed_linear_reads_fragments_by_the_launch_that_suits_its_rows(monkeypatch):
    """Once laid out as fragments (what a CUDA load does, quant.linear.INT4_FRAGMENTS), a
    PackedLinear holds only them (the stored tensors freed, the fragments buffers that follow
    the module), dequantizes to the same weights, reads one row through the mma GEMV and three
    rows with the rows as the mma's columns (both equal to dequantize-then-matmul), more than
    FRAG_ROWS_MAX rows through the fragment matmul (only the dispatch is checked here: the
    interpreter's bfloat16 tl.dot is wrong), and never calls the stored layout's kernel."""
    from noesis.quant import linear

    layer = _packed_linear(256, 48, 4, 128).to(DEVICE)
    weight = layer.dequantize()
    assert linear.fragment_projections(torch.nn.Sequential(layer)) == 1
    assert layer.qweight is None and layer.scales is None and layer.qzeros is None
    assert {name for name, _ in layer.named_parameters()} == set()
    assert {name for name, _ in layer.named_buffers()} == {"fragment_words", "fragment_params"}
    assert torch.equal(layer.dequantize(), weight)
    assert layer.use_fragments()  # a second call keeps them
    stored, matmul = [], []
    monkeypatch.setattr(kernel, "packed_matmul", lambda x, *a: stored.append(x.shape[0]))
    monkeypatch.setattr(kernel, "fragment_matmul",
                        lambda x, f: matmul.append(x.shape[0]) or x.new_zeros(x.shape[0], 48))
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=gen).bfloat16().to(DEVICE)
        ref = x.double() @ weight.double().T
        assert torch.allclose(layer(x).double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max())
    many = kernel.FRAG_ROWS_MAX + 1
    layer(torch.randn(many, 256, generator=gen).bfloat16().to(DEVICE))
    assert (stored, matmul) == ([], [many])
    moved = layer.to("meta")
    assert moved.fragments.words.device.type == "meta"


def test_only_fitting_projections_take_fragments():
    assert not _packed_linear(256, 32, 8, 128).use_fragments()  # int8
    assert not _packed_linear(256, 32, 4, 32).use_fragments()  # groups of 32
    assert not _packed_linear(256, 32, 4, 128, torch.float32).use_fragments()
    act_order = _packed_linear(256, 32, 4, 128)
    act_order.act_order = True
    assert not act_order.use_fragments() and act_order.fragments is None


def test_fragment_config_reads_the_sweeps_file_for_this_gpu(tmp_path, monkeypatch):
    qweight, scales, zeros, _ = _int4(48, 256, 128, torch.bfloat16)
    frags = Int4Fragments.pack(qweight, scales, zeros, 128)
    assert kernel.fragment_key(frags) == "48,256,bfloat16"
    path = tmp_path / "frag_configs.json"
    path.write_text('{"cpu": {"48,256,bfloat16": [2, 8, 1], "48,256,bfloat16,16": [1, 2, 1, 2]},'
                    ' "other": {"1,1,x": [1, 1, 1]}}')
    monkeypatch.setattr(kernel, "FRAG_CONFIG_FILE", path)
    kernel._device_frag_configs.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert kernel.fragment_config(frags, cpu) == (2, 8, 1)
        assert kernel.fragment_rows_config(frags, 9, cpu) == (1, 2, 1, 2)  # rows 9-16
        assert kernel.fragment_rows_config(frags, 30, cpu) == kernel.FRAG_ROWS_TILES[32]
        other = Int4Fragments.pack(*_int4(16, 128, 128, torch.bfloat16)[:3], 128)
        assert kernel.fragment_config(other, cpu) == kernel.FRAG_TILES
    finally:
        kernel._device_frag_configs.cache_clear()
