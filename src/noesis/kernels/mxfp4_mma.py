"""MXFP4 experts laid out as tensor-core fragments, and the decode GEMV over them.

A GEMV of one token against MXFP4 weights spends its instructions on turning codes into
numbers: the bfloat16x2 CUDA-core path (`moe_triton._e2m1_dots`) takes about 3.6 a code. Here
the weights are rearranged once, at load, into the operand registers of the tensor cores'
`mma.sync.m16n8k16` (bfloat16 in, float32 out): one int32 word per thread and mma holds the
thread's eight codes of a 16 x 16 A fragment, with each code's bits placed so that four
bfloat16x2 registers come out of the word in 11 integer operations (a rotate, a mask, a merge).
x is the B operand, the same in all eight columns, so every lane's accumulators hold its two
rows' sums; the products and their sums are float32, each block of 32 codes scaled once.

Layout (`to_fragments`), for weights [E, N, K]: rows in tiles of 16, K in chunks of 64.
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
half's code 16 bits above; rotating the word left by those amounts puts the sign at bit 15
and the magnitude at 6-8, which is bfloat16's value x 2^-126 (`moe_triton._e2m1_dots` says
why). The four (sign, magnitude) rotations were searched for the fewest operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per fragment tile
CHUNK = 64  # columns per chunk (four mma's of 16)
SIGN_ROT = (0, 1, 2, 6)
MAG_ROT = (0, 3, 12, 6)


@dataclass(frozen=True)
class Mxfp4Fragments:
    """Stacked expert weights [E, N, K] in the fragment layout (`to_fragments`). With
    `gate_up`, the rows are [gate; up] (N = 2I) and tile T holds gate and up of columns
    8T .. 8T + 7 (rows g and g + 8)."""

    words: torch.Tensor  # [E, N' / 16, K' / 64, 32, 4] int32
    scales: torch.Tensor  # [E, N' / 16, K' / 64, 8] int32
    rows: int
    cols: int
    gate_up: bool = False

    @classmethod
    def pack(cls, blocks: torch.Tensor, scales: torch.Tensor, gate_up: bool = False):
        """From MXFP4 as stored (`weights.mxfp4.Mxfp4Weight`'s blocks and scales)."""
        rows = blocks.shape[1]
        order = gate_up_rows(rows // 2, blocks.device) if gate_up else None
        words, packed = to_fragments(blocks, scales, order)
        return cls(words, packed, rows, blocks.shape[2] * 32, gate_up)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.words.shape[0], self.rows, self.cols

    @property
    def tiles(self) -> int:
        return self.words.shape[1]

    @property
    def chunks(self) -> int:
        return self.words.shape[2]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in the caller's row order."""
        n = self.tiles * ROWS
        values = from_fragments(self.words, self.scales, n, self.cols, dtype)
        if not self.gate_up:
            return values[:, : self.rows]
        inner = self.rows // 2
        order = gate_up_rows(inner, values.device)
        out = values.new_empty(values.shape[0], self.rows, self.cols)
        keep = order >= 0
        out[:, order[keep]] = values[:, keep]
        return out


def gate_up_rows(inner: int, device) -> torch.Tensor:
    """Fragment row order of a [gate; up] projection: tile T's rows g and g + 8 are gate and
    up of column 8T + g (-1 past the last column)."""
    r = torch.arange(2 * 8 * -(-inner // 8), device=device)
    cols = (r // 16) * 8 + r % 8
    rows = cols + (r % 16 >= 8) * inner
    return torch.where(cols < inner, rows, -1)


def bits_of(register: int, half: int) -> tuple[int, int]:
    """(sign bit, lowest magnitude bit) in the packed word of fragment register `register`'s
    code in `half` (0 low, 1 high)."""
    return ((15 + 16 * half - SIGN_ROT[register]) % 32,
            (6 + 16 * half - MAG_ROT[register]) % 32)  # fmt: skip


def to_fragments(
    blocks: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as stored (blocks [E, N, G, 16] uint8, two codes a byte, low nibble first; scales
    [E, N, G] uint8) -> (words, scales) in the fragment layout. `rows` [N'] orders the rows
    (an entry < 0 is a zero row); N' and G * 32 are padded to 16 and 64. One expert at a time
    (the temporaries are eight bytes a code)."""
    if blocks.shape[0] > 1:
        parts = [to_fragments(blocks[e : e + 1], scales[e : e + 1], rows)
                 for e in range(blocks.shape[0])]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    experts, n, groups, _ = blocks.shape
    device = blocks.device
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(experts, n, groups * 32)
    exps = scales
    if rows is not None:  # a zero row past the last for rows < 0
        codes = torch.cat((codes, codes.new_zeros(experts, 1, codes.shape[2])), dim=1)
        exps = torch.cat((exps, exps.new_full((experts, 1, groups), 127)), dim=1)
        rows = torch.where(rows < 0, n, rows).to(device)
        codes, exps, n = codes[:, rows], exps[:, rows], rows.numel()
    tiles, chunks = -(-n // ROWS), -(-groups * 32 // CHUNK)
    codes = _pad(codes, (0, chunks * CHUNK - groups * 32, 0, tiles * ROWS - n), 0)
    exps = _pad(exps, (0, 2 * chunks - groups, 0, tiles * ROWS - n), 127)
    # codes[e, T, h, g, c, b, t, i, col] -> word (e, T, c, lane = 4g + t, j = 2b + i)
    codes = codes.reshape(experts, tiles, 2, 8, chunks, 2, 4, 2, 4).long()
    codes = codes.permute(0, 1, 4, 3, 6, 5, 7, 2, 8)  # e, T, c, g, t, b, i, h, col
    word = torch.zeros(codes.shape[:-2], dtype=torch.int64, device=device)
    for h in range(2):
        for col in range(4):
            register, half = 2 * (col // 2) + h, col % 2
            sign, mag = bits_of(register, half)
            code = codes[..., h, col]
            word |= ((code >> 3) & 1) << sign
            word |= (code & 7) << mag
    words = _as_int32(word).reshape(experts, tiles, chunks, 32, 4)
    # exps[e, T, h, g, c, b] -> (e, T, c, g) with byte 2h + b
    exps = exps.reshape(experts, tiles, 2, 8, chunks, 2).permute(0, 1, 4, 3, 2, 5).long()
    shifts = 8 * torch.arange(4, device=device)
    packed = (exps.reshape(experts, tiles, chunks, 8, 4) << shifts).sum(-1)
    return words.contiguous(), _as_int32(packed).contiguous()


def from_fragments(words: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """The fragment layout back to values [E, N, K] (rows in the packed order, padding cut)."""
    from noesis.weights.mxfp4 import FP4_VALUES

    experts, tiles, chunks = words.shape[:3]
    word = words.long() & 0xFFFFFFFF  # [e, T, c, lane, j]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=words.device)
    values = torch.empty(experts, tiles, chunks, 32, 4, 2, 4, dtype=torch.float32,
                         device=words.device)  # fmt: skip
    for h in range(2):
        for col in range(4):
            sign, mag = bits_of(2 * (col // 2) + h, col % 2)
            code = (((word >> sign) & 1) << 3) | ((word >> mag) & 7)
            values[..., h, col] = lut[code]
    # [e, T, c, g, t, b, i, h, col] -> [e, T, h, g, c, b, t, i, col]
    values = values.reshape(experts, tiles, chunks, 8, 4, 2, 2, 2, 4)
    values = values.permute(0, 1, 7, 3, 2, 5, 4, 6, 8).reshape(experts, tiles * 16, chunks * 64)
    exps = (scales.long() & 0xFFFFFFFF)[..., None] >> (8 * torch.arange(4, device=words.device))
    exps = (exps & 255).reshape(experts, tiles, chunks, 8, 2, 2)  # e, T, c, g, h, b
    exps = exps.permute(0, 1, 4, 3, 2, 5).reshape(experts, tiles * 16, chunks * 2)
    values = values * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=2)
    return values[:, :n, :k].to(dtype)


def _pad(t: torch.Tensor, pad: tuple[int, ...], value: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, pad, value=value) if any(pad) else t


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the same bits as int32."""
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


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
_CHUNK_ASM = tl.constexpr(
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
def frag_gemv(x_row, w_ptr, s_ptr, expert, tile0, NT: tl.constexpr, KC: tl.constexpr,
              K: tl.constexpr, WARPS: tl.constexpr, KSPLIT: tl.constexpr, CH: tl.constexpr,
              NO_ASM: tl.constexpr):  # fmt: skip
    """Tiles tile0 .. tile0 + WARPS - 1 of expert's fragment-layout weights times a bfloat16
    x_row -> (sums of rows g, sums of rows g + 8) [WARPS * 32] float32, lane-major (tile w's
    lane 4g + t at 32w + 4g + t; the four t hold the same sums). WARPS * KSPLIT warps: KSPLIT
    of them share a tile's chunks, each CH chunks an iteration, the next iteration's loaded
    while this one computes; their sums meet at the end."""
    LANES: tl.constexpr = WARPS * 32
    SPAN: tl.constexpr = KSPLIT * CH  # chunks an iteration
    m = tl.arange(0, CH * KSPLIT * LANES)
    c_in = (m // (KSPLIT * LANES)) + CH * ((m // LANES) % KSPLIT)  # the chunk in an iteration
    lane = m % 32
    tile = tile0 + (m // 32) % WARPS
    tile_ok = tile < NT
    base = (expert * NT + tile.to(tl.int64)) * KC
    xw = x_row.to(tl.pointer_type(tl.uint32))
    zero = tl.zeros((CH * KSPLIT * LANES,), tl.float32)
    sum_g, sum_h = zero, zero
    w, xa, xb, sw = _frag_load(w_ptr, s_ptr, xw, base, tile_ok, c_in, lane, K, KC)
    for c0 in range(0, KC, SPAN):  # (two iterations ahead measured slower, RESULTS.md)
        nw, nxa, nxb, nsw = _frag_load(w_ptr, s_ptr, xw, base, tile_ok, c0 + SPAN + c_in, lane,
                                       K, KC)  # fmt: skip
        sum_g, sum_h = _frag_chunk(w, xa, xb, sw, sum_g, sum_h, NO_ASM)
        w, xa, xb, sw = nw, nxa, nxb, nsw
    sum_g = tl.sum(tl.reshape(sum_g, (CH * KSPLIT, LANES)), axis=0) * 67108864.0  # 2^26
    sum_h = tl.sum(tl.reshape(sum_h, (CH * KSPLIT, LANES)), axis=0) * 67108864.0
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
def _frag_load(w_ptr, s_ptr, xw, base, tile_ok, c, lane, K: tl.constexpr, KC: tl.constexpr):
    """Chunk c of each element's tile: its lane's four words [M, 4], x's two runs [M, 4] each as
    bfloat16 pairs (0 past K), and its scale word [M]."""
    ok = tile_ok & (c < KC)
    quad = tl.arange(0, 4)[None, :]
    at = (((base + c) * 32 + lane) * 4)[:, None] + quad
    words = tl.load(w_ptr + at, mask=ok[:, None], other=0)
    x_at = (c * 32 + (lane % 4) * 4)[:, None] + quad
    xa = tl.load(xw + x_at, mask=ok[:, None] & (x_at < K // 2), other=0)
    xb = tl.load(xw + x_at + 16, mask=ok[:, None] & (x_at + 16 < K // 2), other=0)
    sw = tl.load(s_ptr + (base + c) * 8 + lane // 4, mask=ok, other=0)
    return words, xa, xb, sw


@triton.jit
def _frag_chunk(words, xa, xb, sw, sum_g, sum_h, NO_ASM: tl.constexpr):
    w0, w1, w2, w3 = _quad(words)
    x0, x1, x2, x3 = _quad(xa)
    x4, x5, x6, x7 = _quad(xb)
    if NO_ASM:
        sum_g, sum_h = _chunk_sums(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw, sum_g,
                                   sum_h)  # fmt: skip
    else:
        sum_g, sum_h = tl.inline_asm_elementwise(
            _CHUNK_ASM, "=f,=f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [sum_g, sum_h, w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip
    return sum_g, sum_h


@triton.jit
def _quad(t):
    """[M, 4] -> its four columns."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    a, c = tl.split(even)
    b, d = tl.split(odd)
    return a, b, c, d


@triton.jit
def _chunk_sums(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, sw, sum_g, sum_h):
    """`_CHUNK_ASM`'s sums in float32 Triton operations (the interpreter, GPUs before sm_80):
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
    return total * (1.0 / 4096)  # _e2m1's 2^-14 -> 2^-26


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
    code = (((word >> SIGN) & 1) << 3) | ((word >> MAG) & 7)
    bits = (((code & 8) << 12) | ((code & 7) << 9)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


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

