"""Triton grammar mask: -inf into the logits of tokens whose bit in the packed mask is 0.

Compared with structured/bitmask.py's torch path
in tests/unit/test_kernels.py (TRITON_INTERPRET=1 on a CPU), and compiled for sm_90 in
tests/unit/test_kernels_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask(logits_ptr, mask_ptr, V, stride_l, stride_lv, stride_m, stride_mw,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    words = tl.load(mask_ptr + row * stride_m + (cols // 32) * stride_mw, mask=ok, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols * stride_lv, float("-inf"), mask=ok & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (in place) where bit t % 32 of bitmask [B, W] int32 word t // 32 is 0."""
    batch, vocab = logits.shape
    block = 2048
    _apply_bitmask[(batch, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), logits.stride(1), bitmask.stride(0),
        bitmask.stride(1), BLOCK=block, num_warps=4,
    )
    return logits
