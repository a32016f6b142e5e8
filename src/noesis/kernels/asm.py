"""Where the Triton kernels may run inline PTX: not under Triton's CPU interpreter (which runs no
assembly), and, for the bfloat16x2 arithmetic the 4-bit decode GEMVs use (quant/kernel.py's
`_pair_dots`, moe_triton.py's `_e2m1_dots`), only on compute capability 8.0 and later. Where it
may not, those kernels compute the same sums in float32 Triton operations."""

from __future__ import annotations

import functools
import os

import torch

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
