"""Where the Triton kernels may run inline PTX: not under Triton's CPU interpreter (which runs no
assembly), and, for the int4 GEMV's bfloat16x2 arithmetic (quant/kernel.py's `_pair_dots`) and
the fragment GEMV's mma.sync (frag_gemv.py: MXFP4 and int4), only on compute capability 8.0 and
later. Where it may not, those kernels compute the same sums in float32 Triton operations."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: no assembly


def bf16x2_asm(device: torch.device) -> bool:
    """Whether kernels on `device` may run bfloat16x2 inline PTX."""
    return device.type == "cuda" and not INTERPRET and _sm80(device)


@functools.cache
def _sm80(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def word_aligned(x: torch.Tensor) -> torch.Tensor:
    """`x`, or a contiguous copy of it where its rows do not start on 4-byte boundaries: the
    bfloat16x2 paths read a 16-bit input as int32 words (a slice at an odd column would fault)."""
    if x.data_ptr() % 4 == 0 and (x.dim() < 2 or x.stride(0) % 2 == 0):
        return x
    return x.clone(memory_format=torch.contiguous_format)


# A bfloat16 x's eight columns read as four int32 words ($4-$7: columns (0, 1), (2, 3), (4, 5),
# (6, 7)) -> the pairs (j, j + 4), j = 0..3, that the int4 GEMV multiplies with, column j in the
# low half: a byte permute each.
_PAIRS_ASM = tl.constexpr("""{
prmt.b32 $0, $4, $6, 0x5410; prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410; prmt.b32 $3, $5, $7, 0x7632;
}""")


@triton.jit
def bf16_pairs(x01, x23, x45, x67, ASM: tl.constexpr):
    """uint32 words of a bfloat16 x's columns (0, 1), (2, 3), (4, 5), (6, 7) -> the pairs
    (0, 4), (1, 5), (2, 6), (3, 7) as uint32 bfloat16x2. Without ASM (see bf16x2_asm) the same
    pairs by integer operations."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r",
            [x01, x23, x45, x67], dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    else:
        p0, p1 = (x01 & 0xFFFF) | (x45 << 16), (x01 >> 16) | (x45 & 0xFFFF0000)
        p2, p3 = (x23 & 0xFFFF) | (x67 << 16), (x23 >> 16) | (x67 & 0xFFFF0000)
    return p0, p1, p2, p3
