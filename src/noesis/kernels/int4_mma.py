"""int4 group-quantized weights as tensor-core fragments: one chunk's arithmetic for the decode
GEMV (INT4_*_CHUNK_ASM: decode and mma in one) and for several rows of x (INT4_*_DECODE_ASM
once, then INT4_*_ROWS_MMA_ASM per group of eight rows); kernels/frag_gemv.py runs the loops,
quant/int4_fragments.py packs the layout.

A word holds the eight 4-bit codes a lane contributes to one `mma.sync.m16n8k16` A fragment
(rows g and g + 8, four columns each). Code q placed in the low four bits of a bfloat16 whose
other bits are those of 128.0 is the number 128 + q exactly (float16: 1024.0, 1024 + q), so a
register of two codes is one shift and one LOP3 (mask and merge) away from the word; one
packed FMA then subtracts the row's 128 + zero, exactly, leaving q - zero. The tensor cores
multiply those small integers by x (the B operand, the same in all eight columns) into float32
sums, and each group's sums take the row's scale once: s (sum of (q - zero) x) is the
projection's sum of w x with w = s (q - zero), the rounding of w to the model dtype left out.

Register r of a word (rows g, g + 8, g, g + 8 for r = 0..3; columns e = 0, 1 for r < 2, e = 2,
3 after) takes its low half's code (column e even) from bits 4r .. 4r + 3 and its high half's
from bits 16 + 4r .. 16 + 4r + 3.

Per (tile, group, g), two int32 words: the scales of rows g and g + 8 as a pair of the model
dtype's 16-bit floats, and -(128 + zero) (float16: -(1024 + zero)) of the same rows, a pair too.
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

_DECODE = """
lop3.b32 a0, {w}, m, o, 0xEA;
shr.b32 t, {w}, 4; lop3.b32 a1, t, m, o, 0xEA;
shr.b32 t, {w}, 8; lop3.b32 a2, t, m, o, 0xEA;
shr.b32 t, {w}, 12; lop3.b32 a3, t, m, o, 0xEA;
fma.rn.{ty}x2 a0, a0, one, zg; fma.rn.{ty}x2 a1, a1, one, zh;
fma.rn.{ty}x2 a2, a2, one, zg; fma.rn.{ty}x2 a3, a3, one, zh;
"""
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
        "{{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};\n")  # fmt: skip


def _chunk_asm(ty: str, base: int, one: int, scale_lo: str, scale_hi: str) -> str:
    """One chunk of a lane for 16-bit float type `ty`: its four words ($4-$7), x's two runs of
    eight columns as words ($8-$11, $12-$15), the group's scale pair ($16) and -(base + zero)
    pair ($17), and the running sums of rows g ($2) and g + 8 ($3) -> the new sums ($0, $1).
    scale_lo / scale_hi: the scale pair's low / high float into f."""
    body = "".join(
        _DECODE.format(w=f"${4 + j}", ty=ty)
        + _MMA.format(ty=ty, b0=f"${8 + 2 * j}", b1=f"${9 + 2 * j}",
                      c="zf, zf, zf, zf" if j == 0 else "d0, d1, d2, d3")  # fmt: skip
        for j in range(4)
    )
    return (
        "{\n.reg .b32 m, o, one, zg, zh, t, a0, a1, a2, a3, sc;\n"
        ".reg .f32 zf, f, d0, d1, d2, d3;\n.reg .b16 lo, hi;\n"
        f"mov.b32 m, 0x000F000F; mov.b32 o, {base * 0x10001:#x}; mov.b32 one, {one * 0x10001:#x};\n"
        "mov.f32 zf, 0f00000000;\n"
        "prmt.b32 zg, $17, $17, 0x1010; prmt.b32 zh, $17, $17, 0x3232;\n"
        + body
        + "mov.b32 {lo, hi}, $16;\n"
        + scale_lo + "fma.rn.f32 $0, d0, f, $2;\n"
        + scale_hi + "fma.rn.f32 $1, d2, f, $3;\n}"
    )


