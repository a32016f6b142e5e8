"""Fused operations, dispatched on the tensors' device: Triton on CUDA, PyTorch elsewhere.

The PyTorch versions are the reference: they round exactly where the Hugging Face eager code
rounds, so float32 parity holds on CPU. EngineConfig(triton_kernels=False) (`--no-triton-kernels`)
forces them on CUDA.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from noesis.kv.fp8 import FP8LayerCache

TRITON = True  # EngineConfig.triton_kernels: False runs the PyTorch ops on CUDA too


def configure(triton: bool, one_row_fusion: bool, pdl: bool) -> None:
    """Set the process-wide kernel switches from an EngineConfig (an engine built on CUDA calls
    this; benchmarks flip the flags directly to compare paths in one process)."""
    global TRITON, ONE_ROW_FUSION
    TRITON, ONE_ROW_FUSION = triton, one_row_fusion
    kernels = _triton() if triton else None
    if kernels is not None:
        kernels.pdl.PDL = kernels.pdl.GDC and pdl  # GDC: this Triton can emit PDL


@dataclass(frozen=True)
class TritonKernels:
    """The Triton kernel modules, by topic; their functions are looked up at each call."""

    pdl: ModuleType
    pointwise: ModuleType
    row_gemv: ModuleType
    rope: ModuleType
    packed_row: ModuleType  # noesis.quant.packed_row: row_gemv's for packed int4 / int8 weights
    bitmask: ModuleType
    race: ModuleType


@functools.cache
def _triton() -> TritonKernels | None:
    try:
        from noesis.kernels import bitmask, pdl, pointwise, rope, row_gemv
        from noesis.quant import packed_row
        from noesis.sampling import race_kernel
    except ImportError as exc:  # asked for on CUDA tensors only, so CPU-only installs stay quiet
        warnings.warn(f"Triton kernels unavailable ({exc}); CUDA runs the PyTorch ops, slower",
                      RuntimeWarning, stacklevel=2)
        return None
    return TritonKernels(pdl, pointwise, row_gemv, rope, packed_row, bitmask, race_kernel)


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and TRITON and _triton() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); residual None normalizes x alone."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _triton().pointwise.add_rms_norm(x, residual, weight, eps)
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), x


ONE_ROW_GEMV = True  # benchmarks flip these to compare against cuBLAS in one process
# The fused one-row decoder block (DecoderLayer.forward_one_row) for batch-1 decode on CUDA; on
# by default (EngineConfig.one_row_fusion, `--no-one-row-fusion`, turns it off). On an H200 it
# took the batch-1 graph from 4.50 to 4.10 ms (8B shape) and from 1.057 to 0.879 ms (1B)
# (`STAGES=fusion-ab bash benchmarks/gpu_session.sh`, 2026-11-23). Checked against the unfused
# blocks under Triton's interpreter, compiled for sm_90 on the CPU
# (tests/unit/test_kernels_compile.py) and on the GPU (tests/gpu/test_cuda.py).
ONE_ROW_FUSION = True


def _one_half_precision_row(x: torch.Tensor) -> bool:
    """A single token of a half-precision model on CUDA: what the one-row Triton kernels take."""
    return x.shape[0] == 1 and x.dtype != torch.float32 and use_triton(x)


def one_row_fusion(x: torch.Tensor) -> bool:
    """Whether a decoder block over x [T, D] runs as four fused one-row Triton projections
    (DecoderLayer.forward_one_row)."""
    return ONE_ROW_FUSION and _one_half_precision_row(x)


def _one_row(proj: torch.nn.Module):
    """The one-row kernels for a projection, what they take of it and their keyword arguments:
    row_gemv, the weight of an nn.Linear and its bias; noesis.quant.packed_row and the module
    itself of a bias-free PackedLinear (the two kinds models.layers.fusable_one_row admits)."""
    kernels = _triton()
    if type(proj) is torch.nn.Linear:
        return kernels.row_gemv, proj.weight, {"bias": proj.bias}
    return kernels.packed_row, proj, {}


def gemv(x: torch.Tensor, proj: torch.nn.Module, residual: torch.Tensor | None = None):
    """x [1, K] through proj (its bias, + residual), one Triton program per few output rows."""
    kernels, weight, extra = _one_row(proj)
    return kernels.gemv(x, weight, residual, **extra)


def norm_logits(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor):
    """float32 logits of rms_norm(x) for one row: the final norm and the LM head in one kernel."""
    return _triton().row_gemv.norm_logits(x, norm_weight, eps, weight)


def norm_router(x: torch.Tensor, norm: torch.nn.Module, router: torch.nn.Linear):
    """(router logits [1, E] in the model dtype, rms_norm(x) [1, K]) for one row of a MoE block,
    in one Triton kernel: the norm the experts take and the router over it."""
    normed = torch.empty_like(x)
    logits = _triton().row_gemv.norm_logits(x, norm.weight, norm.eps, router.weight,
                                            bias=router.bias, normed=normed, dtype=x.dtype)
    return logits, normed


def norm_glu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.nn.Module):
    """silu(gate) * up of rms_norm(x) through the [gate | up] projection for one row, in one
    Triton kernel."""
    kernels, weight, extra = _one_row(gate_up)
    return kernels.norm_glu(x, norm_weight, eps, weight, **extra)


def norm_qkv_rope_store(x, norm_weight, eps, qkv, num_heads, num_kv_heads, cos, sin, slots,
                        kv_cache, qk_norm=None):
    """rms_norm(x) through the fused qkv projection (a module, its bias), q and k rotated, k and
    v written to the paged cache [2, pages, page_size, Hkv, d] at slots[0] (an FP8LayerCache:
    quantized with its per-head scales as they are written): one Triton kernel for one token.
    With `qk_norm` = (q norm weight, k norm weight, eps), two: the projection, then each q and
    k head normalized, rotated and written by the RoPE kernel (on an H200 this beat one kernel
    normalizing inside its programs, which then had to hold whole heads: 728 / 719 against
    710 / 696 tok/s on Qwen3-30B-A3B's shape, benchmarks/RESULTS.md)."""
    pages, scales = ((kv_cache.data, kv_cache.scales) if isinstance(kv_cache, FP8LayerCache)
                     else (kv_cache, None))
    kernels, weight, extra = _one_row(qkv)
    if qk_norm is not None:  # row_gemv's kernels (models.layers.fusable_one_row)
        out = kernels.norm_logits(x, norm_weight, eps, weight, dtype=x.dtype, **extra)
        head_dim = out.shape[-1] // (num_heads + 2 * num_kv_heads)
        q, k, v = out.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)  # fmt: skip
        _triton().rope.rope_write_kv(
            q.view(1, num_heads, head_dim), k.view(1, num_kv_heads, head_dim),
            v.view(1, num_kv_heads, head_dim), cos, sin, slots, pages[0], pages[1], scales,
            qk_norm=qk_norm)  # fmt: skip
        return out
    return kernels.norm_qkv_rope_store(x, norm_weight, eps, weight, num_heads, num_kv_heads, cos,
                                       sin, slots, pages[0], pages[1], kv_scales=scales, **extra)


