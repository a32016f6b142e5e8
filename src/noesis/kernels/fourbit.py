"""4-bit weights times one activation row on the tensor cores (CUDA, Triton): the decode GEMV of
MXFP4 experts and of int4 checkpoints without its FMAs on the CUDA cores.

At batch 1 a 4-bit GEMV on the CUDA cores runs out of instructions before it runs out of
bandwidth: unpacking a code, converting it and one FMA cost 5-8 instructions, and an H200 issues
about 3.5 per code at full bandwidth. Here a code costs one to three instructions and the
products go to the MMA, which has cycles to spare at one row:

- `unpack_e2m1` / `unpack_u4` turn 4 packed bytes (8 codes, the low nibble first) into bfloat16
  pairs in a few PRMT / LOP3 / shift instructions (inline PTX, 4 bytes per call): the low
  nibbles are the tile's even columns, the high nibbles its odd ones. E2M1's bits are placed
  under bfloat16's sign, exponent and mantissa, which makes the value times 2^-126 (0.5 a
  subnormal), and one bf16x2 multiply by 2^126 makes it exact; an unsigned code becomes
  128 + code by OR-ing it into 128's mantissa.
- `group_columns` spreads one row of x over G rows, one per scale group (row g holds the
  columns of group g, zeros elsewhere): the dot of the weight tile with it is each group's
  partial sum for every output row at once ([ROWS, G]), so the group scales (and int4 zero
  points) apply after the MMA, per group, not per weight. The MMA's 16 rows are these groups,
  not padding.

Every sum is float32 (the MMA's accumulator). `tests/gpu/test_fourbit_cuda.py` checks these
against dequantize-then-matmul; they have no CPU path (inline PTX), and their callers keep the
CUDA-core kernels for other dtypes and for the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP_ROWS = tl.constexpr(16)  # rows of the spread x: the MMA's smallest side, and the groups per K tile


@triton.jit
def unpack_e2m1(packed):
    """uint8 [..., B] of MXFP4 bytes -> (low nibbles, high nibbles) as bfloat16 [..., B], their
    E2M1 values exactly: bits (c & 7) << 6 | (c & 8) << 12 times 2^126 (0x7E80)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, t, u, m, s, bias;
        mov.b32 z, 0;
        mov.b32 bias, 0x7E807E80;
        prmt.b32 t, $4, z, 0x4140;
        prmt.b32 u, $4, z, 0x4342;
        shl.b32 m, t, 6;
        and.b32 m, m, 0x01C001C0;
        shl.b32 s, t, 12;
        and.b32 s, s, 0x80008000;
        or.b32 m, m, s;
        mul.rn.bf16x2 $0, m, bias;
        shl.b32 m, u, 6;
        and.b32 m, m, 0x01C001C0;
        shl.b32 s, u, 12;
        and.b32 s, s, 0x80008000;
        or.b32 m, m, s;
        mul.rn.bf16x2 $1, m, bias;
        shl.b32 m, t, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 s, t, 8;
        and.b32 s, s, 0x80008000;
        or.b32 m, m, s;
        mul.rn.bf16x2 $2, m, bias;
        shl.b32 m, u, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 s, u, 8;
        and.b32 s, s, 0x80008000;
        or.b32 m, m, s;
        mul.rn.bf16x2 $3, m, bias;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def unpack_u4(packed):
    """uint8 [..., B] holding two unsigned 4-bit codes each (the low nibble first) -> (128 + low,
    128 + high) as bfloat16 [..., B], exact: the code OR-ed into 128's mantissa (0x4300)."""
    # the magic number comes in as a register operand (broadcast, so materialized once): LOP3
    # takes one 32-bit immediate, and a second one is rebuilt by a move before every use
    magic = tl.full(packed.shape, 0x43004300, tl.int32)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, t, u;
        mov.b32 z, 0;
        prmt.b32 t, $4, z, 0x4140;
        prmt.b32 u, $4, z, 0x4342;
        lop3.b32 $0, t, 0x000F000F, $5, 0xEA;
        lop3.b32 $1, u, 0x000F000F, $5, 0xEA;
        shr.b32 t, t, 4;
        shr.b32 u, u, 4;
        lop3.b32 $2, t, 0x000F000F, $5, 0xEA;
        lop3.b32 $3, u, 0x000F000F, $5, 0xEA;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, magic],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def unpack_u4_half(packed):
    """unpack_u4 for float16: (1024 + low, 1024 + high), the code OR-ed into 1024's (0x6400)."""
    # the magic number comes in as a register operand (broadcast, so materialized once): LOP3
    # takes one 32-bit immediate, and a second one is rebuilt by a move before every use
    magic = tl.full(packed.shape, 0x64006400, tl.int32)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, t, u;
        mov.b32 z, 0;
        prmt.b32 t, $4, z, 0x4140;
        prmt.b32 u, $4, z, 0x4342;
        lop3.b32 $0, t, 0x000F000F, $5, 0xEA;
        lop3.b32 $1, u, 0x000F000F, $5, 0xEA;
        shr.b32 t, t, 4;
        shr.b32 u, u, 4;
        lop3.b32 $2, t, 0x000F000F, $5, 0xEA;
        lop3.b32 $3, u, 0x000F000F, $5, 0xEA;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, magic],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def group_columns(x, PER_GROUP: tl.constexpr):
    """x [B] -> [B, GROUP_ROWS]: column g holds x where index // PER_GROUP == g, else 0 (x^T
    spread over the groups, the right operand of tl.dot(weights [ROWS, B], ...))."""
    B: tl.constexpr = x.shape[0]
    group = tl.arange(0, B) // PER_GROUP
    mine = group[:, None] == tl.arange(0, GROUP_ROWS)[None, :]
    return tl.where(mine, x[:, None], tl.zeros_like(x)[:, None])
