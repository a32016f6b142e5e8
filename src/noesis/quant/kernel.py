"""The dequantizing matmul on CUDA: y = x @ dequantize(W)^T with W packed as in
noesis.quant.packing (rows of int32 words along K), three Triton kernels.

- one row (decode at batch 1), `_packed_gemv`: a program streams BLOCK_N whole packed rows
  (16-byte loads per thread along K, coalesced) and sums them word by word inside each thread
  on the CUDA cores: 4-bit codes against a bfloat16 input in bfloat16x2 inline PTX (about 3.3
  sm_90 SASS instructions a code in the loop, 5 before), otherwise in float32; a float32
  accumulator tile is summed once at the end, as the bf16 row GEMV does.
- up to BATCH_ROWS rows (decode batches), act-order, or groups no tile fits, `_packed_gemv_dot`:
  the same row tiles dequantized in registers as tl.dot's left operand, x^T the right one,
  BLOCK_M (16, 32 or 64 rows of x per program) matched to the batch.
- prefill, `_packed_matmul`: square-ish tiles over M and N, the whole of K per program.

Decode launches take BLOCK_N, BLOCK_K, the split over K, warps and pipeline stages per (bits, N,
K, rows bucket: 1, DECODE_ROWS or BATCH_BUCKET) from gemv_configs.json beside this file
(benchmarks/quant_gemv_sweep.py writes it per GPU model), else defaults. Narrow BLOCK_N gives
N / BLOCK_N programs, several per SM, so most
shapes need no split over K; where one is configured, the float32 partials are summed in a fixed
order (deterministic, no atomics). No host sync and only stream-ordered allocations: the
launches capture into CUDA graphs. Checked against the portable path and a float64 reference
under TRITON_INTERPRET=1 (tests/unit/test_quant_linear.py, test_quant_gemv.py; the inline
PTX runs only on a GPU: tests/gpu/test_quant_cuda.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from noesis.kernels import pdl
from noesis.kernels.asm import bf16_pairs, bf16x2_asm, word_aligned
from noesis.kernels.frag_gemv import (
    INT4_BF16,
    INT4_F16,
    frag_gemv,
    frag_matmul,
    frag_rows,
)
from noesis.kernels.int4_mma import int4_frag_tile
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait
from noesis.quant.int4_fragments import Int4Fragments

DECODE_ROWS = 16  # rows 2..DECODE_ROWS share one tuned config (one 16-row tile)
BATCH_ROWS = 128  # batches up to this many rows take the decode launch; longer ones prefill's
BATCH_BUCKET = 64  # rows DECODE_ROWS+1..BATCH_ROWS share the config tuned at this many rows
MAX_BLOCK_M = 64  # rows of x per decode program; 128 rows run as two programs along M
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs: the default split aims at this
CONFIG_FILE = Path(__file__).with_name("gemv_configs.json")
# The int4 fragment GEMV (kernels/frag_gemv.py over quant/int4_fragments.py): tiles of 16 rows a
# program, warps sharing a tile's chunks, chunks of 64 columns a warp's iteration. MXFP4's best
# on the H200; per GPU model and shape, frag_configs.json beside this file overrides it, written
# by `benchmarks/int4_fragments.py --tiles --save-configs` (and `--rows ... --save-configs` for
# fragment_rows, keyed by the rows bucket too).
FRAG_TILES = (1, 4, 2)
FRAG_CONFIG_FILE = Path(__file__).with_name("frag_configs.json")
# The fragment matmul (more rows): tiles of 16 rows a program (its N block is 16 x this), and
# programs along K (float32 partials, summed in a fixed order; 1: none, not yet timed beyond).
FRAG_MATMUL_TILES = 4
FRAG_MATMUL_SPLIT = 1
# fragment_rows: (warps along N, warps along K, chunks a warp's iteration, tiles a warp) per rows
# bucket (fragment_rows_bucket), the one tiling fastest over the 8B projections on the H200 at
# 8, 16, 32 and 64 rows (benchmarks/RESULTS.md, nineteenth session; frag_configs.json refines it
# per shape), and the most rows of x a program takes (8 a group of the mma's B columns).
FRAG_ROWS_TILES = {8: (1, 4, 2, 2), 16: (1, 4, 2, 1), 32: (1, 4, 2, 2), 64: (1, 4, 1, 2)}
FRAG_ROWS_MAX = 64
# Prefill over fragments: from this many rows, a projection is dequantized once into x's dtype
# and multiplied by torch.matmul (cuBLAS on CUDA; about 4.5 bytes of traffic a weight) instead
# of decoding its tiles again for every block of 64 rows (fragment_matmul: 3.5-3.8x bf16's time
# at 256-1024 rows on the H200). None: never, until timed (`benchmarks/int4_fragments.py --rows
# 256,1024`, its "dequantized + matmul" variant); it needs a projection's weights in x's dtype
# as a temporary.
FRAG_DENSE_ROWS: int | None = None


@dataclass(frozen=True)
class GemvConfig:
    """One decode launch: output rows and K columns per program, programs along K (0: enough
    to reach TARGET_PROGRAMS), warps, software-pipeline stages, tl.dot (else CUDA-core FMAs)."""

    block_n: int
    block_k: int
    split_k: int = 0
    warps: int = 4
    stages: int = 3
    dot: bool = False

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.split_k, self.warps, self.stages, int(self.dot)]


def default_gemv_config(bits: int, rows: int) -> GemvConfig:
    """Untuned: 256 bytes of words per output row per tile; FMAs for one row, an MMA tile for
    more (a 16-row FMA tile costs 16 products per weight on the CUDA cores); past 16 rows a
    square 64 x 64 MMA tile, 128 columns: one AWQ group per tile, scaled after the dot."""
    if rows == 1:
        return GemvConfig(8, 64 * (32 // bits), stages=3)
    if rows <= DECODE_ROWS:
        return GemvConfig(32, 128, dot=True)
    return GemvConfig(64, 128, dot=True)


def rows_bucket(rows: int) -> int:
    """The rows a tuned config is keyed by: 1, DECODE_ROWS (2-16) or BATCH_BUCKET (17-128)."""
    if rows == 1:
        return 1
    return DECODE_ROWS if rows <= DECODE_ROWS else BATCH_BUCKET


def block_rows(rows: int) -> int:
    """BLOCK_M of the tl.dot decode kernel: 16, 32 or 64 (the MMA's N side), matched to the
    batch; a tile of more rows would only add the padding rows' products."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))


def config_key(bits: int, n: int, k: int, rows: int) -> str:
    """gemv_configs.json's key: rows bucketed by rows_bucket."""
    return f"{bits},{n},{k},{rows_bucket(rows)}"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def _device_configs(device: torch.device) -> dict[str, list[int]]:
    """This GPU model's tuned decode configs, by config_key."""
    if not CONFIG_FILE.exists():
        return {}
    return json.loads(CONFIG_FILE.read_text()).get(_device_name(device), {})


def gemv_config(bits: int, n: int, k: int, rows: int, device: torch.device) -> GemvConfig:
    tuned = _device_configs(device).get(config_key(bits, n, k, rows))
    if tuned:
        block_n, block_k, split_k, warps, stages, dot = tuned
        return GemvConfig(block_n, block_k, split_k, warps, stages, bool(dot))
    return default_gemv_config(bits, rows)


@triton.jit
def _packed_gemv(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, y_ptr, N, stride_ys, field,
    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    SUB: tl.constexpr, K_SPLIT: tl.constexpr, EVEN: tl.constexpr, ZERO: tl.constexpr,
    HAS_MIN: tl.constexpr, STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """One row: y[split] [N] = W[:, split's K range] @ x, on the CUDA cores. A K tile is RUNS
    runs of SUB columns, each run inside one group, its words held as [BLOCK_N, RUNS, words per
    run] (16-byte loads along K; EVEN: no tile reaches past K, so no mask splits them) and
    summed word by word: scale, zero point and GGUF's minimum apply per word, not per code.
    The kernel is bound by its instruction rate more than by memory: with a bfloat16 input,
    4-bit codes and no minimums (PAIRS), in bfloat16x2 arithmetic (_pair_dots, inline PTX
    where ASM), otherwise in float32 (_word_dots)."""
    PACK: tl.constexpr = 32 // BITS
    PAIRS: tl.constexpr = BITS == 4 and x_ptr.dtype.element_ty == tl.bfloat16 and not HAS_MIN
    RUNS: tl.constexpr = BLOCK_K // SUB
    WORDS_PER_RUN: tl.constexpr = SUB // PACK
    pid_n, split = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words_in = tl.arange(0, RUNS)[:, None] * WORDS_PER_RUN + tl.arange(0, WORDS_PER_RUN)[None, :]
    codes_in = words_in[:, :, None] * PACK + tl.arange(0, PACK)[None, None, :]  # [R, W, P]
    w_rows = w_ptr + (cols.to(tl.int64) * (K // PACK))[:, None, None]
    acc = tl.zeros([BLOCK_N, RUNS, WORDS_PER_RUN], dtype=tl.float32)
    for step in tl.range(0, K_SPLIT, BLOCK_K, num_stages=STAGES):
        k0 = split * K_SPLIT + step
        ks = k0 + codes_in
        if EVEN:
            words = tl.load(w_rows + (k0 // PACK + words_in)[None, :, :],
                            mask=col_ok[:, None, None], other=0)  # [BN, R, W]
        else:
            words = tl.load(w_rows + (k0 // PACK + words_in)[None, :, :],
                            mask=col_ok[:, None, None] & (k0 + words_in * PACK < K)[None, :, :],
                            other=0)
        words = words.to(tl.uint32, bitcast=True)
        starts = k0 + tl.arange(0, RUNS) * SUB
        at = cols[:, None] * GROUPS + (starts // GROUP)[None, :]  # [BN, R]
        ok = col_ok[:, None] & (starts < K)[None, :]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        zero = _zero_point(z_ptr, at, ok, ZERO, 0)
        if PAIRS:
            p0, p1, p2, p3 = _pairs_of_words(x_ptr, k0, words_in, K, ASM)
            acc += _pair_dots(words, scale, zero, p0, p1, p2, p3, ASM)
        else:
            if EVEN:
                x = tl.load(x_ptr + ks).to(tl.float32)  # [R, W, P]
            else:
                x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            bias = -scale * zero
            if HAS_MIN:
                bias += tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)
            acc += _word_dots(words, scale, bias, x, field.to(tl.uint32, bitcast=True), BITS,
                              BLOCK_N, RUNS, WORDS_PER_RUN)
    y = tl.sum(tl.sum(acc, 2), 1)
    tl.store(y_ptr + split * stride_ys + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _word_dots(words, scale, bias, x, field, BITS: tl.constexpr, D0: tl.constexpr,
               D1: tl.constexpr, D2: tl.constexpr):
    """Per word of `words` [D0, D1, D2] (uint32, code i at bits BITS * i): the sum over its
    codes of (code * scale + bias) * x in float32, from scale and bias per run [D0, D1] (a zero
    point is bias = -zero * scale) and x [D1, D2, 32 // BITS] (float32). Each code is moved
    under a float's mantissa, q = 1 + code / 2^BITS exactly (a shift and a mask-or, no
    integer-to-float conversion; `field`: field_mask(BITS) passed at run time, which ptxas
    keeps as one LOP3), and sum (code s + b) x = 2^BITS s sum q x + (b - 2^BITS s) sum x."""
    SCALE: tl.constexpr = 1 << BITS
    q = _unpack_in_thread(words, BITS, D0, D1, D2, field)  # [D0, D1, D2, P]
    word_x = tl.sum(x, 2)[None, :, :]  # each thread sums its own words' x
    return (tl.sum(q * x[None, :, :, :], 3) * (scale * SCALE)[:, :, None]
            + (bias - scale * SCALE)[:, :, None] * word_x)


# 4-bit codes against a bfloat16 input in bfloat16x2 arithmetic, where _pair_dots runs it:
# x's values in pairs (x_j, x_j+4), j = 0..3, one int32 register each (x_j in the low half),
# shared by the rows a thread holds: from the input's memory by kernels.asm.bf16_pairs, or
# from float32 values (bfloat16 values, so exact), one conversion a pair:
_PAIR_OF_FLOATS_ASM = tl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")
# Then per word ($1; $2 = -(128 + zero) in both halves, $3-$6 the pairs): one LOP3 makes two
# codes' 128 + code (0x4300 is bfloat16's 128, whose last 7 mantissa bits the code fills), one
# FMA subtracts 128 + zero (exact: small integers), two FMAs multiply with the pairs and add
# (each rounded to bfloat16, 2^-9), and the two halves are added in float32. About 19
# instructions a word, 2.4 a code, against about 5 for the float32 path (sm_90 SASS).
_INT4_WORD_ASM = tl.constexpr("""{
.reg .b32 t, m, e, one, nz, v0, v1, v2, v3, lo, hi;
mov.b32 m, 0x000F000F; mov.b32 e, 0x43004300; mov.b32 one, 0x3F803F80; mov.b32 nz, 0x80008000;
lop3.b32 v0, $1, m, e, 0xEA;
shr.b32 t, $1, 4; lop3.b32 v1, t, m, e, 0xEA;
shr.b32 t, $1, 8; lop3.b32 v2, t, m, e, 0xEA;
shr.b32 t, $1, 12; lop3.b32 v3, t, m, e, 0xEA;
fma.rn.bf16x2 v0, v0, one, $2; fma.rn.bf16x2 v1, v1, one, $2;
fma.rn.bf16x2 v2, v2, one, $2; fma.rn.bf16x2 v3, v3, one, $2;
fma.rn.bf16x2 v0, v0, $3, nz; fma.rn.bf16x2 v0, v1, $4, v0;
fma.rn.bf16x2 v2, v2, $5, nz; fma.rn.bf16x2 v2, v3, $6, v2;
fma.rn.bf16x2 v0, v0, one, v2;
shl.b32 lo, v0, 16; and.b32 hi, v0, 0xFFFF0000;
add.f32 $0, lo, hi;
}""")


@triton.jit
def _pair_dots(words, scale, zero, p0, p1, p2, p3, ASM: tl.constexpr):
    """Per word of `words` [D0, D1, D2] (uint32, eight 4-bit codes, code i at bits 4 i): the
    sum over its codes of (code - zero) * scale * x, float32, from scale and zero per run
    [D0, D1] (float32; integer zero points) and x's bfloat16 pairs [D1, D2] (_pairs_of_words,
    _pairs_of_floats). `_INT4_WORD_ASM` where ASM; otherwise (Triton's interpreter, GPUs before
    compute capability 8.0) the same function in float32, every product and sum exact but the
    last."""
    if ASM:
        zb = (zero + 128.0).to(tl.uint32, bitcast=True) >> 16  # bfloat16 bits, exact
        neg = (zb | (zb << 16) | 0x80008000)[:, :, None]
        sums = tl.inline_asm_elementwise(
            _INT4_WORD_ASM, "=r,r,r,r,r,r,r", [words, neg, p0[None, :, :], p1[None, :, :],
                                               p2[None, :, :], p3[None, :, :]],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        z = zero[:, :, None]
        sums = ((_pair_dot(words, z, p0[None, :, :], 0) + _pair_dot(words, z, p1[None, :, :], 4))
                + (_pair_dot(words, z, p2[None, :, :], 8)
                   + _pair_dot(words, z, p3[None, :, :], 12)))
    return sums * scale[:, :, None]


@triton.jit
def _pair_dot(words, zero, pair, SHIFT: tl.constexpr):
    """(code - zero) x for the codes at bits SHIFT and SHIFT + 16 and their pair's x."""
    lo = ((words >> SHIFT) & 15).to(tl.float32) - zero
    hi = ((words >> (SHIFT + 16)) & 15).to(tl.float32) - zero
    return (lo * (pair << 16).to(tl.float32, bitcast=True)
            + hi * (pair & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _pairs_of_words(x_ptr, k0, words_in, K: tl.constexpr, ASM: tl.constexpr):
    """x's bfloat16 pairs for _pair_dots, read as int32 words from the bfloat16 input at the
    K tile k0 (words_in [R, W]: the tile's words of codes; none past K)."""
    at = (k0 + words_in * 8)[:, :, None] // 2 + tl.arange(0, 4)[None, None, :]  # [R, W, 4]
    bits = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + at, mask=at < K // 2, other=0)
    x01_45, x23_67 = tl.split(tl.reshape(bits, (at.shape[0], at.shape[1], 2, 2)))
    x01, x45 = tl.split(x01_45)
    x23, x67 = tl.split(x23_67)
    return bf16_pairs(x01, x23, x45, x67, ASM)


@triton.jit
def _pairs_of_floats(x, ASM: tl.constexpr):
    """x's bfloat16 pairs for _pair_dots from a float32 tile x [R, W, 8] of bfloat16 values."""
    # code i = 4a + 2b + c; each split takes the last axis
    even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2)))
    x0_4, x2_6 = tl.split(even)
    x1_5, x3_7 = tl.split(odd)
    return (_pair_of_floats(x0_4, ASM), _pair_of_floats(x1_5, ASM),
            _pair_of_floats(x2_6, ASM), _pair_of_floats(x3_7, ASM))


@triton.jit
def _pair_of_floats(both, ASM: tl.constexpr):
    lo, hi = tl.split(both)
    if ASM:
        pair = tl.inline_asm_elementwise(_PAIR_OF_FLOATS_ASM, "=r,r,r", [lo, hi],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        pair = ((lo.to(tl.uint32, bitcast=True) >> 16)
                | (hi.to(tl.uint32, bitcast=True) & 0xFFFF0000))
    return pair


@triton.jit
def _unpack_in_thread(words, BITS: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                      D2: tl.constexpr, field):
    """[D0, D1, D2] uint32 words -> [D0, D1, D2, 32 / BITS] floats 1 + code / 2^BITS, code i at
    index i. Built with tl.join, whose new axis stays inside each thread (a broadcast against a
    shift vector lets the compiler spread it over lanes, and sums over it become shuffles)."""
    if BITS == 4:
        a0, a1 = _code(words, 0, BITS, field), _code(words, 1, BITS, field)
        a2, a3 = _code(words, 2, BITS, field), _code(words, 3, BITS, field)
        a4, a5 = _code(words, 4, BITS, field), _code(words, 5, BITS, field)
        a6, a7 = _code(words, 6, BITS, field), _code(words, 7, BITS, field)
        # axes appended in join order: index = 4 * first + 2 * second + third
        joined = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)),
                         tl.join(tl.join(a1, a5), tl.join(a3, a7)))
        q = tl.reshape(joined, (D0, D1, D2, 8))
    else:
        joined = tl.join(tl.join(_code(words, 0, BITS, field), _code(words, 2, BITS, field)),
                         tl.join(_code(words, 1, BITS, field), _code(words, 3, BITS, field)))
        q = tl.reshape(joined, (D0, D1, D2, 4))
    return q


@triton.jit
def _code(words, i: tl.constexpr, BITS: tl.constexpr, field):
    """Code i of each uint32 word moved to the top of a float's mantissa: 1 + code / 2^BITS.
    `field`: field_mask(BITS)."""
    SHIFT: tl.constexpr = 23 - BITS - BITS * i
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> -SHIFT
    return ((moved & field) | 0x3F800000).to(tl.float32, bitcast=True)


def field_mask(bits: int) -> int:
    """A code's bits at the top of a float32 mantissa (bits 22 down), as _code leaves them."""
    return ((1 << bits) - 1) << (23 - bits)


@triton.jit
def _zero_point(z_ptr, at, ok, ZERO: tl.constexpr, BIAS: tl.constexpr):
    """BIAS + the zero point at `at` (ZERO < 0: from z_ptr, else that constant), float32."""
    if ZERO < 0:
        return tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32) + BIAS
    return tl.full(at.shape, ZERO + BIAS, tl.float32)


@triton.jit
def _packed_gemv_dot(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, g_ptr, y_ptr,
    M, N, stride_xm, stride_ys, field,
    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    ACT_ORDER: tl.constexpr, SUB: tl.constexpr, K_SPLIT: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Up to BLOCK_M rows: y[split] [M, N] = x[:, split's K range] @ W[:, K range]^T through
    tl.dot, computed transposed (W's [BLOCK_N, BLOCK_K] tile, dequantized in registers, is the
    left operand, as the MMA's register operand; x^T [BLOCK_K, BLOCK_M] the right, loaded
    as such so that it streams into shared memory asynchronously).

    Codes unpack inside each thread as _packed_gemv's do, to q = 1 + code / 2^BITS (no
    integer-to-float conversion). One group per K tile (SUB == BLOCK_K): the tile's weights are
    q - (1 + zero / 2^BITS) = (code - zero) / 2^BITS, exact in the model dtype, and the group's
    scale (times 2^BITS) applies once per output after the dot, minimums as min * sum x: one
    add and half a conversion per weight. Otherwise (SUB < BLOCK_K: runs of SUB columns per
    group; SUB = 0: each column's group looked up, g_idx when ACT_ORDER, else k // GROUP) the
    weight is that difference times its scale (+ min), rounded once to the model dtype.
    ZERO < 0: zero points from z_ptr, else that constant; HAS_MIN: m_ptr's per-group
    minimums (GGUF's Q4_1 / K-quants). `field`: field_mask(BITS), as _packed_gemv takes it."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    EVEN: tl.constexpr = K % K_SPLIT == 0 and K_SPLIT % BLOCK_K == 0  # no tile reaches past K
    SCALE_AFTER: tl.constexpr = SUB == BLOCK_K
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_first = split * K_SPLIT
    w_tile = (w_ptr + cols.to(tl.int64)[:, None] * (K // PACK)
              + (k_first // PACK + tl.arange(0, WORDS))[None, :])  # [BN, WORDS]
    x_tile = x_ptr + rows[None, :] * stride_xm + (k_first + tl.arange(0, BLOCK_K))[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in tl.range(0, K_SPLIT, BLOCK_K, num_stages=STAGES):
        k0 = k_first + step
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            words = tl.load(w_tile, mask=col_ok[:, None], other=0)
            x_t = tl.load(x_tile, mask=row_ok[None, :], other=0.0)  # [BK, BM]
        else:
            words_at = k0 // PACK + tl.arange(0, WORDS)
            words = tl.load(w_tile, mask=col_ok[:, None] & (words_at < K // PACK)[None, :],
                            other=0)
            x_t = tl.load(x_tile, mask=row_ok[None, :] & (ks < K)[:, None], other=0.0)
        w_tile += WORDS
        x_tile += BLOCK_K
        q = _unpack_in_thread(words.to(tl.uint32, bitcast=True)[:, None, :], BITS, BLOCK_N, 1,
                              WORDS, field.to(tl.uint32, bitcast=True))
        q = tl.reshape(q, (BLOCK_N, BLOCK_K))  # 1 + code / 2^BITS
        if SCALE_AFTER:
            at = cols * GROUPS + k0 // GROUP
            offset = 1.0 + _zero_point(z_ptr, at, col_ok, ZERO, 0) / (1 << BITS)
            part = _dot((q - offset[:, None]).to(DTYPE), x_t)
            scale = tl.load(s_ptr + at, mask=col_ok, other=0.0).to(tl.float32) * (1 << BITS)
            acc += part * scale[:, None]
            if HAS_MIN:
                mins = tl.load(m_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
                acc += mins[:, None] * tl.sum(x_t.to(tl.float32), 0)[None, :]
        else:
            w = _dequantize(q, cols, col_ok, k0, ks, s_ptr, z_ptr, m_ptr, g_ptr, K, BITS, GROUP,
                            GROUPS, ACT_ORDER, SUB, ZERO, HAS_MIN, BLOCK_N, BLOCK_K)
            acc += _dot(w.to(DTYPE), x_t)
    out = y_ptr + split * stride_ys + rows[None, :] * N + cols[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])


@triton.jit
def _dot(a, b):
    """a @ b in float32; float32 operands multiplied exactly (not as TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _dequantize(q, cols, col_ok, k0, ks, s_ptr, z_ptr, m_ptr, g_ptr, K: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                ACT_ORDER: tl.constexpr, SUB: tl.constexpr, ZERO: tl.constexpr,
                HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 weights [BLOCK_N, BLOCK_K] from q = 1 + code / 2^BITS: (code - zero) * scale
    (+ min), the difference exact, the product rounded once."""
    if SUB > 0:
        RUNS: tl.constexpr = BLOCK_K // SUB
        starts = k0 + tl.arange(0, RUNS) * SUB
        at = cols[:, None] * GROUPS + (starts // GROUP)[None, :]  # [BN, RUNS]
        ok = col_ok[:, None] & (starts < K)[None, :]
        q = tl.reshape(q, (BLOCK_N, RUNS, SUB))
    else:
        if ACT_ORDER:
            group = tl.load(g_ptr + ks, mask=ks < K, other=0)
        else:
            group = ks // GROUP
        at = cols[:, None] * GROUPS + group[None, :]  # [BN, BK]
        ok = col_ok[:, None] & (ks < K)[None, :]
    scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32) * (1 << BITS)
    offset = 1.0 + _zero_point(z_ptr, at, ok, ZERO, 0) / (1 << BITS)
    if SUB > 0:
        w = (q - offset[:, :, None]) * scale[:, :, None]
        if HAS_MIN:
            w += tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:
        w = (q - offset) * scale
        if HAS_MIN:
            w += tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return w


@triton.jit
def _packed_matmul(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, g_ptr, y_ptr,
    M, N, stride_xm,
    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    ACT_ORDER: tl.constexpr, PER_COLUMN: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y [M, N] = x @ W^T, the whole of K per program. PER_COLUMN: each column's
    group looked up (g_idx when ACT_ORDER, else k // GROUP); otherwise one group per K tile.
    ZERO < 0: per-group zero points from z_ptr, else that constant; HAS_MIN: W += m_ptr's
    per-group additive minimums (GGUF's Q4_1 / K-quants)."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        words_at = k0 // PACK + tl.arange(0, WORDS)
        words = tl.load(w_ptr + cols[None, :] * (K // PACK) + words_at[:, None],
                        mask=col_ok[None, :] & (words_at < K // PACK)[:, None], other=0)
        q = tl.reshape((words[:, None, :] >> shifts) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
        if PER_COLUMN:
            if ACT_ORDER:
                group = tl.load(g_ptr + ks, mask=ks < K, other=0)[:, None]
            else:
                group = (ks // GROUP)[:, None]
            at = cols[None, :] * GROUPS + group  # [BLOCK_K, BLOCK_N]
            ok = col_ok[None, :] & (ks < K)[:, None]
        else:
            at = (cols * GROUPS + k0 // GROUP)[None, :]  # [1, BLOCK_N]
            ok = col_ok[None, :]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if ZERO < 0:
            zero = tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32)
        else:
            zero = ZERO
        w = (q.to(tl.float32) - zero) * scale
        if HAS_MIN:
            w += tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)
        w = w.to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        if x_ptr.dtype.element_ty == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = y_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


def packed_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  qzeros: torch.Tensor | int, groups: torch.Tensor | None, bits: int,
                  group_size: int, mins: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype; `groups` [K] int32 is the act-order
    table (None: consecutive groups of group_size columns); `qzeros` an int: one zero point
    for every group; `mins` [N, G]: added to every dequantized weight of its group. `config`
    overrides the decode launch's (the sweep's); its FMA kernel takes one row whose K tiles
    hold whole runs of a group, anything else runs through the tl.dot one with its tiles."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * (32 // bits) == k and x.stride(1) == 1
    x = word_aligned(x)
    if m > BATCH_ROWS:
        return _prefill(x, qweight, scales, qzeros, groups, bits, group_size, mins)
    config = config or gemv_config(bits, n, k, m, x.device)
    block_k = max(min(config.block_k, triton.next_power_of_2(k)), 4 * (32 // bits))
    sub = _run_length(groups, scales.shape[1], group_size, block_k)
    dot = config.dot or m > 1 or sub == 0  # the FMA kernel: one row, groups in whole runs
    block_n = max(config.block_n, 16) if dot else config.block_n
    block_m = block_rows(m)
    programs = triton.cdiv(n, block_n) * (triton.cdiv(m, block_m) if dot else 1)
    k_tiles = triton.cdiv(k, block_k)
    splits = config.split_k or max(1, TARGET_PROGRAMS // programs)
    k_split = triton.cdiv(k_tiles, min(splits, k_tiles)) * block_k
    splits = triton.cdiv(k, k_split)
    y = torch.empty(splits, m, n, device=x.device,
                    dtype=x.dtype if splits == 1 else torch.float32)
    constant_zero = isinstance(qzeros, int)
    zeros = scales if constant_zero else qzeros
    mins_or_any = scales if mins is None else mins
    shape = dict(K=k, BITS=bits, GROUP=group_size, GROUPS=scales.shape[1], SUB=sub,
                 K_SPLIT=k_split, ZERO=qzeros if constant_zero else -1, HAS_MIN=mins is not None,
                 STAGES=config.stages, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=config.warps)
    if dot:
        _packed_gemv_dot[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
            x, qweight, scales, zeros, mins_or_any, groups if groups is not None else qweight, y,
            m, n, x.stride(0), m * n, field_mask(bits), ACT_ORDER=groups is not None,
            BLOCK_M=block_m, **shape)
    else:
        _packed_gemv[(programs, splits)](x, qweight, scales, zeros, mins_or_any, y, n, n,
                                         field_mask(bits), EVEN=k % k_split == 0,
                                         ASM=bf16x2_asm(x.device), **shape)
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)


def _run_length(groups: torch.Tensor | None, num_groups: int, group_size: int,
                block_k: int) -> int:
    """Columns of a K tile sharing one group (0: none guaranteed, look each column up)."""
    if groups is not None:
        return 0
    if num_groups == 1 or group_size % block_k == 0:
        return block_k
    if block_k % group_size == 0 and group_size & (group_size - 1) == 0:
        return group_size
    return 0


def _prefill(x, qweight, scales, qzeros, groups, bits, group_size, mins):
    m, k = x.shape
    n = qweight.shape[0]
    block_m, block_n, block_k = 64, 64, 64
    num_groups = scales.shape[1]
    if num_groups > 1 and 16 <= group_size < block_k and block_k % group_size == 0:
        block_k = group_size  # one group per tile: a scale and a zero per column, not a gather
    per_column = groups is not None or (num_groups > 1 and group_size % block_k != 0)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    constant_zero = isinstance(qzeros, int)
    _packed_matmul[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, scales if constant_zero else qzeros,
        scales if mins is None else mins, groups if groups is not None else qweight, y,
        m, n, x.stride(0),
        K=k, BITS=bits, GROUP=group_size, GROUPS=num_groups, ACT_ORDER=groups is not None,
        PER_COLUMN=per_column, ZERO=qzeros if constant_zero else -1, HAS_MIN=mins is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return y


def fragment_gemv(x: torch.Tensor, frags: Int4Fragments,
                  tiles: tuple[int, int, int] | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype over int4 fragments (the tensor
    cores' mma.sync on sm_80 and later; the same sums in float32 Triton operations elsewhere),
    each row of x its own programs (decode: every row reads the weights again). `tiles`
    overrides fragment_config's (the sweep's)."""
    m, k = x.shape
    x = word_aligned(_fragment_input(x, frags))
    warps, split, chunks = tiles or fragment_config(frags, x.device)
    n = frags.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _int4_frag_gemv[(m, triton.cdiv(frags.tiles, warps))](
            x, frags.words, frags.params, y, N=n, NT=frags.tiles, KC=frags.chunks, K=k,
            NG=frags.groups, GC=frags.group_size // 64, WARPS=warps, KSPLIT=split, CH=chunks,
            NO_ASM=not bf16x2_asm(x.device),
            FORMAT=INT4_F16 if x.dtype == torch.float16 else INT4_BF16,
            num_warps=warps * split, **pdl.pdl_launch(x),
        )  # fmt: skip
    return y


@triton.jit
def _int4_frag_gemv(
    x_ptr, w_ptr, p_ptr, out_ptr, N: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    K: tl.constexpr, NG: tl.constexpr, GC: tl.constexpr, WARPS: tl.constexpr,
    KSPLIT: tl.constexpr, CH: tl.constexpr, NO_ASM: tl.constexpr, FORMAT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[r, rows] = x[r] @ W[rows].T for WARPS tiles of 16 rows, rounded to out's dtype."""
    if PDL:
        gdc_wait()  # x
    r = tl.program_id(0).to(tl.int64)
    tile0 = tl.program_id(1) * WARPS
    sum_g, sum_h = frag_gemv(x_ptr + r * K, w_ptr, p_ptr, 0, tile0, NT, KC, K, WARPS, KSPLIT,
                             CH, NO_ASM, FORMAT, GC, NG)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    m = tl.arange(0, WARPS * 32)
    rows = (tile0 + m // 32) * 16 + (m % 32) // 4
    ok = m % 4 == 0
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + r * N + rows, sum_g.to(dtype), mask=ok & (rows < N))
    tl.store(out_ptr + r * N + rows + 8, sum_h.to(dtype), mask=ok & (rows + 8 < N))


def fragment_linear(x: torch.Tensor, frags: Int4Fragments) -> torch.Tensor:
    """x [M, K] @ dequantize(W)^T over int4 fragments by the launch that suits M rows: one
    (fragment_gemv), up to FRAG_ROWS_MAX (fragment_rows), more (fragment_matmul, or from
    FRAG_DENSE_ROWS the weights dequantized once and torch.matmul)."""
    rows = x.shape[0]
    if rows == 1:
        return fragment_gemv(x, frags)
    if rows <= FRAG_ROWS_MAX:
        return fragment_rows(x, frags)
    if FRAG_DENSE_ROWS is not None and rows >= FRAG_DENSE_ROWS:
        return _fragment_input(x, frags) @ fragment_dequantize(frags, x.dtype).T
    return fragment_matmul(x, frags)


def fragment_rows(x: torch.Tensor, frags: Int4Fragments,
                  tiles: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype over int4 fragments for a few rows
    (decode batches, a verify step): the rows are the mma's B columns, eight a group and up to
    FRAG_ROWS_MAX a program (or a fifth element of `tiles`: fewer rows a program, more programs
    along M that meet the same weights in L2), so each chunk of weights is read and decoded
    once for all of them (fragment_gemv reads the weights once a row)."""
    m, k = x.shape
    x = word_aligned(_fragment_input(x, frags))
    warps, split, chunks, per_warp, *most = tiles or fragment_rows_config(frags, m, x.device)
    most = most[0] if most else FRAG_ROWS_MAX
    groups = min(triton.next_power_of_2(triton.cdiv(max(m, 1), 8)), most // 8)
    n = frags.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, 8 * groups), triton.cdiv(frags.tiles, warps * per_warp))
        _int4_frag_rows[grid](
            x, frags.words, frags.params, y, m, N=n, NT=frags.tiles, KC=frags.chunks, K=k,
            NG=frags.groups, GC=frags.group_size // 64, WARPS=warps, KSPLIT=split, CH=chunks,
            TPW=per_warp, NO_ASM=not bf16x2_asm(x.device), F16=x.dtype == torch.float16,
            GROUPS=groups, num_warps=warps * split, **pdl.pdl_launch(x),
        )  # fmt: skip
    return y


@triton.jit
def _int4_frag_rows(
    x_ptr, w_ptr, p_ptr, out_ptr, M, N: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    K: tl.constexpr, NG: tl.constexpr, GC: tl.constexpr, WARPS: tl.constexpr,
    KSPLIT: tl.constexpr, CH: tl.constexpr, TPW: tl.constexpr, NO_ASM: tl.constexpr,
    F16: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[rows, cols] = x[rows] @ W[cols].T for 8 GROUPS rows and WARPS TPW tiles of 16
    columns, rounded to out's dtype."""
    if PDL:
        gdc_wait()  # x
    r0 = tl.program_id(0) * 8 * GROUPS
    tile0 = tl.program_id(1) * WARPS * TPW
    sums = frag_rows(x_ptr + r0.to(tl.int64) * K, M - r0, w_ptr, p_ptr, tile0, NT, KC, K, WARPS,
                     KSPLIT, CH, TPW, NO_ASM, F16, GC, NG, GROUPS)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    m = tl.arange(0, WARPS * 32)
    lane = m % 32
    dtype = out_ptr.dtype.element_ty
    for r in tl.static_range(GROUPS):
        for j in tl.static_range(TPW):
            for i in tl.static_range(4):
                col = (tile0 + (m // 32) * TPW + j) * 16 + lane // 4 + 8 * (i // 2)
                row = r0 + 8 * r + 2 * (lane % 4) + i % 2
                tl.store(out_ptr + row.to(tl.int64) * N + col,
                         sums[4 * (TPW * r + j) + i].to(dtype),
                         mask=(row < M) & (col < N))  # fmt: skip


def fragment_matmul(x: torch.Tensor, frags: Int4Fragments,
                    split: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype over int4 fragments for many rows:
    each chunk of 64 columns of FRAG_MATMUL_TILES tiles decoded to weights in x's dtype
    (rounded as the stored layout's dequantization rounds) for tl.dot; K over `split`
    (FRAG_MATMUL_SPLIT; the largest count up to it that divides K's chunks) programs, their
    float32 partials summed in a fixed order."""
    m, k = x.shape
    x = _fragment_input(x, frags)
    n, tiles = frags.out_features, FRAG_MATMUL_TILES
    chunks = frags.chunks
    splits = max(s for s in range(1, (split or FRAG_MATMUL_SPLIT) + 1) if chunks % s == 0)
    per = chunks // splits  # every program the same number of chunks
    y = torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32,
                    device=x.device)  # fmt: skip
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    if m:
        _int4_frag_matmul[(triton.cdiv(m, block_m), triton.cdiv(frags.tiles, tiles), splits)](
            x, frags.words, frags.params, y, m, N=n, NT=frags.tiles, KC=frags.chunks, K=k,
            NG=frags.groups, GC=frags.group_size // 64, TILES=tiles, BLOCK_M=block_m, PER=per,
            PRECISION="tf32", FORMAT=INT4_F16 if x.dtype == torch.float16 else INT4_BF16,
            num_warps=4,
        )  # fmt: skip
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)


def fragment_dequantize(frags: Int4Fragments, dtype: torch.dtype) -> torch.Tensor:
    """The weights [N, K] in `dtype` (bfloat16 or float16) from the fragments on their device,
    one program a chunk of FRAG_MATMUL_TILES tiles: s (q - zero) in float32, rounded once, as
    Int4Fragments.dequantize and the stored layout's dequantization round."""
    n, k, tiles = frags.out_features, frags.in_features, FRAG_MATMUL_TILES
    out = torch.empty(n, k, dtype=dtype, device=frags.words.device)
    _int4_frag_dequantize[(triton.cdiv(frags.tiles, tiles), frags.chunks)](
        frags.words, frags.params, out, N=n, NT=frags.tiles, KC=frags.chunks, K=k,
        NG=frags.groups, GC=frags.group_size // 64, TILES=tiles, F16=frags.dtype == torch.float16,
    )  # fmt: skip
    return out


@triton.jit
def _int4_frag_dequantize(w_ptr, p_ptr, out_ptr, N: tl.constexpr, NT: tl.constexpr,
                          KC: tl.constexpr, K: tl.constexpr, NG: tl.constexpr, GC: tl.constexpr,
                          TILES: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    tile0 = tl.program_id(0) * TILES
    c = tl.program_id(1)
    rows_g, rows_h, cols = int4_frag_tile(w_ptr, p_ptr, 0, tile0, c, NT, KC, TILES, GC, NG, F16)
    r = tl.arange(0, 8 * TILES)
    rows = (tile0 + r // 8) * 16 + r % 8
    at = out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    ok = (cols < K)[None, :]
    tl.store(at, rows_g.to(dtype), mask=(rows < N)[:, None] & ok)
    tl.store(at + 8 * K, rows_h.to(dtype), mask=(rows + 8 < N)[:, None] & ok)


def fragment_rows_bucket(rows: int) -> int:
    """fragment_rows' tuned row counts: 8 (one group of the mma's columns), 16, 32, 64."""
    return max(8, min(triton.next_power_of_2(rows), FRAG_ROWS_MAX))


def fragment_rows_config(frags: Int4Fragments, rows: int,
                         device: torch.device) -> tuple[int, ...]:  # fmt: skip
    """fragment_rows' tiles for this projection, rows bucket and GPU model: the sweep's
    (frag_configs.json, key fragment_key + the bucket), else FRAG_ROWS_TILES's."""
    bucket = fragment_rows_bucket(rows)
    tuned = _device_frag_configs(device).get(f"{fragment_key(frags)},{bucket}")
    return FRAG_ROWS_TILES[bucket] if tuned is None else tuple(tuned)


def fragment_key(frags: Int4Fragments) -> str:
    """frag_configs.json's key for a projection: N, K, the 16-bit float type."""
    return f"{frags.out_features},{frags.in_features},{str(frags.dtype).removeprefix('torch.')}"


def fragment_config(frags: Int4Fragments, device: torch.device) -> tuple[int, int, int]:
    """The one-row GEMV's tiles for this projection on this GPU model: the sweep's, else
    FRAG_TILES."""
    tuned = _device_frag_configs(device).get(fragment_key(frags))
    return FRAG_TILES if tuned is None else tuple(tuned)


@functools.cache
def _device_frag_configs(device: torch.device) -> dict[str, list[int]]:
    if not FRAG_CONFIG_FILE.exists():
        return {}
    return json.loads(FRAG_CONFIG_FILE.read_text()).get(_device_name(device), {})


def _fragment_input(x: torch.Tensor, frags: Int4Fragments) -> torch.Tensor:
    if x.dtype != frags.dtype or x.shape[1] != frags.in_features:
        raise ValueError(f"x {list(x.shape)} {x.dtype} does not match int4 fragments of "
                         f"{frags.in_features} {frags.dtype} inputs")  # fmt: skip
    return x.contiguous()


@triton.jit
def _int4_frag_matmul(
    x_ptr, w_ptr, p_ptr, out_ptr, M, N: tl.constexpr, NT: tl.constexpr, KC: tl.constexpr,
    K: tl.constexpr, NG: tl.constexpr, GC: tl.constexpr, TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, PER: tl.constexpr, PRECISION: tl.constexpr, FORMAT: tl.constexpr,
):  # fmt: skip
    """out[split, rows, cols] = x[rows] @ W[cols].T over split's PER chunks of K, for BLOCK_M
    rows and TILES tiles (16 TILES columns: tile T's rows g and g + 8 are columns 16T + g and
    16T + g + 8)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    tile0 = tl.program_id(1) * TILES
    split = tl.program_id(2)
    x_rows = x_ptr + rows.to(tl.int64) * K
    low, high = frag_matmul(x_rows, row_ok, w_ptr, p_ptr, 0, tile0, NT, KC, K, TILES, BLOCK_M,
                            PRECISION, FORMAT, GC, NG, split * PER, PER)  # fmt: skip
    r = tl.arange(0, 8 * TILES)
    cols = (tile0 + r // 8) * 16 + r % 8
    out = out_ptr + (split.to(tl.int64) * M + rows.to(tl.int64))[:, None] * N
    dtype = out_ptr.dtype.element_ty
    tl.store(out + cols[None, :], low.to(dtype), mask=row_ok[:, None] & (cols < N)[None, :])
    tl.store(out + cols[None, :] + 8, high.to(dtype),
             mask=row_ok[:, None] & (cols + 8 < N)[None, :])  # fmt: skip
