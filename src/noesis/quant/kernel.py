"""The dequantizing matmul on CUDA: y = x @ dequantize(W)^T with W packed as in
noesis.quant.packing, one Triton kernel launched two ways.

- decode (M <= 16): one 16-row MMA tile covers the whole batch, narrow blocks of output rows
  and the K range split over programs, so that a 4096-wide projection still fills the GPU; the
  per-split float32 partials are summed in a fixed order (deterministic, no atomics).
- prefill: square-ish tiles over M and N, the whole of K per program.

Each program loads a [BLOCK_K / pack, BLOCK_N] tile of words once, unpacks it in registers,
subtracts the zero points, scales (float32, rounded once to the model dtype, as the portable
path rounds) and feeds tl.dot. No host sync and only stream-ordered allocations: the launch
captures into CUDA graphs. Checked against the portable path under TRITON_INTERPRET=1
(tests/unit/test_quant_linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_ROWS = 16  # batches up to this many rows take the decode launch
TARGET_PROGRAMS = 264  # about two waves on an H100's 132 SMs (not tuned on the device yet)


@triton.jit
def _packed_matmul(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, g_ptr, y_ptr,
    M, N, stride_xm, stride_ys,
    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    ACT_ORDER: tl.constexpr, PER_COLUMN: tl.constexpr, K_SPLIT: tl.constexpr,
    ZERO: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[split] [M, N] = x[:, split's K range] @ W[:, K range]^T. PER_COLUMN: each column's
    group looked up (g_idx when ACT_ORDER, else k // GROUP); otherwise one group per K tile.
    ZERO < 0: per-group zero points from z_ptr, else that constant; HAS_MIN: W += m_ptr's
    per-group additive minimums (GGUF's Q4_1 / K-quants)."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    shifts = (tl.arange(0, PACK) * BITS)[None, :, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, K_SPLIT, BLOCK_K):
        k0 = split * K_SPLIT + step
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
            ok = col_ok[None, :] & (k0 < K)  # a last split may run past K
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
    out = y_ptr + split * stride_ys + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


def packed_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  qzeros: torch.Tensor | int, groups: torch.Tensor | None, bits: int,
                  group_size: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(W)^T -> [M, N] in x's dtype; `groups` [K] int32 is the act-order
    table (None: consecutive groups of group_size columns); `qzeros` an int: one zero point
    for every group; `mins` [N, G]: added to every dequantized weight of its group."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * (32 // bits) == k and x.stride(1) == 1
    decode = m <= DECODE_ROWS
    block_m, block_n, block_k = (16, 32, 128) if decode else (64, 64, 64)
    num_groups = scales.shape[1]
    if num_groups > 1 and 16 <= group_size < block_k and block_k % group_size == 0:
        block_k = group_size  # one group per tile: a scale and a zero per column, not a gather
    per_column = groups is not None or (num_groups > 1 and group_size % block_k != 0)
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    splits = min(k_tiles, max(1, TARGET_PROGRAMS // programs)) if decode else 1
    k_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_split)
    y = torch.empty(splits, m, n, device=x.device,
                    dtype=x.dtype if splits == 1 else torch.float32)
    constant_zero = isinstance(qzeros, int)
    _packed_matmul[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)](
        x, qweight, scales, scales if constant_zero else qzeros,
        scales if mins is None else mins, groups if groups is not None else qweight, y,
        m, n, x.stride(0), m * n,
        K=k, BITS=bits, GROUP=group_size, GROUPS=num_groups, ACT_ORDER=groups is not None,
        PER_COLUMN=per_column, K_SPLIT=k_split,
        ZERO=qzeros if constant_zero else -1, HAS_MIN=mins is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)
