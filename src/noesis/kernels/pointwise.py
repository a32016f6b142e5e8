"""Triton row-wise kernels of the decode path: fused add + RMSNorm, SiLU(gate) * up, and the
gather of tokens a step feeds from the step before it (take_pending).

Compared with kernels/ops.py's PyTorch references
in tests/unit/test_kernels.py (TRITON_INTERPRET=1 on a CPU), and compiled for sm_90 in
tests/unit/test_kernels_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- fused add + RMSNorm ------------------------------------------------------------------------


@triton.jit
def _add_rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, N,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model dtype first, as the eager residual stream is.
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(
        x.dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x [T, D]; residual None means x alone."""
    rows, dim = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, eps, dim,
        x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
        res_out.stride(0), HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(dim), num_warps=8 if dim >= 2048 else 4,
    )
    return out, res_out


# ---- SiLU(gate) * up ----------------------------------------------------------------------------


@triton.jit
def _silu_mul(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0)
    # Match eager rounding: silu(gate) is rounded to the model dtype before the multiply.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * stride_o + cols, act * up, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] laid out [gate | up]; returns [T, I]."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul[(rows, triton.cdiv(half, block))](
        gate_up, out, half, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out


# ---- tokens fed from the step before ----------------------------------------------------------


@triton.jit
def _take_pending(ids_ptr, src_ptr, prev_ptr, n, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    source = tl.load(src_ptr + rows, mask=rows < n, other=-1)
    take = source >= 0
    token = tl.load(prev_ptr + tl.where(take, source, 0), mask=take)
    tl.store(ids_ptr + rows, token, mask=take)


def take_pending(ids: torch.Tensor, sources: torch.Tensor, previous: torch.Tensor) -> None:
    """ids[i] = previous[sources[i]] where sources[i] >= 0, in place, one launch."""
    if ids.stride(0) != 1 or sources.stride(0) != 1:
        raise ValueError("take_pending needs ids and sources with unit stride")
    n = ids.shape[0]
    _take_pending[(1,)](ids, sources, previous.contiguous(), n,
                        BLOCK=max(triton.next_power_of_2(n), 16), num_warps=1)
