"""The decode GEMV (`frag_gemv`, inline mma.sync) and the many-row tile matmul (`frag_matmul`,
tl.dot) over weights stored as tensor-core fragments, for each format stored so: MXFP4 experts
(weights/mxfp4.py packs them, mxfp4_mma.py decodes a chunk) and int4 group-quantized
projections (quant/int4_fragments.py packs them, int4_mma.py decodes a chunk).

The layouts share their geometry: rows in tiles of 16, K in chunks of 64, and per (tile, chunk)
a warp's 32 lanes x 4 int32 words, lane l = 4g + t, word j = 2b + i holding rows 16T + g and
16T + g + 8 at columns 64c + 32b + 8t + 4i + e (e = 0..3): one word is a lane's share of one
`mma.sync.m16n8k16` A fragment, and a lane's x for a chunk is two runs of eight columns, read
as words (the B operand, the same in all eight columns, so every lane's accumulators hold its
two rows' sums). They differ in how a word becomes the A registers and in the numbers that
scale the sums (`FORMAT`):
- 0, MXFP4: a scale word per (tile, chunk, g), the E8M0 exponents of rows g and g + 8 over the
  chunk's two blocks of 32; x carries 2^100 inside the assembly, the sums 2^26 here.
- 1 / 2, int4 with bfloat16 / float16 x: two words per (tile, group, g) (int4_mma.py), a
  group of GC chunks; NG groups a tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from noesis.kernels.int4_mma import (
    INT4_BF16_CHUNK_ASM,
    INT4_BF16_DECODE_ASM,
    INT4_BF16_ROWS_MMA_ASM,
    INT4_F16_CHUNK_ASM,
    INT4_F16_DECODE_ASM,
    INT4_F16_ROWS_MMA_ASM,
    int4_chunk_dots,
    int4_chunk_sums,
    int4_frag_tile,
)
from noesis.kernels.mxfp4_mma import MXFP4_CHUNK_ASM, frag_tile, mxfp4_chunk_sums

MXFP4, INT4_BF16, INT4_F16 = 0, 1, 2  # FORMAT
INT4_CONSTRAINTS = tl.constexpr("=f,=f,f,f" + ",r" * 14)  # sums out; sums, 4 + 8 + 2 words in
DECODE_CONSTRAINTS = tl.constexpr("=r," * 16 + "r,r,r,r,r")  # A registers out; 4 + 1 words in
ROWS_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f,f,f,f,f" + ",r" * 25)  # sums; sums, A, x, scales


@triton.jit
def frag_gemv(x_row, w_ptr, s_ptr, expert, tile0, NT: tl.constexpr, KC: tl.constexpr,
              K: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr, CH: tl.constexpr,
              NO_ASM: tl.constexpr, FORMAT: tl.constexpr, GC: tl.constexpr,
              NG: tl.constexpr):  # fmt: skip
    """Tiles tile0 .. tile0 + WARPS - 1 of expert's fragment-layout weights times x_row (16-bit
    floats) -> (sums of rows g, sums of rows g + 8) [WARPS * 32] float32, lane-major (tile w's
    lane 4g + t at 32w + 4g + t; the four t hold the same sums). WARPS * KSPLIT warps: KSPLIT
    of them share a tile's chunks, each CH chunks an iteration, the next iteration's loaded
    while this one computes; their sums meet at the end. GC and NG: int4's chunks a group and
    groups a tile (1 for MXFP4)."""
    LANES: tl.constexpr = WARPS * 32
    SPAN: tl.constexpr = KSPLIT * CH  # chunks an iteration
    m = tl.arange(0, CH * KSPLIT * LANES)
    c_in = (m // (KSPLIT * LANES)) + CH * ((m // LANES) % KSPLIT)  # the chunk in an iteration
    lane = m % 32
    tile = tile0 + (m // 32) % WARPS
    tile_ok = tile < NT
    row_tile = expert * NT + tile.to(tl.int64)
    xw = x_row.to(tl.pointer_type(tl.uint32))
    zero = tl.zeros((CH * KSPLIT * LANES,), tl.float32)
    sum_g, sum_h = zero, zero
    w, xa, xb, sw = _frag_load(w_ptr, s_ptr, xw, row_tile, tile_ok, c_in, lane, K, KC, FORMAT,
                               GC, NG)  # fmt: skip
    for c0 in range(0, KC, SPAN):  # (two iterations ahead measured slower, RESULTS.md)
        nw, nxa, nxb, nsw = _frag_load(w_ptr, s_ptr, xw, row_tile, tile_ok, c0 + SPAN + c_in,
                                       lane, K, KC, FORMAT, GC, NG)  # fmt: skip
        sum_g, sum_h = _frag_chunk(w, xa, xb, sw, sum_g, sum_h, NO_ASM, FORMAT)
        w, xa, xb, sw = nw, nxa, nxb, nsw
    sum_g = tl.sum(tl.reshape(sum_g, (CH * KSPLIT, LANES)), axis=0)
    sum_h = tl.sum(tl.reshape(sum_h, (CH * KSPLIT, LANES)), axis=0)
    if FORMAT == 0:  # MXFP4's codes were value x 2^-126, x's pairs x 2^100
        sum_g, sum_h = sum_g * 67108864.0, sum_h * 67108864.0  # 2^26
    if NO_ASM:  # each lane summed its own columns; the mma sums over the four lanes t
        sum_g, sum_h = _over_t(sum_g), _over_t(sum_h)
    return sum_g, sum_h


@triton.jit
def _over_t(sums):
    """[LANES] per-lane sums -> the sum of each four lanes t = 0..3, in each of them."""
    LANES: tl.constexpr = sums.shape[0]
    four = tl.sum(tl.reshape(sums, (LANES // 4, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(four[:, None], (LANES // 4, 4)), (LANES,))


@triton.jit
def _frag_load(w_ptr, s_ptr, xw, row_tile, tile_ok, c, lane, K: tl.constexpr, KC: tl.constexpr,
               FORMAT: tl.constexpr, GC: tl.constexpr, NG: tl.constexpr):  # fmt: skip
    """Chunk c of each element's tile: its lane's four words [M, 4], x's two runs [M, 4] each as
    16-bit float pairs (0 past K), and its scale word [M] (MXFP4) or its group's scale and
    zero words [M, 2] (int4)."""
    ok = tile_ok & (c < KC)
    words, sw = _weight_load(w_ptr, s_ptr, row_tile, ok, c, lane, KC, FORMAT, GC, NG)
    xa, xb = _x_load(xw, ok, c, lane, K)
    return words, xa, xb, sw


@triton.jit
def _weight_load(w_ptr, s_ptr, row_tile, ok, c, lane, KC: tl.constexpr, FORMAT: tl.constexpr,
                 GC: tl.constexpr, NG: tl.constexpr):  # fmt: skip
    quad = tl.arange(0, 4)[None, :]
    at = (((row_tile * KC + c) * 32 + lane) * 4)[:, None] + quad
    words = tl.load(w_ptr + at, mask=ok[:, None], other=0)
    if FORMAT == 0:
        sw = tl.load(s_ptr + (row_tile * KC + c) * 8 + lane // 4, mask=ok, other=0)
    else:
        pair = tl.arange(0, 2)[None, :]
        p_at = ((row_tile * NG + c // GC) * 8 + lane // 4) * 2
        sw = tl.load(s_ptr + p_at[:, None] + pair, mask=ok[:, None], other=0)
    return words, sw


@triton.jit
def _x_load(xw, ok, c, lane, K: tl.constexpr):
    """A lane's two runs of x (as words from xw, a row's start or one per element) in chunk c."""
    quad = tl.arange(0, 4)[None, :]
    x_at = (c * 32 + (lane % 4) * 4)[:, None] + quad
    xa = tl.load(xw + x_at, mask=ok[:, None] & (x_at < K // 2), other=0)
    xb = tl.load(xw + x_at + 16, mask=ok[:, None] & (x_at + 16 < K // 2), other=0)
    return xa, xb


@triton.jit
def _frag_chunk(words, xa, xb, sw, sum_g, sum_h, NO_ASM: tl.constexpr, FORMAT: tl.constexpr):
    w0, w1, w2, w3 = _quad(words)
    x0, x1, x2, x3 = _quad(xa)
    x4, x5, x6, x7 = _quad(xb)
    if FORMAT == 0:
        if NO_ASM:
            sum_g, sum_h = mxfp4_chunk_sums(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw,
                                            sum_g, sum_h)  # fmt: skip
        else:
            sum_g, sum_h = tl.inline_asm_elementwise(
                MXFP4_CHUNK_ASM, "=f,=f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [sum_g, sum_h, w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
    else:
        pw, zw = tl.split(sw)
        operands = [sum_g, sum_h, w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, pw, zw]
        if NO_ASM:
            sum_g, sum_h = int4_chunk_sums(*operands[2:], sum_g, sum_h, FORMAT == 2)
        elif FORMAT == 2:
            sum_g, sum_h = tl.inline_asm_elementwise(
                INT4_F16_CHUNK_ASM, INT4_CONSTRAINTS, operands, dtype=(tl.float32, tl.float32),
                is_pure=True, pack=1)  # fmt: skip
        else:
            sum_g, sum_h = tl.inline_asm_elementwise(
                INT4_BF16_CHUNK_ASM, INT4_CONSTRAINTS, operands, dtype=(tl.float32, tl.float32),
                is_pure=True, pack=1)  # fmt: skip
    return sum_g, sum_h


@triton.jit
def frag_rows(x_ptr, x_rows, w_ptr, s_ptr, tile0, NT: tl.constexpr, KC: tl.constexpr,
              K: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr, CH: tl.constexpr,
              TPW: tl.constexpr, NO_ASM: tl.constexpr, F16: tl.constexpr, GC: tl.constexpr,
              NG: tl.constexpr, GROUPS: tl.constexpr):  # fmt: skip
    """int4 fragments times up to 8 GROUPS rows of x (from x_ptr, K apart; rows from x_rows on
    read as 0): frag_gemv's loop with x's rows as the mma's eight B columns (lane 4g + t reads
    row g of each group), each chunk's weights decoded once for every group and each load of
    x met by TPW tiles (warp w's tiles are tile0 + w TPW + j). -> 4 GROUPS TPW sums
    [WARPS * 32] float32, lane-major, (r TPW + j) 4 + i for group r and tile j: the products
    of (W row g, x row 8r + 2t), (g, 8r + 2t + 1), (g + 8, 8r + 2t), (g + 8, 8r + 2t + 1)
    for lane 4g + t."""
    LANES: tl.constexpr = WARPS * 32
    SPAN: tl.constexpr = KSPLIT * CH
    m = tl.arange(0, CH * KSPLIT * LANES)
    c_in = (m // (KSPLIT * LANES)) + CH * ((m // LANES) % KSPLIT)
    lane = m % 32
    first = tile0 + ((m // 32) % WARPS) * TPW
    xw = x_ptr.to(tl.pointer_type(tl.uint32))
    sums = ()
    for _ in tl.static_range(4 * GROUPS * TPW):
        sums = sums + (tl.zeros((CH * KSPLIT * LANES,), tl.float32),)
    words, params = _tiles_load(w_ptr, s_ptr, first, c_in, lane, NT, KC, GC, NG, TPW)
    for c0 in range(0, KC, SPAN):
        c = c0 + c_in
        next_words, next_params = _tiles_load(w_ptr, s_ptr, first, c + SPAN, lane, NT, KC, GC,
                                              NG, TPW)  # fmt: skip
        sums = _rows_chunk(words, params, xw, x_rows, c < KC, c, lane, sums, K, NO_ASM, F16,
                           GROUPS, TPW)  # fmt: skip
        words, params = next_words, next_params
    out = ()
    for i in tl.static_range(4 * GROUPS * TPW):
        out = out + (tl.sum(tl.reshape(sums[i], (SPAN, LANES)), axis=0),)
    return out


@triton.jit
def _tiles_load(w_ptr, s_ptr, first, c, lane, NT: tl.constexpr, KC: tl.constexpr,
                GC: tl.constexpr, NG: tl.constexpr, TPW: tl.constexpr):  # fmt: skip
    """Chunk c of tiles first .. first + TPW - 1: a tuple of their words and one of their
    scale and zero words."""
    words, params = (), ()
    for j in tl.static_range(TPW):
        tile = first + j
        w, p = _weight_load(w_ptr, s_ptr, tile.to(tl.int64), (tile < NT) & (c < KC), c, lane,
                            KC, 1, GC, NG)  # fmt: skip
        words, params = words + (w,), params + (p,)
    return words, params


@triton.jit
def _rows_chunk(words, params, xw, x_rows, ok, c, lane, sums, K: tl.constexpr,
                NO_ASM: tl.constexpr, F16: tl.constexpr, GROUPS: tl.constexpr,
                TPW: tl.constexpr):  # fmt: skip
    new = ()
    if NO_ASM:  # each lane's dots with all eight rows, summed over the four lanes t
        t = lane % 4
        for r in tl.static_range(GROUPS):
            acc = ()
            for i in tl.static_range(4 * TPW):
                acc = acc + (sums[4 * TPW * r + i],)
            for n in tl.static_range(8):
                xa, xb = _x_load(xw + (8 * r + n) * (K // 2), ok & (8 * r + n < x_rows), c,
                                 lane, K)  # fmt: skip
                x0, x1, x2, x3 = _quad(xa)
                x4, x5, x6, x7 = _quad(xb)
                step = ()
                for j in tl.static_range(TPW):
                    w0, w1, w2, w3 = _quad(words[j])
                    pw, zw = tl.split(params[j])
                    d_g, d_h = int4_chunk_dots(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7,
                                               pw, zw, F16)  # fmt: skip
                    d_g, d_h = _over_t(d_g), _over_t(d_h)
                    step = step + (acc[4 * j] + tl.where(2 * t == n, d_g, 0.0),
                                   acc[4 * j + 1] + tl.where(2 * t + 1 == n, d_g, 0.0),
                                   acc[4 * j + 2] + tl.where(2 * t == n, d_h, 0.0),
                                   acc[4 * j + 3] + tl.where(2 * t + 1 == n, d_h, 0.0))  # fmt: skip
                acc = step
            new = new + acc
        return new
    a, scale = (), ()
    for j in tl.static_range(TPW):
        w0, w1, w2, w3 = _quad(words[j])
        pw, zw = tl.split(params[j])
        if F16:
            a = a + tl.inline_asm_elementwise(INT4_F16_DECODE_ASM, DECODE_CONSTRAINTS,
                                              [w0, w1, w2, w3, zw], dtype=(tl.int32,) * 16,
                                              is_pure=True, pack=1)  # fmt: skip
        else:
            a = a + tl.inline_asm_elementwise(INT4_BF16_DECODE_ASM, DECODE_CONSTRAINTS,
                                              [w0, w1, w2, w3, zw], dtype=(tl.int32,) * 16,
                                              is_pure=True, pack=1)  # fmt: skip
        scale = scale + (pw,)
    for r in tl.static_range(GROUPS):
        row = (8 * r + lane // 4).to(tl.int64)
        xa, xb = _x_load(xw + (row * (K // 2))[:, None], ok & (row < x_rows), c, lane, K)
        x0, x1, x2, x3 = _quad(xa)
        x4, x5, x6, x7 = _quad(xb)
        for j in tl.static_range(TPW):
            operands = [sums[4 * (TPW * r + j)], sums[4 * (TPW * r + j) + 1],
                        sums[4 * (TPW * r + j) + 2], sums[4 * (TPW * r + j) + 3],
                        a[16 * j], a[16 * j + 1], a[16 * j + 2], a[16 * j + 3], a[16 * j + 4],
                        a[16 * j + 5], a[16 * j + 6], a[16 * j + 7], a[16 * j + 8],
                        a[16 * j + 9], a[16 * j + 10], a[16 * j + 11], a[16 * j + 12],
                        a[16 * j + 13], a[16 * j + 14], a[16 * j + 15],
                        x0, x1, x2, x3, x4, x5, x6, x7, scale[j]]  # fmt: skip
            if F16:
                s = tl.inline_asm_elementwise(INT4_F16_ROWS_MMA_ASM, ROWS_CONSTRAINTS, operands,
                                              dtype=(tl.float32,) * 4, is_pure=True,
                                              pack=1)  # fmt: skip
            else:
                s = tl.inline_asm_elementwise(INT4_BF16_ROWS_MMA_ASM, ROWS_CONSTRAINTS,
                                              operands, dtype=(tl.float32,) * 4, is_pure=True,
                                              pack=1)  # fmt: skip
            new = new + s
    return new


@triton.jit
def frag_matmul(x_rows, x_ok, w_ptr, s_ptr, expert, tile0, NT: tl.constexpr, KC: tl.constexpr,
                K: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                PRECISION: tl.constexpr, FORMAT: tl.constexpr, GC: tl.constexpr,
                NG: tl.constexpr, c_first, COUNT: tl.constexpr):  # fmt: skip
    """x[BLOCK_M rows at x_rows] @ fragment tiles tile0 .. tile0 + TILES - 1 -> their rows g and
    their rows g + 8, [BLOCK_M, 8 TILES] float32 each: a chunk of 64 columns an iteration,
    decoded to weights in x's dtype for two tl.dots (many rows; frag_gemv is the one-row
    path). Chunks c_first .. c_first + COUNT - 1 are summed (0 and KC: all of K; or a
    split's share)."""
    low = tl.zeros((BLOCK_M, 8 * TILES), tl.float32)
    high = tl.zeros((BLOCK_M, 8 * TILES), tl.float32)
    for i in range(0, COUNT):
        c = c_first + i
        if FORMAT == 0:
            w_low, w_high, cols = frag_tile(w_ptr, s_ptr, expert, tile0, c, NT, KC, TILES)
        else:
            w_low, w_high, cols = int4_frag_tile(w_ptr, s_ptr, expert, tile0, c, NT, KC, TILES,
                                                 GC, NG, FORMAT == 2)  # fmt: skip
        x = tl.load(x_rows[:, None] + cols[None, :], mask=x_ok[:, None] & (cols < K)[None, :],
                    other=0.0)  # fmt: skip
        low = tl.dot(x, tl.trans(w_low.to(x.dtype)), low, input_precision=PRECISION)
        high = tl.dot(x, tl.trans(w_high.to(x.dtype)), high, input_precision=PRECISION)
    return low, high


@triton.jit
def _quad(t):
    """[M, 4] -> its four columns."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    a, c = tl.split(even)
    b, d = tl.split(odd)
    return a, b, c, d
