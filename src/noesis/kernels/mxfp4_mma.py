"""MXFP4 experts laid out as tensor-core fragments: one chunk's arithmetic for the decode GEMV
(kernels/frag_gemv.py runs the loop, shared with int4), and the sorted layout's tile decode.

A GEMV of one token against MXFP4 weights spends its instructions on turning codes into
numbers: the bfloat16x2 CUDA-core GEMV this replaced took about 3.6 a code. Here the weights are
rearranged once, at load, into the operand registers of the tensor cores'
`mma.sync.m16n8k16` (bfloat16 in, float32 out): one int32 word per thread and mma holds the
thread's eight codes of a 16 x 16 A fragment, with each code's bits placed so that four
bfloat16x2 registers come out of the word in 11 integer operations (a rotate, a mask, a merge).
x is the B operand, the same in all eight columns, so every lane's accumulators hold its two
rows' sums; the products and their sums are float32, each block of 32 codes scaled once.

Layout (`weights.mxfp4.to_fragments`, `Mxfp4Fragments`; torch only, so models import it
without Triton), for weights [E, N, K]: rows in tiles of 16, K in chunks of 64.
- words [E, N/16, K/64, 32, 4] int32: lane l = 4g + t of a warp, word j = 2 b + i holds rows
  16T + g and 16T + g + 8 at columns 64c + 32b + 8t + 4i + e, e = 0..3: each mma covers 16
  columns inside one block of 32, and a lane's x for a chunk is two runs of 8 columns.
- scales [E, N/16, K/64, 8] int32: for g, the exponents of rows g and g + 8 (bytes 2h + b, h
  the row's half) over the chunk's two blocks.
N and K are padded with zero codes to whole tiles and chunks. A caller's row order (gpt-oss's
gate and up rows side by side: tile rows g and g + 8 are one column's gate and up) is applied
while packing.

Code bits in a word: fragment register r (rows g, g+8, g, g+8 for r = 0..3; columns e = 0, 1
for r < 2, e = 2, 3 after) takes its low half's code (column e even) with its sign bit at
15 - SIGN_ROT[r] and its three magnitude bits from 6 - MAG_ROT[r], mod 32, and its high
half's code 16 bits above (`weights.mxfp4.bits_of`); rotating the word left by those amounts
puts the sign at bit 15 and the magnitude at 6-8, which is bfloat16's value x 2^-126 (the
code 0.5 a subnormal, which the tensor cores keep); x's pairs carry 2^100 (exact) so that the
products stay normal, and the sums 2^26 back. The four (sign, magnitude) rotations were searched
for the fewest ALU-pipe operations (plain left shifts are written as multiplies: the FMA pipe).

The sorted layout (more pairs) decodes a chunk of tiles to values for a tl.dot (`frag_tile`),
both rows of a word from one load. The GEMV's loop over tiles, chunks, lanes and warps is
frag_gemv.py's (FORMAT 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

# One chunk of a lane: its four words ($4-$7), x's two runs of eight columns as bfloat16 words
# ($8-$11, $12-$15), its scale word ($16), and the running sums of its rows g ($2) and g + 8
# ($3) -> the new sums ($0, $1). x's pairs are scaled by 2^100 (exact) so that the products of
# the codes' value x 2^-126 stay normal; the caller multiplies the sums by 2^26.
_DECODE = """
and.b32 a0, {w}, m;
mul.lo.u32 p, {w}, 2; mul.lo.u32 q, {w}, 8; and.b32 q, q, mm;
lop3.b32 a1, p, ms, q, 0xEA;
mul.lo.u32 p, {w}, 4; shf.l.wrap.b32 q, {w}, {w}, 12; and.b32 q, q, mm;
lop3.b32 a2, p, ms, q, 0xEA;
mul.lo.u32 p, {w}, 64; and.b32 a3, p, m;
"""
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{{d}0, {d}1, {d}2, {d}3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};\n")  # fmt: skip
MXFP4_CHUNK_ASM = tl.constexpr(
    "{\n.reg .b32 s, z, m, ms, mm, p, q, a0, a1, a2, a3, x0, x1, x2, x3, x4, x5, x6, x7, f;\n"
    ".reg .f32 zf, d0, d1, d2, d3, e0, e1, e2, e3;\n"
    "mov.b32 s, 0x71807180; mov.b32 z, 0x80008000; mov.b32 m, 0x81C081C0;\n"
    "mov.b32 ms, 0x80008000; mov.b32 mm, 0x01C001C0; mov.f32 zf, 0f00000000;\n"
    + "".join(f"fma.rn.bf16x2 x{i}, ${8 + i}, s, z;\n" for i in range(8))
    + _DECODE.format(w="$4") + _MMA.format(d="d", b0="x0", b1="x1", c="zf, zf, zf, zf")
    + _DECODE.format(w="$5") + _MMA.format(d="d", b0="x2", b1="x3", c="d0, d1, d2, d3")
    + _DECODE.format(w="$6") + _MMA.format(d="e", b0="x4", b1="x5", c="zf, zf, zf, zf")
    + _DECODE.format(w="$7") + _MMA.format(d="e", b0="x6", b1="x7", c="e0, e1, e2, e3")
    + "mul.lo.u32 f, $16, 8388608; and.b32 f, f, 0x7F800000; fma.rn.f32 $0, d0, f, $2;\n"
    "mul.lo.u32 f, $16, 32768; and.b32 f, f, 0x7F800000; fma.rn.f32 $0, e0, f, $0;\n"
    "mul.lo.u32 f, $16, 128; and.b32 f, f, 0x7F800000; fma.rn.f32 $1, d2, f, $3;\n"
    "shr.b32 f, $16, 1; and.b32 f, f, 0x7F800000; fma.rn.f32 $1, e2, f, $1;\n}"
)


@triton.jit
def mxfp4_chunk_sums(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw, sum_g, sum_h):
    """`MXFP4_CHUNK_ASM`'s sums in float32 Triton operations (the interpreter, GPUs before sm_80):
    word j's columns e meet x's pair (2 (j % 2) + e // 2) of run j // 2."""
    sum_g += _word_dot(w0, x0, x1, 0) * _scale(sw, 0) + _word_dot(w1, x2, x3, 0) * _scale(sw, 0)
    sum_g += _word_dot(w2, x4, x5, 0) * _scale(sw, 1) + _word_dot(w3, x6, x7, 0) * _scale(sw, 1)
    sum_h += _word_dot(w0, x0, x1, 1) * _scale(sw, 2) + _word_dot(w1, x2, x3, 1) * _scale(sw, 2)
    sum_h += _word_dot(w2, x4, x5, 1) * _scale(sw, 3) + _word_dot(w3, x6, x7, 1) * _scale(sw, 3)
    return sum_g, sum_h


@triton.jit
def _word_dot(word, x01, x23, H: tl.constexpr):
    """Row half H's four codes of a word times x's columns 0-3 (two bfloat16 pairs), x 2^-26."""
    total = _code(word, H, 0) * _lo(x01) + _code(word, H, 1) * _hi(x01)
    total += _code(word, H, 2) * _lo(x23) + _code(word, H, 3) * _hi(x23)
    return total * (1.0 / 4096)  # the codes' 2^-14 -> 2^-26


@triton.jit
def _code(word, H: tl.constexpr, COL: tl.constexpr):
    """The value x 2^-14 of row half H's code at column COL of a word (`bits_of`)."""
    REG: tl.constexpr = 2 * (COL // 2) + H
    HALF: tl.constexpr = COL % 2
    if REG == 0:
        SIGN: tl.constexpr = 15 + 16 * HALF
        MAG: tl.constexpr = 6 + 16 * HALF
    elif REG == 1:
        SIGN: tl.constexpr = 14 + 16 * HALF
        MAG: tl.constexpr = 3 + 16 * HALF
    elif REG == 2:
        SIGN: tl.constexpr = 13 + 16 * HALF
        MAG: tl.constexpr = (26 + 16 * HALF) % 32
    else:
        SIGN: tl.constexpr = 9 + 16 * HALF
        MAG: tl.constexpr = 16 * HALF
    return _value_2m14(_code_at(word, SIGN, MAG))


@triton.jit
def _lo(pair):
    return (pair << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(pair):
    return (pair & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _scale(sw, BYTE: tl.constexpr):
    """Exponent byte BYTE of a scale word as float32 2^(e - 127)."""
    return (((sw >> (8 * BYTE)) & 255) << 23).to(tl.float32, bitcast=True)



@triton.jit
def frag_tile(w_ptr, s_ptr, expert, tile0, c, NT: tl.constexpr, KC: tl.constexpr,
              TILES: tl.constexpr):  # fmt: skip
    """Chunk c of tiles tile0 .. tile0 + TILES - 1 as float32 values for a tl.dot: rows g
    [8 TILES, 64] and rows g + 8 (row 8T + g of each, 0 past the last tile), columns in the
    words' order k' = 4 (4t + j) + e, and the chunk's columns [64] they stand for, 64c + 32
    (j // 2) + 8t + 4 (j % 2) + e. A word serves both rows; each code's bits sit at fixed
    places (`weights.mxfp4.bits_of`)."""
    r = tl.arange(0, 8 * TILES)
    tile = tile0 + r // 8
    ok = tile < NT
    base = (expert * NT + tile.to(tl.int64)) * KC + c
    q = tl.arange(0, 16)  # a lane's t and word j: 4t + j
    words = tl.load(w_ptr + (base * 128 + 16 * (r % 8))[:, None] + q[None, :], mask=ok[:, None],
                    other=0)  # fmt: skip
    scales = tl.load(s_ptr + base * 8 + r % 8, mask=ok, other=0)
    second_block = ((q % 4) // 2 == 1)[None, :]
    rows_g = _half_tile(words, scales, second_block, 0, TILES)
    rows_g8 = _half_tile(words, scales, second_block, 1, TILES)
    k = tl.arange(0, 64)
    t, j = k // 16, (k // 4) % 4
    return rows_g, rows_g8, 64 * c + 32 * (j // 2) + 8 * t + 4 * (j % 2) + k % 4


@triton.jit
def _half_tile(words, scales, second_block, H: tl.constexpr, TILES: tl.constexpr):
    """Row half H's values [8 TILES, 64] of a chunk's words [8 TILES, 16]: fragment registers
    H and 2 + H, two codes each (columns e = 0, 1 and 2, 3), times their blocks' scales."""
    exponent = tl.where(second_block, (scales[:, None] >> (16 * H + 8)) & 255,
                        (scales[:, None] >> (16 * H)) & 255)  # fmt: skip
    scale = ((exponent + 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127) x 2^14
    e0 = _value_2m14(_code_at(words, 15 - H, 6 - 3 * H))  # registers 0 / 1, low half
    e1 = _value_2m14(_code_at(words, 31 - H, 22 - 3 * H))  # high half
    e2 = _value_2m14(_code_at(words, 13 - 4 * H, 26 - 26 * H))  # registers 2 / 3
    e3 = _value_2m14(_code_at(words, 29 - 4 * H, 10 + 6 * H))
    values = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [.., 16, 2, 2]: e = 2a + b
    return tl.reshape(values * scale[:, :, None, None], (8 * TILES, 64))


@triton.jit
def _code_at(word, SIGN: tl.constexpr, MAG: tl.constexpr):
    return (((word >> SIGN) & 1) << 3) | ((word >> MAG) & 7)


@triton.jit
def _value_2m14(code):
    """E2M1 codes -> value x 2^-14 in float32 (the float16 placement of `_code`)."""
    bits = (((code & 8) << 12) | ((code & 7) << 9)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)
