"""Triton one-row projections for batch-1 decode, with their neighbours fused: RMSNorm before,
SiLU-and-multiply or RoPE plus the KV-cache write (bf16, or fp8 with per-head scales) after, the
residual added.

Compared with the unfused steps in tests/unit/test_kernels.py under TRITON_INTERPRET=1 on a CPU, and
compiled for sm_90 in tests/unit/test_kernels_compile.py.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from noesis.kernels import pdl
from noesis.kernels.e4m3 import quantize_e4m3
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait

PLAIN, GLU, QKV = 0, 1, 2  # _row_gemv modes; a kernel reads only constexpr globals:
_PLAIN, _GLU, _QKV = tl.constexpr(PLAIN), tl.constexpr(GLU), tl.constexpr(QKV)


@triton.jit
def _row_gemv(
    x_ptr, norm_ptr, w_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    kv_scales_ptr, bias_ptr, normed_ptr, N, eps, stride_slot, stride_cache_head,
    K: tl.constexpr, MODE: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PDL: tl.constexpr, FP8: tl.constexpr, BIAS: tl.constexpr, NORMED_OUT: tl.constexpr,
):
    """y = W @ f(x) for one row x [K], ROWS output rows per program (two blocks of them, PAIR
    rows apart, in the GLU and QKV modes), the whole of K in BLOCK_K tiles, no split-K.
    STAGES > 1 software-pipelines the tiles through shared memory (cp.async), so that many
    tiles are in flight per thread; 1 issues each tile's loads when its iteration starts.

    NORM: f is RMSNorm with weight norm_ptr, recomputed by every program (x is a few KB, read
    from L2). PLAIN: y = W f(x), plus res when RESIDUAL. GLU: W is [gate | up], PAIR = I
    apart; y [I] = silu(gate) * up. QKV: W is [q heads | k heads | v heads]; a program takes
    ROWS rows from each half of one head (PAIR = HEAD_DIM / 2), rotates q and k with cos/sin
    [HEAD_DIM / 2], and stores k and v at the cache slot as well as in y. FP8: the cache is
    e4m3 and gets k and v over their head's scale (kv_scales_ptr [2, Hkv]), as
    noesis.kv.fp8.quantize rounds them; y keeps them unscaled.

    BIAS adds bias_ptr [N] to the row sums before they are rounded. NORMED_OUT (with NORM) has
    program 0 also store f(x) at normed_ptr [K], for a next kernel to read.

    Every value is rounded to the model dtype where the unfused kernels round it."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty  # the model's; y may be float32 (logits)
    rows, row_ok, j, head = _program_rows(N, MODE, ROWS, HEAD_DIM)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # 64-bit: an LM head can pass 2^31 elements
    # The first K tile of weights owes nothing to the kernel before: read it before waiting.
    first = tl.arange(0, BLOCK_K)
    first_ok = row_ok[:, None] & (first < K)[None, :]  # K is constexpr: loads stay vectorized
    w_first = tl.load(w_rows + first[None, :], mask=first_ok, other=0.0)
    w_first_pair = w_first
    if MODE != _PLAIN:
        w_first_pair = tl.load(w_rows + PAIR * K + first[None, :], mask=first_ok, other=0.0)
    if PDL:
        gdc_wait()  # x, and the residual, come from the kernel before
    rstd = _rstd(x_ptr, eps, K, NORM, BLOCK_K)
    store_normed = NORMED_OUT and tl.program_id(0) == 0
    x_first = _x_tile(x_ptr, norm_ptr, first, K, rstd, NORM, DTYPE)
    if store_normed:
        tl.store(normed_ptr + first, x_first.to(DTYPE), mask=first < K)
    x_first = x_first[None, :]
    acc = w_first.to(tl.float32) * x_first
    acc_pair = w_first_pair.to(tl.float32) * x_first
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        cols = k + tl.arange(0, BLOCK_K)
        xf = _x_tile(x_ptr, norm_ptr, cols, K, rstd, NORM, DTYPE)
        if store_normed:
            tl.store(normed_ptr + cols, xf.to(DTYPE), mask=cols < K)
        xf = xf[None, :]
        tile_ok = row_ok[:, None] & (cols < K)[None, :]
        acc += tl.load(w_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xf
        if MODE != _PLAIN:
            acc_pair += tl.load(w_rows + PAIR * K + cols[None, :], mask=tile_ok,
                                other=0.0).to(tl.float32) * xf
    if PDL:
        gdc_launch_dependents()
    _row_epilogue(tl.sum(acc, 1), tl.sum(acc_pair, 1), rows, row_ok, j, head, y_ptr, res_ptr,
                  cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr,
                  stride_slot, stride_cache_head, MODE, RESIDUAL, PAIR, NUM_HEADS,
                  NUM_KV_HEADS, FP8, DTYPE, bias_ptr, BIAS)


# The prologue and epilogues below are shared with the packed-weight variant
# (noesis.quant.packed_row): one implementation of each fused neighbour.


@triton.jit
def _program_rows(N, MODE: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(rows, row_ok, j, head) of this program: ROWS consecutive output rows, or in the QKV
    mode ROWS rows j of the first half of one head (their pairs lie HEAD_DIM / 2 further)."""
    pid = tl.program_id(0)
    if MODE == _QKV:
        BLOCKS_PER_HEAD: tl.constexpr = HEAD_DIM // 2 // ROWS
        head = pid // BLOCKS_PER_HEAD
        j = (pid % BLOCKS_PER_HEAD) * ROWS + tl.arange(0, ROWS)
        rows = head * HEAD_DIM + j
    else:
        head = pid
        rows = pid * ROWS + tl.arange(0, ROWS)
        j = rows
    return rows, rows < N, j, head


@triton.jit
def _rstd(x_ptr, eps, K: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms(x) of the row x [K] (1 without NORM), recomputed by every program: x is a few
    KB, read from L2."""
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    return rstd


@triton.jit
def _row_epilogue(y, pair, rows, row_ok, j, head, y_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr,
                  k_cache_ptr, v_cache_ptr, kv_scales_ptr, stride_slot, stride_cache_head,
                  MODE: tl.constexpr, RESIDUAL: tl.constexpr, PAIR: tl.constexpr,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr,
                  DTYPE: tl.constexpr, bias_ptr=None, BIAS: tl.constexpr = False):
    """Stores a program's outputs from its float32 row sums y (and pair: the rows PAIR further,
    unused in the PLAIN mode), plus their bias (BIAS), each rounded to the model dtype first,
    as the modes of _row_gemv describe."""
    if BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if MODE != _PLAIN:
            pair += tl.load(bias_ptr + rows + PAIR, mask=row_ok, other=0.0).to(tl.float32)
    y = y.to(DTYPE)
    if MODE == _PLAIN:
        if RESIDUAL:
            y = y + tl.load(res_ptr + rows, mask=row_ok, other=0.0)
        tl.store(y_ptr + rows, y, mask=row_ok)
    elif MODE == _GLU:
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE)
        tl.store(y_ptr + rows, act * pair.to(DTYPE), mask=row_ok)
    else:
        pair = pair.to(DTYPE)
        first, second = y, pair
        if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate, rounding as _rope_write does
            cos = tl.load(cos_ptr + j).to(DTYPE)
            sin = tl.load(sin_ptr + j).to(DTYPE)
            first = (y * cos).to(DTYPE) - (pair * sin).to(DTYPE)
            second = (pair * cos).to(DTYPE) + (y * sin).to(DTYPE)
        tl.store(y_ptr + rows, first)
        tl.store(y_ptr + rows + PAIR, second)
        if head >= NUM_HEADS:
            slot = tl.load(slot_ptr)
            kv_head = head - NUM_HEADS  # 0..2 Hkv - 1: k heads, then v heads
            if kv_head < NUM_KV_HEADS:
                dst = k_cache_ptr + slot * stride_slot + kv_head * stride_cache_head
            else:
                dst = (v_cache_ptr + slot * stride_slot
                       + (kv_head - NUM_KV_HEADS) * stride_cache_head)
            if FP8:  # kv_scales [2, Hkv] flat: k's scales, then v's, in kv_head's order
                scale = tl.load(kv_scales_ptr + kv_head)
                tl.store(dst + j, quantize_e4m3(first, scale))
                tl.store(dst + j + PAIR, quantize_e4m3(second, scale))
            else:
                tl.store(dst + j, first)
                tl.store(dst + j + PAIR, second)


@triton.jit
def _x_tile(x_ptr, norm_ptr, cols, K: tl.constexpr, rstd, NORM: tl.constexpr,
            DTYPE: tl.constexpr):
    """The input's K tile at cols as float32: x, or rms_norm(x) * weight rounded as the norm
    kernel rounds it."""
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    if NORM:
        normed = (x.to(tl.float32) * rstd).to(DTYPE)
        x = (tl.load(norm_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
             * normed.to(tl.float32)).to(DTYPE)
    return x.to(tl.float32)


# (rows per program, K tile, warps, pipeline stages), looked up in order:
# - ROW_GEMV_TUNED, per (mode, N, K): set by benchmarks (graph_ab.py --tuned);
# - row_gemv_configs.json beside this file, per GPU name and "mode,N,K": what
#   benchmarks/gemv_fused.py --save-configs found on that GPU, inside CUDA graphs;
# - ROW_GEMV_CONFIGS, per mode. PLAIN's is the o_proj GEMV measured on an H200 (before STAGES
#   existed: its loop was not pipelined, as with 1 here).
ROW_GEMV_CONFIGS = {PLAIN: (8, 512, 8, 1), GLU: (4, 512, 8, 1), QKV: (8, 512, 8, 1)}
ROW_GEMV_TUNED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
CONFIG_FILE = Path(__file__).with_name("row_gemv_configs.json")


@functools.cache
def _device_configs(device: torch.device) -> dict[str, list[int]]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.loads(CONFIG_FILE.read_text()).get(name, {})


# A MoE router's few rows (32 to 128 experts): a program per row, so that they spread over the
# GPU instead of filling four to sixteen programs.
ROUTER_CONFIG = (1, 1024, 4, 1)


def row_gemv_config(mode: int, weight: torch.Tensor, default=None) -> tuple[int, int, int, int]:
    key = (mode, *weight.shape)
    if key in ROW_GEMV_TUNED:
        return ROW_GEMV_TUNED[key]
    tuned = _device_configs(weight.device).get(",".join(map(str, key)))
    return tuple(tuned) if tuned else default or ROW_GEMV_CONFIGS[mode]


def _launch_row_gemv(mode, x, weight, y, programs, config, *, norm=None, eps=0.0,
                     residual=None, pair=0, rope=None, heads=(0, 0, 0), kv_scales=None,
                     bias=None, normed=None):
    rows, block_k, warps, stages = config or row_gemv_config(mode, weight)
    n, k = weight.shape
    assert x.shape == (1, k) and weight.is_contiguous()
    assert residual is None or residual.shape == (1, n) and residual.is_contiguous()
    assert bias is None or bias.shape == (n,) and bias.is_contiguous()
    assert normed is None or norm is not None and normed.shape == (1, k)
    x = x.contiguous()
    cos, sin, slots, k_cache, v_cache = rope or (x, x, x, x, x)
    _row_gemv[(programs(rows),)](
        x, _or(norm, x), weight, y, _or(residual, x), cos, sin, slots, k_cache, v_cache,
        _or(kv_scales, x), _or(bias, x), _or(normed, x), y.shape[-1], eps,
        k_cache.stride(0) if rope else 0, k_cache.stride(1) if rope else 0,
        K=k, MODE=mode, NORM=norm is not None, RESIDUAL=residual is not None, ROWS=rows,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)), STAGES=stages, PAIR=pair,
        HEAD_DIM=heads[2], NUM_HEADS=heads[0], NUM_KV_HEADS=heads[1],
        FP8=kv_scales is not None, BIAS=bias is not None, NORMED_OUT=normed is not None,
        num_warps=warps,
        **pdl.pdl_launch(x),
    )
    return y


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The tensor, or an unused placeholder pointer for a kernel argument left off."""
    return placeholder if tensor is None else tensor


def gemv(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
         config=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias [N], rounded, + residual [1, N]) -> [1, N], without
    split-K. In CUDA graphs on an H200 (benchmarks/gemv_fused.py), before its first tile was
    peeled off the loop for PDL: o_proj of Llama-3.1-8B 11.4 us against cuBLAS's 13.2, of
    Llama-3.2-1B 3.1 against 5.0."""
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=x.dtype)
    return _launch_row_gemv(PLAIN, x, weight, y, lambda rows: triton.cdiv(y.shape[1], rows),
                            config, residual=residual, bias=bias)