def row_projection(x: torch.Tensor, proj: torch.nn.Linear) -> torch.Tensor:
    """proj(x) for the output projection: one row of a half-precision model on CUDA (batch-1
    decode) through a Triton GEMV (its bias added in the kernel), which beats cuBLAS's split-K
    kernels on these square matrices; anything else through the module."""
    if (ONE_ROW_GEMV and _one_half_precision_row(x) and type(proj) is torch.nn.Linear
            and proj.weight.is_contiguous()):
        return gemv(x, proj)
    return proj(x)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar mask into the logits in place, one Triton kernel (CUDA only)."""
    return _triton().bitmask.apply_token_bitmask_(logits, bitmask)


def exponential_race(logits, temperature, seeds, steps, report: bool = False):
    """The sampler's argmax(logits / T - log E) in one Triton kernel (CUDA only); with `report`,
    (ids, reported ids) where -1 marks a row whose logits hold NaN or +inf or nothing finite."""
    return _triton().race.exponential_race(logits, temperature, seeds, steps, report)


def greedy_argmax(logits: torch.Tensor, report: bool = False):
    """Row-wise argmax of float32 logits [B, V] in two Triton launches (CUDA only); `report` as
    for exponential_race."""
    return _triton().race.greedy_argmax(logits, report)


def take_pending(ids: torch.Tensor, sources: torch.Tensor, previous: torch.Tensor) -> None:
    """ids[i] = previous[sources[i]] where sources[i] >= 0, in place (int64 tensors on one
    device): the tokens a step feeds from the step before it, not read back yet."""
    if use_triton(ids):
        _triton().pointwise.take_pending(ids, sources, previous)
        return
    torch.where(sources >= 0, previous[sources.clamp(min=0)], ids, out=ids)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, 2I] laid out [gate | up]."""
    if use_triton(gate_up) and gate_up.stride(-1) == 1:
        return _triton().pointwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

