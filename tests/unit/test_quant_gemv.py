"""The decode kernel (noesis.quant.kernel._packed_gemv) under TRITON_INTERPRET=1 against a float64
reference weight, across the launch configurations the sweep can pick: CUDA-core FMAs and
tl.dot, splits over K, K tiles spanning several groups or part of one, odd shapes, act-order, and
the GGUF variants (constant zero point, minimums, float16 scales). float32 and float16 inputs:
the interpreter's bfloat16 dot is not exact."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_gguf_packed import packed_rows
from test_quant_linear import packed_layer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from noesis.quant import kernel  # noqa: E402
from noesis.quant.kernel import GemvConfig  # noqa: E402
from noesis.quant.packing import pack  # noqa: E402

# The one-row kernel sums 2^BITS * (1 + code / 2^BITS) * x and subtracts (2^BITS + zero) * sum x
# per word: float32 rounding of those larger terms, about 1e-6 (bfloat16's is 4e-3).
FLOAT32_ERROR = 1e-5
CONFIGS = {
    "fma": GemvConfig(8, 64),
    "fma tile past groups": GemvConfig(4, 256, warps=8, stages=1),
    "fma split": GemvConfig(16, 32, split_k=3),
    "dot": GemvConfig(16, 64, dot=True),
    "dot split": GemvConfig(32, 128, split_k=2, dot=True),
    "batch": GemvConfig(64, 128, dot=True),  # 17-128 rows: tiles of 32 or 64 rows of x
    "batch group tile": GemvConfig(16, 32, split_k=2, dot=True),  # Q4_K: a group per K tile
}


@pytest.fixture
def poisoned_call(monkeypatch):
    """packed_matmul with its output (and split partials) allocated full of NaN: an element
    the kernel fails to write shows."""
    empty = torch.empty

    def call(x, args, config):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
            return kernel.packed_matmul(x, *args, config=config)

    return call


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


ONE_ROW = [  # (m, n, k, bits, group size, act-order): the CUDA-core kernel's shapes
    (1, 40, 384, 4, 128, False),  # N not a multiple of the rows per program
    (1, 24, 256, 4, 32, False),  # several groups per tile
    (1, 56, 96, 8, -1, False),  # int8 per channel, K not a power of two: tiles past K
    (1, 32, 320, 8, 64, False),
]
DOT_ONLY = [  # shapes the dot kernel takes whatever the config
    (1, 48, 192, 4, 64, True),  # act-order: each column's group looked up
    (2, 16, 192, 4, 96, False),  # a group no tile divides: looked up per column
    (3, 24, 256, 4, 32, False),
    (16, 32, 320, 8, 64, False),
]
CASES = ([("fma", *shape) for shape in ONE_ROW]
         + [("fma tile past groups", *ONE_ROW[i]) for i in (0, 3)]
         + [("fma split", *ONE_ROW[i]) for i in (1, 2)]
         + [("dot", *shape) for shape in DOT_ONLY + ONE_ROW[:1]]
         + [("dot split", *DOT_ONLY[i]) for i in (0, 3)] + [("dot split", *ONE_ROW[2])]
         + [("batch", 40, 48, 256, 4, 128, False),  # one group per tile: scaled after the dot
            ("batch", 20, 40, 384, 8, -1, False),  # a 32-row tile, int8 per channel
            ("batch", 100, 24, 256, 4, 32, False),  # two 64-row tiles, runs of 32 per tile
            ("batch", 72, 16, 192, 4, 64, True)])  # act-order, K past the last tile


@pytest.mark.parametrize(("config", "m", "n", "k", "bits", "group_size", "act_order"), CASES)
def test_gemv_equals_the_reference(poisoned_call, config, m, n, k, bits, group_size,
                                   act_order):
    layer, weight = packed_layer(n, k, bits, group_size, act_order, seed=m + n)
    x = torch.randn(m, k)
    groups = layer.g_idx[0] if layer.act_order else None
    args = (layer.qweight, layer.scales, layer.qzeros, groups, bits, layer.group_size)
    got = poisoned_call(x, args, CONFIGS[config])
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert relative_error(got, F.linear(x.double(), weight)) < FLOAT32_ERROR


@pytest.mark.parametrize(("config", "m"), [("fma", 1), ("dot split", 4)])
def test_float16_within_its_rounding(poisoned_call, config, m):
    """float16 activations: within float16's rounding of the weight (the dot kernel rounds it
    once, as the portable path does; the one-row kernel keeps it in float32)."""
    layer, weight = packed_layer(32, 256, 4, 64, dtype=torch.float16, seed=3)
    x = torch.randn(m, 256).half()
    args = (layer.qweight, layer.scales, layer.qzeros, None, 4, 64)
    got = poisoned_call(x, args, CONFIGS[config])
    expected = F.linear(x.double(), weight.half().double())
    assert relative_error(got, expected) < 2e-3


@pytest.mark.parametrize(
    ("config", "m", "qtype"),
    [("fma", 1, "Q4_0"), ("fma", 1, "Q4_1"), ("fma", 1, "Q8_0"), ("fma", 1, "Q4_K"),
     ("fma tile past groups", 1, "Q6_K"), ("dot split", 2, "Q4_K"), ("dot split", 2, "Q6_K"),
     ("batch", 33, "Q4_K"), ("batch group tile", 65, "Q4_K"), ("batch group tile", 24, "Q8_0")],
)
def test_gguf_blocks(poisoned_call, config, m, qtype):
    """Constant zero points, minimums (Q4_1, Q4_K), float32 scales (K-quants), group 16."""
    layer, reference = packed_rows(qtype, 24, 512, seed=4)
    x = torch.randn(m, 512)
    args = (layer.qweight, layer.scales, layer.layout.zero, None, layer.bits,
            layer.layout.group, layer.mins)
    got = poisoned_call(x, args, CONFIGS[config])
    assert relative_error(got, F.linear(x.double(), reference.double())) < FLOAT32_ERROR


def test_configs_come_from_the_table_per_device(tmp_path, monkeypatch):
    """gemv_configs.json is read per GPU name and (bits, N, K, rows bucket); elsewhere, defaults."""
    table = tmp_path / "configs.json"
    table.write_text('{"cpu": {"4,4096,4096,1": [4, 512, 2, 8, 1, 0]}}')
    monkeypatch.setattr(kernel, "CONFIG_FILE", table)
    monkeypatch.setattr(kernel, "_device_name", lambda device: device.type)
    kernel._device_configs.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert kernel.gemv_config(4, 4096, 4096, 1, cpu) == GemvConfig(4, 512, 2, 8, 1, False)
        assert kernel.gemv_config(4, 4096, 4096, 9, cpu) == kernel.default_gemv_config(4, 9)
        assert kernel.config_key(8, 6144, 4096, 9) == "8,6144,4096,16"
        assert [kernel.config_key(4, 6144, 4096, m)[-3:] for m in (16, 17, 64, 128)] == [
            ",16", ",64", ",64", ",64"]
    finally:
        kernel._device_configs.cache_clear()


def test_batch_tiles_match_the_batch():
    """BLOCK_M follows the rows (the MMA's N side: 16, 32, 64), and a 128-row batch runs as two
    64-row tiles; past BATCH_ROWS rows, prefill's kernel."""
    assert [kernel.block_rows(m) for m in (2, 16, 17, 32, 33, 64, 128)] == [
        16, 16, 32, 32, 64, 64, 64]
    assert kernel.rows_bucket(1) == 1 and kernel.rows_bucket(17) == kernel.BATCH_BUCKET
    assert kernel.default_gemv_config(4, 64) == GemvConfig(64, 128, dot=True)


def test_rows_past_the_batch_take_the_prefill_kernel(monkeypatch):
    layer, weight = packed_layer(16, 128, 4, 128, False, seed=5)
    x = torch.randn(kernel.BATCH_ROWS + 1, 128)
    monkeypatch.setattr(kernel, "_packed_gemv_dot", None)  # a decode launch would fail
    got = kernel.packed_matmul(x, layer.qweight, layer.scales, layer.qzeros, None, 4, 128)
    assert relative_error(got, F.linear(x.double(), weight)) < FLOAT32_ERROR


# bfloat16 input, 4-bit codes: the one-row kernel sums (code - zero) * x per word from x's
# bfloat16 pairs (_pair_dots; under the interpreter each product and sum exact, the output
# rounded to bfloat16 by truncation, 2e-3 to 3e-3). A pair taken from the wrong columns, or a
# zero point left out, is off by tens of percent.
@pytest.mark.parametrize(("config", "n", "k", "group_size", "zero"), [
    ("fma", 40, 384, 128, None),  # tensor zero points, N past the last program's rows
    ("fma", 24, 256, 32, 8),  # a constant zero point (GPTQ symmetric, GGUF Q4_0), 4 groups a tile
    ("fma tile past groups", 40, 384, 128, None),  # K tiles of 256 past K = 384
    ("fma split", 24, 256, 32, None),
])
def test_bfloat16_pairs_within_its_rounding(poisoned_call, config, n, k, group_size, zero):
    layer, weight = packed_layer(n, k, 4, group_size, dtype=torch.bfloat16, seed=n + k)
    x = torch.randn(1, k).bfloat16()
    if zero is None:
        zeros = layer.qzeros
    else:
        zeros, weight = zero, _with_zero(layer, weight, group_size, zero)
    args = (layer.qweight, layer.scales, zeros, None, 4, group_size)
    got = poisoned_call(x, args, CONFIGS[config])
    assert got.dtype == torch.bfloat16
    assert relative_error(got, F.linear(x.double(), weight)) < 6e-3


def _with_zero(layer, weight, group_size, zero):
    """The reference weight with every group's zero point replaced by `zero`."""
    zeros = layer.qzeros.double().repeat_interleave(group_size, 1)
    scales = layer.scales.double().repeat_interleave(group_size, 1)
    return weight + (zeros - zero) * scales


@triton.jit
def _pairs_kernel(words_ptr, x_ptr, scale_ptr, zero_ptr, out_ptr, FROM_FLOATS: tl.constexpr,
                  ROWS: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """_pair_dots over [ROWS, R, W] words with x's pairs made by _pairs_of_floats (from the
    float32 tile) or _pairs_of_words (from the bfloat16 input in memory)."""
    words_in = tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
    rows = tl.arange(0, ROWS)
    at = rows[:, None, None] * (R * W) + words_in[None, :, :]
    words = tl.load(words_ptr + at).to(tl.uint32, bitcast=True)
    run = rows[:, None] * R + tl.arange(0, R)[None, :]
    scale, zero = tl.load(scale_ptr + run), tl.load(zero_ptr + run)
    if FROM_FLOATS:
        codes_in = words_in[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        x = tl.load(x_ptr + codes_in).to(tl.float32)
        p0, p1, p2, p3 = kernel._pairs_of_floats(x, False)
    else:
        p0, p1, p2, p3 = kernel._pairs_of_words(x_ptr, 0, words_in, R * W * 8, False)
    tl.store(out_ptr + at, kernel._pair_dots(words, scale, zero, p0, p1, p2, p3, False))


@pytest.mark.parametrize("from_floats", [True, False])
def test_pair_dots_sum_each_word_against_its_columns(from_floats):
    """The helpers the bfloat16 4-bit path shares: per word, sum over its eight codes of
    (code - zero) * scale * x, x's pairs made either way (exact in float32 here; on a GPU the
    same arithmetic runs in bfloat16x2 inline PTX, tests/gpu/test_quant_cuda.py)."""
    rows, runs, width = 4, 2, 4
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (rows, runs, width, 8), generator=gen)
    words = pack(codes.reshape(rows, -1), 4).reshape(rows, runs, width)
    x = torch.randn(runs * width * 8, generator=gen).bfloat16()
    scale = torch.rand(rows, runs, generator=gen) + 0.5
    zero = torch.randint(0, 16, (rows, runs), generator=gen).float()
    out = torch.full((rows, runs, width), float("nan"))
    source = x.float() if from_floats else x
    _pairs_kernel[(1,)](words, source, scale, zero, out, FROM_FLOATS=from_floats, ROWS=rows,
                        R=runs, W=width)
    xs = x.double().reshape(runs, width, 8)
    expected = ((codes.double() - zero.double()[:, :, None, None]) * xs[None]).sum(-1)
    expected *= scale.double()[:, :, None]
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_an_input_at_an_odd_column_is_copied_before_its_words_are_read():
    """The bfloat16 pairs read x as int32 words: a row slice starting at an odd column (2-byte
    aligned only) would fault on a GPU, so it is copied first; the result is the same."""
    from noesis.kernels.asm import word_aligned

    layer, weight = packed_layer(24, 256, 4, 32, dtype=torch.bfloat16, seed=9)
    wide = torch.randn(1, 257).bfloat16()
    x = wide[:, 1:]
    assert x.data_ptr() % 4 != 0
    aligned = word_aligned(x)
    assert aligned is not x and aligned.data_ptr() % 4 == 0 and torch.equal(aligned, x)
    assert word_aligned(aligned) is aligned
    args = (layer.qweight, layer.scales, layer.qzeros, None, 4, 32)
    got = kernel.packed_matmul(x, *args, config=CONFIGS["fma"])
    assert torch.equal(got, kernel.packed_matmul(x.clone(), *args, config=CONFIGS["fma"]))
    assert relative_error(got, F.linear(x.double(), weight)) < 6e-3