def norm_logits(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                config=None, bias: torch.Tensor | None = None,
                normed: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """Logits [1, V] of rms_norm(x) for one row x [1, K] through the LM head [V, K] (+ bias
    [V]), rounded to the model dtype first as the unfused head's output is, stored as `dtype`.
    Also a MoE router (`normed` [1, K]: rms_norm(x) stored there too, the experts' input) and
    a plain normed projection (Qwen3's qkv, whose heads the RoPE kernel normalizes)."""
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=dtype)
    if config is None and normed is not None:
        config = row_gemv_config(PLAIN, weight, ROUTER_CONFIG)
    return _launch_row_gemv(PLAIN, x, weight, y, lambda rows: triton.cdiv(y.shape[1], rows),
                            config, norm=norm_weight, eps=eps, bias=bias, normed=normed)


def norm_glu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
             config=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) for one row x [1, K] and gate_up [2I, K] (+ bias [2I])
    -> [1, I]."""
    half = gate_up.shape[0] // 2
    y = torch.empty(1, half, device=x.device, dtype=x.dtype)
    return _launch_row_gemv(GLU, x, gate_up, y, lambda rows: triton.cdiv(half, rows), config,
                            norm=norm_weight, eps=eps, pair=half, bias=bias)


def norm_qkv_rope_store(x, norm_weight, eps, qkv, num_heads, num_kv_heads, cos, sin, slots,
                        k_cache, v_cache, config=None, kv_scales=None, bias=None):
    """The fused qkv projection of rms_norm(x) for one token x [1, K] (+ bias [(H + 2 Hkv) d]),
    q and k rotated (cos/sin [1, head_dim], equal halves), k and v stored at cache slot
    slots[0] (caches [pages, page_size, Hkv, d]; an fp8 cache with its `kv_scales` [2, Hkv(,
    1)] float32 stores noesis.kv.fp8.quantize of them). Returns qkv [1, (H + 2 Hkv) d],
    rotated, unscaled."""
    heads = num_heads + 2 * num_kv_heads
    head_dim = qkv.shape[0] // heads
    half = head_dim // 2
    rows, *rest = config or row_gemv_config(QKV, qkv)
    rows = math.gcd(rows, half)  # a program's rows stay inside a half head (a power of two)
    config = (rows, *rest)
    assert cos.shape[-1] == head_dim and slots.numel() >= 1
    assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1
    assert v_cache.stride()[:2] == k_cache.stride()[:2]
    assert (kv_scales is not None) == (k_cache.dtype == torch.float8_e4m3fn)
    assert kv_scales is None or kv_scales.is_contiguous() and kv_scales.numel() == 2 * num_kv_heads
    y = torch.empty(1, qkv.shape[0], device=x.device, dtype=x.dtype)
    return _launch_row_gemv(
        QKV, x, qkv, y, lambda rows: heads * (half // rows), config, norm=norm_weight, eps=eps,
        pair=half, rope=(cos, sin, slots, k_cache.view(-1, *k_cache.shape[2:]),
                         v_cache.view(-1, *v_cache.shape[2:])),
        heads=(num_heads, num_kv_heads, head_dim), kv_scales=kv_scales, bias=bias,
    )