# bfloat16: 128.0 is 0x4300 and 1.0 0x3F80; a bfloat16's float32 is its bits 16 places up.
INT4_BF16_CHUNK_ASM = tl.constexpr(
    _chunk_asm("bf16", 0x4300, 0x3F80, "shl.b32 sc, $16, 16; mov.b32 f, sc;\n",
               "and.b32 sc, $16, 0xFFFF0000; mov.b32 f, sc;\n")
)
# float16: 1024.0 is 0x6400 and 1.0 0x3C00.
INT4_F16_CHUNK_ASM = tl.constexpr(
    _chunk_asm("f16", 0x6400, 0x3C00, "cvt.f32.f16 f, lo;\n", "cvt.f32.f16 f, hi;\n")
)


def _decode_asm(ty: str, base: int, one: int) -> str:
    """A chunk's four words ($16-$19) and the group's -(base + zero) pair ($20) -> the sixteen
    A registers of its four mma ($0-$15, word j's in 4j .. 4j + 3): decoded once, then met by
    several groups of x rows (INT4_*_ROWS_MMA_ASM)."""
    body = "".join(re.sub(r"\ba([0-3])\b", f"a{j}_\\1", _DECODE.format(w=f"${16 + j}", ty=ty))
                   for j in range(4))  # fmt: skip
    regs = ", ".join(f"a{j}_{i}" for j in range(4) for i in range(4))
    outs = "".join(f"mov.b32 ${4 * j + i}, a{j}_{i};\n" for j in range(4) for i in range(4))
    return (
        f"{{\n.reg .b32 m, o, one, zg, zh, t, {regs};\n"
        f"mov.b32 m, 0x000F000F; mov.b32 o, {base * 0x10001:#x}; mov.b32 one, {one * 0x10001:#x};\n"
        "prmt.b32 zg, $20, $20, 0x1010; prmt.b32 zh, $20, $20, 0x3232;\n"
        + body + outs + "}"
    )


def _rows_mma_asm(ty: str, scale_lo: str, scale_hi: str) -> str:
    """A chunk's decoded A registers ($8-$23) against eight different x rows (the B operand:
    lane 4g + t holds row g's x, $24-$31) and the group's scale pair ($32): the running sums
    ($4-$7) of (rows g, x row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) -> $0-$3."""
    body = "".join(
        _MMA.format(ty=ty, b0=f"${24 + 2 * j}", b1=f"${25 + 2 * j}",
                    c="zf, zf, zf, zf" if j == 0 else "d0, d1, d2, d3")
        .replace("a0, a1, a2, a3", ", ".join(f"${8 + 4 * j + i}" for i in range(4)))
        for j in range(4)
    )  # fmt: skip
    return (
        "{\n.reg .b32 sc;\n.reg .f32 zf, f, d0, d1, d2, d3;\n.reg .b16 lo, hi;\n"
        "mov.f32 zf, 0f00000000;\n" + body + "mov.b32 {lo, hi}, $32;\n"
        + scale_lo + "fma.rn.f32 $0, d0, f, $4; fma.rn.f32 $1, d1, f, $5;\n"
        + scale_hi + "fma.rn.f32 $2, d2, f, $6; fma.rn.f32 $3, d3, f, $7;\n}"
    )


_BF16_SCALES = ("shl.b32 sc, $32, 16; mov.b32 f, sc;\n",
                "and.b32 sc, $32, 0xFFFF0000; mov.b32 f, sc;\n")  # fmt: skip
_F16_SCALES = ("cvt.f32.f16 f, lo;\n", "cvt.f32.f16 f, hi;\n")
INT4_BF16_DECODE_ASM = tl.constexpr(_decode_asm("bf16", 0x4300, 0x3F80))
INT4_F16_DECODE_ASM = tl.constexpr(_decode_asm("f16", 0x6400, 0x3C00))
INT4_BF16_ROWS_MMA_ASM = tl.constexpr(_rows_mma_asm("bf16", *_BF16_SCALES))
INT4_F16_ROWS_MMA_ASM = tl.constexpr(_rows_mma_asm("f16", *_F16_SCALES))


@triton.jit
def int4_chunk_sums(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, pw, zw, sum_g, sum_h,
                    F16: tl.constexpr):  # fmt: skip
    """The chunk assembly's sums in float32 Triton operations (the interpreter, GPUs before
    sm_80): this lane's share of each mma, word j meeting x's words 2j and 2j + 1."""
    d_g, d_h = int4_chunk_dots(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, pw, zw, F16)
    return sum_g + d_g, sum_h + d_h


