"""Triton RoPE fused with the KV-cache write: q and k rotated, k and v stored at their slots (an
fp8 cache: divided by their per-head scales and rounded to e4m3 as they are stored); optionally
each q and k head RMS-normalized first (Qwen3's q/k norms).

Compared with the torch rotation and cache write
in tests/unit/test_kernels.py and tests/unit/test_kv_fp8.py (TRITON_INTERPRET=1 on a CPU), and
compiled for sm_90 in tests/unit/test_kernels_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from noesis.kernels import pdl
from noesis.kernels.e4m3 import quantize_e4m3
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _rope_write(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_kt, stride_vt, stride_cos, stride_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr, FP8: tl.constexpr,
    QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # q, k and v come from the projection before
        gdc_launch_dependents()
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: query heads; H..H+Hkv-1: key heads
    is_key = head >= NUM_HEADS
    kv_head = head - NUM_HEADS
    if is_key:
        head_ptr = k_ptr + token * stride_kt + kv_head * HEAD_DIM
    else:
        head_ptr = q_ptr + token * stride_qt + head * HEAD_DIM
    half = tl.arange(0, HALF_PAD)
    ok = half < ROT_HALF
    cos = tl.load(cos_ptr + token * stride_cos + half, mask=ok, other=1.0)
    sin = tl.load(sin_ptr + token * stride_cos + half, mask=ok, other=0.0)
    x1 = tl.load(head_ptr + half, mask=ok, other=0.0)
    x2 = tl.load(head_ptr + ROT_HALF + half, mask=ok, other=0.0)
    dtype = x1.dtype
    if QK_NORM:  # RMSNorm over the head (rotary over all of it), rounded as the norm kernel
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / HEAD_DIM + eps)
        weight_ptr = q_norm_ptr
        if is_key:
            weight_ptr = k_norm_ptr
        w1 = tl.load(weight_ptr + half, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + ROT_HALF + half, mask=ok, other=0.0).to(tl.float32)
        x1 = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype)
    # Eager rounds each product to the model dtype before the add; do the same.
    r1 = (x1 * cos.to(dtype)).to(dtype) - (x2 * sin.to(dtype)).to(dtype)
    r2 = (x2 * cos.to(dtype)).to(dtype) + (x1 * sin.to(dtype)).to(dtype)
    tl.store(head_ptr + half, r1, mask=ok)
    tl.store(head_ptr + ROT_HALF + half, r2, mask=ok)
    if is_key:
        slot = tl.load(slots_ptr + token)
        dst = k_cache_ptr + slot * stride_slot + kv_head * stride_cache_head
        rest = 2 * ROT_HALF + tl.arange(0, DIM_PAD)  # channels past the rotary part pass through
        rest_ok = rest < HEAD_DIM
        k_rest = tl.load(head_ptr + rest, mask=rest_ok, other=0.0)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        v = tl.load(v_ptr + token * stride_vt + kv_head * HEAD_DIM + dims, mask=dim_ok, other=0.0)
        # New names for what is stored: r1 is from before this (runtime) branch, whose block
        # may not change its type to e4m3.
        if FP8:  # the rotated key and the value over their head's scales [2, Hkv]
            k_scale = tl.load(kv_scales_ptr + kv_head)
            v_scale = tl.load(kv_scales_ptr + NUM_KV_HEADS + kv_head)
            k1, k2 = quantize_e4m3(r1, k_scale), quantize_e4m3(r2, k_scale)
            k_stored_rest = quantize_e4m3(k_rest, k_scale)
            v_stored = quantize_e4m3(v, v_scale)
        else:
            k1, k2, k_stored_rest, v_stored = r1, r2, k_rest, v
        tl.store(dst + half, k1, mask=ok)
        tl.store(dst + ROT_HALF + half, k2, mask=ok)
        tl.store(dst + rest, k_stored_rest, mask=rest_ok)
        v_dst = v_cache_ptr + slot * stride_slot + kv_head * stride_cache_head
        tl.store(v_dst + dims, v_stored, mask=dim_ok)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, kv_scales: torch.Tensor | None = None,
                  qk_norm=None) -> None:
    """Rotate q [T, H, d] and k [T, Hkv, d] in place and store k, v at cache `slots`; with
    `qk_norm` = (q weight [d], k weight [d], eps) each q and k head is RMS-normalized first
    (rotary over the whole head only).

    Heads must be packed (stride d) inside each token row; rows may be strided (views of a fused
    qkv). cos/sin are [T, rotary_dim] with equal halves; channels past rotary_dim pass through.
    k_cache/v_cache are [num_pages, page_size, Hkv, d], addressed by slot = page * size + offset.
    An fp8 cache takes `kv_scales` [2, Hkv(, 1)] float32: the cache gets quantize(rotated k,
    k scale) and quantize(v, v scale) of noesis.kv.fp8, bit for bit (rotated first, in the
    model dtype, as the portable backend does); q and k stay rotated and unscaled.
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert slots.stride(0) == 1 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert q.stride(1) == head_dim and k.stride(1) == head_dim and v.stride(1) == head_dim
    fp8 = kv_scales is not None
    assert fp8 == (k_cache.dtype == torch.float8_e4m3fn), "an fp8 cache needs its scales"
    assert not fp8 or kv_scales.is_contiguous() and kv_scales.numel() == 2 * num_kv_heads
    rot_half = cos.shape[1] // 2
    assert qk_norm is None or 2 * rot_half == head_dim, "q/k norms with partial rotary"
    q_norm, k_norm, eps = qk_norm or (cos, cos, 0.0)
    _rope_write[(tokens, num_heads + num_kv_heads)](
        q, k, v, cos, sin, slots, k_cache, v_cache, kv_scales if fp8 else cos, q_norm, k_norm,
        eps, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROT_HALF=rot_half, HALF_PAD=triton.next_power_of_2(rot_half),
        DIM_PAD=triton.next_power_of_2(head_dim), FP8=fp8, QK_NORM=qk_norm is not None,
        num_warps=1, **pdl.pdl_launch(q),
    )