@triton.jit
def int4_chunk_dots(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, pw, zw, F16: tl.constexpr):
    """This lane's scaled dots of rows g and g + 8 with x over its own columns of the chunk."""
    d_g = _word_dot(w0, x0, x1, zw, 0, F16) + _word_dot(w1, x2, x3, zw, 0, F16)
    d_g += _word_dot(w2, x4, x5, zw, 0, F16) + _word_dot(w3, x6, x7, zw, 0, F16)
    d_h = _word_dot(w0, x0, x1, zw, 1, F16) + _word_dot(w1, x2, x3, zw, 1, F16)
    d_h += _word_dot(w2, x4, x5, zw, 1, F16) + _word_dot(w3, x6, x7, zw, 1, F16)
    return d_g * _half(pw, 0, F16), d_h * _half(pw, 1, F16)


@triton.jit
def _word_dot(word, x01, x23, zw, H: tl.constexpr, F16: tl.constexpr):
    """Row half H's four codes of a word, less the row's zero, times x's columns 0-3."""
    minus = _half(zw, H, F16) + (1024.0 if F16 else 128.0)  # -(base + zero) + base
    total = (_nibble(word, H) + minus) * _half(x01, 0, F16)
    total += (_nibble(word, H + 4) + minus) * _half(x01, 1, F16)
    total += (_nibble(word, H + 2) + minus) * _half(x23, 0, F16)
    return total + (_nibble(word, H + 6) + minus) * _half(x23, 1, F16)


@triton.jit
def _nibble(word, N: tl.constexpr):
    return ((word >> (4 * N)) & 15).to(tl.float32)


@triton.jit
def _half(pair, HIGH: tl.constexpr, F16: tl.constexpr):
    """The low (HIGH 0) or high 16-bit float of a uint32 pair, as float32."""
    bits = (pair >> (16 * HIGH)) & 0xFFFF
    if F16:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def int4_frag_tile(w_ptr, p_ptr, expert, tile0, c, NT: tl.constexpr, KC: tl.constexpr,
                   TILES: tl.constexpr, GC: tl.constexpr, NG: tl.constexpr,
                   F16: tl.constexpr):  # fmt: skip
    """Chunk c of tiles tile0 .. tile0 + TILES - 1 as float32 weights s (q - zero) for a tl.dot:
    rows g [8 TILES, 64] and rows g + 8 (row 8T + g of each, 0 past the last tile), columns
    in the words' order k' = 4 (4t + j) + e, and the chunk's columns [64] they stand for, 64c
    + 32 (j // 2) + 8t + 4 (j % 2) + e (mxfp4_mma.frag_tile's order)."""
    r = tl.arange(0, 8 * TILES)
    tile = tile0 + r // 8
    ok = tile < NT
    row_tile = expert * NT + tile.to(tl.int64)
    q = tl.arange(0, 16)  # a lane's t and word j: 4t + j
    at = ((row_tile * KC + c) * 128 + 16 * (r % 8))[:, None] + q[None, :]
    words = tl.load(w_ptr + at, mask=ok[:, None], other=0)
    p_at = ((row_tile * NG + c // GC) * 8 + r % 8) * 2
    pw = tl.load(p_ptr + p_at, mask=ok, other=0)
    zw = tl.load(p_ptr + p_at + 1, mask=ok, other=0)
    rows_g = _half_tile(words, pw, zw, 0, TILES, F16)
    rows_h = _half_tile(words, pw, zw, 1, TILES, F16)
    k = tl.arange(0, 64)
    t, j = k // 16, (k // 4) % 4
    return rows_g, rows_h, 64 * c + 32 * (j // 2) + 8 * t + 4 * (j % 2) + k % 4


@triton.jit
def _half_tile(words, pw, zw, H: tl.constexpr, TILES: tl.constexpr, F16: tl.constexpr):
    """Row half H's weights [8 TILES, 64] of a chunk's words [8 TILES, 16]: columns e = 0..3 of
    each word from nibbles H, H + 4, H + 2, H + 6."""
    minus = (_half(zw, H, F16) + (1024.0 if F16 else 128.0))[:, None]  # -zero
    scale = _half(pw, H, F16)[:, None, None, None]
    e0, e1 = _nibble(words, H) + minus, _nibble(words, H + 4) + minus
    e2, e3 = _nibble(words, H + 2) + minus, _nibble(words, H + 6) + minus
    values = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [.., 16, 2, 2]: e = 2a + b
    return tl.reshape(values * scale, (8 * TILES, 64))
