"""The fused one-row decoder block for packed int4 / int8 weights (PackedLinear, AWQ / GPTQ
without act-order): noesis.kernels.row_gemv's projections with W read packed as
noesis.quant.kernel._packed_gemv reads it, and the same neighbours fused, by the same code
(row_gemv's prologue and epilogue helpers): RMSNorm before, SiLU-and-multiply or RoPE plus the
KV-cache write (bf16, or fp8 with per-head scales) after, the residual added. Batch-1 decode on
CUDA takes six launches per layer, as with float weights.

Compared with PackedLinear and the unfused steps in tests/unit/test_quant_packed_row.py under
TRITON_INTERPRET=1 on a CPU, and compiled for sm_90 in tests/unit/test_kernels_compile.py.
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
from noesis.kernels.asm import bf16x2_asm, word_aligned
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait
from noesis.kernels.row_gemv import (
    _PLAIN,
    GLU,
    PLAIN,
    QKV,
    _program_rows,
    _row_epilogue,
    _rstd,
    _x_tile,
)
from noesis.quant.kernel import (
    _device_name,
    _pair_dots,
    _pairs_of_floats,
    _pairs_of_words,
    _run_length,
    _word_dots,
    _zero_point,
    field_mask,
    gemv_config,
)


@triton.jit
def _packed_row_gemv(
    x_ptr, norm_ptr, w_ptr, s_ptr, z_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, kv_scales_ptr, N, eps, stride_slot, stride_cache_head, field,
    K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    SUB: tl.constexpr, ZERO: tl.constexpr, MODE: tl.constexpr, NORM: tl.constexpr,
    RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    PAIR: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr,
):
    """_row_gemv (its modes, NORM, RESIDUAL, FP8, PDL and rows per program) with W packed: rows
    of int32 words along K, BITS per code, per-group scales s and zero points z (ZERO < 0: from
    z_ptr, else that constant for every group), every run of SUB columns of a K tile inside one
    group. The whole of K per program in BLOCK_K tiles, no split-K.

    A tile's words are held as [ROWS, runs, words per run] and summed word by word as
    _packed_gemv sums them: 4-bit codes against a bfloat16 input in bfloat16x2 arithmetic
    (_pair_dots; ASM: inline PTX), otherwise in float32 (_word_dots; `field`:
    field_mask(BITS)). The input f(x) is rounded where the unfused kernels round it."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    PAIRS: tl.constexpr = BITS == 4 and DTYPE == tl.bfloat16
    PACK: tl.constexpr = 32 // BITS
    RUNS: tl.constexpr = BLOCK_K // SUB
    WORDS: tl.constexpr = SUB // PACK  # per run
    rows, row_ok, j, head = _program_rows(N, MODE, ROWS, HEAD_DIM)
    words_in = tl.arange(0, RUNS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [R, W]
    codes_in = words_in[:, :, None] * PACK + tl.arange(0, PACK)[None, None, :]  # [R, W, P]
    field = field.to(tl.uint32, bitcast=True)
    # The first K tile of weights owes nothing to the kernel before: read it before waiting.
    words, scale, zero = _packed_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, 0, words_in, K,
                                      BITS, GROUP, GROUPS, SUB, ZERO, BLOCK_K)
    words_pair, scale_pair, zero_pair = words, scale, zero
    if MODE != _PLAIN:
        words_pair, scale_pair, zero_pair = _packed_tile(
            w_ptr, s_ptr, z_ptr, rows + PAIR, row_ok, 0, words_in, K, BITS, GROUP, GROUPS, SUB,
            ZERO, BLOCK_K)
    if PDL:
        gdc_wait()  # x, and the residual, come from the kernel before
    rstd = _rstd(x_ptr, eps, K, NORM, BLOCK_K)
    x, p0, p1, p2, p3 = _x_operand(x_ptr, norm_ptr, 0, words_in, codes_in, K, rstd, NORM,
                                   PAIRS, ASM)
    acc = _dots(words, scale, zero, x, p0, p1, p2, p3, field, BITS, ROWS, RUNS, WORDS, PAIRS,
                ASM)
    acc_pair = acc
    if MODE != _PLAIN:
        acc_pair = _dots(words_pair, scale_pair, zero_pair, x, p0, p1, p2, p3, field, BITS,
                         ROWS, RUNS, WORDS, PAIRS, ASM)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        x, p0, p1, p2, p3 = _x_operand(x_ptr, norm_ptr, k, words_in, codes_in, K, rstd, NORM,
                                       PAIRS, ASM)
        words, scale, zero = _packed_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k, words_in, K,
                                          BITS, GROUP, GROUPS, SUB, ZERO, BLOCK_K)
        acc += _dots(words, scale, zero, x, p0, p1, p2, p3, field, BITS, ROWS, RUNS, WORDS,
                     PAIRS, ASM)
        if MODE != _PLAIN:
            words, scale, zero = _packed_tile(w_ptr, s_ptr, z_ptr, rows + PAIR, row_ok, k,
                                              words_in, K, BITS, GROUP, GROUPS, SUB, ZERO,
                                              BLOCK_K)
            acc_pair += _dots(words, scale, zero, x, p0, p1, p2, p3, field, BITS, ROWS, RUNS,
                              WORDS, PAIRS, ASM)
    if PDL:
        gdc_launch_dependents()
    _row_epilogue(tl.sum(tl.sum(acc, 2), 1), tl.sum(tl.sum(acc_pair, 2), 1), rows, row_ok, j,
                  head, y_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                  kv_scales_ptr, stride_slot, stride_cache_head, MODE, RESIDUAL, PAIR,
                  NUM_HEADS, NUM_KV_HEADS, FP8, DTYPE)


@triton.jit
def _x_operand(x_ptr, norm_ptr, k0, words_in, codes_in, K: tl.constexpr, rstd,
               NORM: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr):
    """The input's K tile at k0 (rms_norm(x) * weight where NORM) as _dots takes it: PAIRS,
    four tensors of bfloat16 pairs [R, W] (the first returned value unused); otherwise the
    float32 tile [R, W, P] (the other four unused)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if PAIRS and not NORM:
        p0, p1, p2, p3 = _pairs_of_words(x_ptr, k0, words_in, K, ASM)
        x = p0
    else:
        x = _x_tile(x_ptr, norm_ptr, k0 + codes_in, K, rstd, NORM, DTYPE)  # [R, W, P]
        if PAIRS:
            p0, p1, p2, p3 = _pairs_of_floats(x, ASM)
        else:
            p0, p1, p2, p3 = x, x, x, x
    return x, p0, p1, p2, p3


@triton.jit
def _dots(words, scale, zero, x, p0, p1, p2, p3, field, BITS: tl.constexpr, ROWS: tl.constexpr,
          RUNS: tl.constexpr, WORDS: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr):
    """Per word [ROWS, R, W]: sum over its codes of (code - zero) * scale * x."""
    if PAIRS:
        dots = _pair_dots(words, scale, zero, p0, p1, p2, p3, ASM)
    else:
        dots = _word_dots(words, scale, -zero * scale, x, field, BITS, ROWS, RUNS, WORDS)
    return dots


@triton.jit
def _packed_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, words_in, K: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                 SUB: tl.constexpr, ZERO: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K tile at k0 of `rows`: words [ROWS, R, W] uint32 (16-byte loads along K; no mask
    along K where no tile reaches past it), and per run the scale and the zero point [ROWS, R],
    float32."""
    PACK: tl.constexpr = 32 // BITS
    RUNS: tl.constexpr = BLOCK_K // SUB
    w_rows = w_ptr + (rows.to(tl.int64) * (K // PACK))[:, None, None]
    at_words = w_rows + (k0 // PACK + words_in)[None, :, :]
    if K % BLOCK_K == 0:
        words = tl.load(at_words, mask=row_ok[:, None, None], other=0)
    else:
        words = tl.load(at_words, other=0,
                        mask=row_ok[:, None, None] & (k0 + words_in * PACK < K)[None, :, :])
    starts = k0 + tl.arange(0, RUNS) * SUB
    at = rows[:, None] * GROUPS + (starts // GROUP)[None, :]  # [ROWS, R]
    ok = row_ok[:, None] & (starts < K)[None, :]
    scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return words.to(tl.uint32, bitcast=True), scale, _zero_point(z_ptr, at, ok, ZERO, 0)


# (rows per program, K tile, warps, pipeline stages), looked up in order:
# - PACKED_ROW_TUNED, per (mode, bits, N, K): set by benchmarks;
# - packed_row_configs.json beside this file, per GPU name and "mode,bits,N,K": measured by
#   benchmarks/packed_row_sweep.py;
# - PLAIN (no norm: the kernel is _packed_gemv's loop, the residual added after): the one-row
#   packed GEMV's tuned config for the same weight (quant/gemv_configs.json, rows 1), where it
#   is a CUDA-core one without a split over K;
# - DEFAULT_ROWS rows (per block: the paired modes read two) in K tiles of 256 codes (the
#   sweep's for the int4 and int8 gate_up GEMVs), one warp, three stages. Every thread
#   recomputes RMSNorm for the x of its words, so the norm's cost per code falls with the rows
#   a warp holds: in sm_90 SASS the int4 gate_up loop with a bfloat16 input takes 4.7
#   instructions per code with 16 + 16 rows per warp (5.6 before the bfloat16x2 pair path),
#   the plain GEMV's 3.6 with 64 rows on 4 warps.
PACKED_ROW_TUNED: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}
CONFIG_FILE = Path(__file__).with_name("packed_row_configs.json")
DEFAULT_ROWS = 16


def packed_row_config(mode: int, packed, n: int, k: int,
                      device: torch.device) -> tuple[int, int, int, int]:
    key = (mode, packed.bits, n, k)
    if key in PACKED_ROW_TUNED:
        return PACKED_ROW_TUNED[key]
    measured = _measured_configs(_device_name(device)).get(",".join(map(str, key)))
    if measured is not None:
        return tuple(measured)
    tuned = gemv_config(packed.bits, n, k, 1, device)
    if mode == PLAIN and not tuned.dot and tuned.split_k == 0:
        return tuned.block_n, tuned.block_k, tuned.warps, tuned.stages
    return DEFAULT_ROWS, 256, 1, 3


@functools.cache
def _measured_configs(gpu: str) -> dict[str, list[int]]:
    if not CONFIG_FILE.exists():
        return {}
    return json.loads(CONFIG_FILE.read_text()).get(gpu, {})


def _launch(mode, x, packed, y, programs, config, *, norm=None, eps=0.0, residual=None,
            pair=0, rope=None, heads=(0, 0, 0), kv_scales=None):
    qweight, scales, qzeros, bits = packed.qweight, packed.scales, packed.qzeros, packed.bits
    pack = 32 // bits
    n, k = qweight.shape[0], qweight.shape[1] * pack
    rows, block_k, warps, stages = config or packed_row_config(mode, packed, n, k, x.device)
    block_k = max(min(block_k, triton.next_power_of_2(k)), 4 * pack)
    sub = _run_length(None, scales.shape[1], packed.group_size, block_k)
    if sub == 0:
        raise ValueError(f"the packed one-row kernels need groups in whole runs of a K tile: "
                         f"group size {packed.group_size} against K tiles of {block_k}")
    assert x.shape == (1, k) and qweight.is_contiguous() and scales.is_contiguous()
    assert residual is None or residual.shape == (1, n) and residual.is_contiguous()
    constant_zero = isinstance(qzeros, int)
    x = word_aligned(x.contiguous())
    cos, sin, slots, k_cache, v_cache = rope or (x, x, x, x, x)
    _packed_row_gemv[(programs(rows),)](
        x, norm if norm is not None else x, qweight, scales, scales if constant_zero else qzeros,
        y, residual if residual is not None else x, cos, sin, slots, k_cache, v_cache,
        kv_scales if kv_scales is not None else x, y.shape[-1], eps,
        k_cache.stride(0) if rope else 0, k_cache.stride(1) if rope else 0, field_mask(bits),
        K=k, BITS=bits, GROUP=packed.group_size, GROUPS=scales.shape[1], SUB=sub,
        ZERO=qzeros if constant_zero else -1, MODE=mode, NORM=norm is not None,
        RESIDUAL=residual is not None, ROWS=rows, BLOCK_K=block_k, STAGES=stages, PAIR=pair,
        HEAD_DIM=heads[2], NUM_HEADS=heads[0], NUM_KV_HEADS=heads[1],
        FP8=kv_scales is not None, ASM=bf16x2_asm(x.device), num_warps=warps,
        **pdl.pdl_launch(x),
    )
    return y


def gemv(x: torch.Tensor, packed, residual: torch.Tensor | None = None,
         config=None) -> torch.Tensor:
    """x [1, K] through the packed projection `packed` (+ residual [1, N]) -> [1, N].

    `packed`: a bias-free PackedLinear without act-order, or anything with its qweight, scales,
    qzeros (a tensor, or one int zero point for every group), bits and group_size."""
    y = torch.empty(1, packed.qweight.shape[0], device=x.device, dtype=x.dtype)
    return _launch(PLAIN, x, packed, y, lambda rows: triton.cdiv(y.shape[1], rows), config,
                   residual=residual)


def norm_glu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, packed,
             config=None) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) for one row x [1, K] through the packed [gate | up]
    projection (2I output rows) -> [1, I]."""
    half = packed.qweight.shape[0] // 2
    y = torch.empty(1, half, device=x.device, dtype=x.dtype)
    return _launch(GLU, x, packed, y, lambda rows: triton.cdiv(half, rows), config,
                   norm=norm_weight, eps=eps, pair=half)


def norm_qkv_rope_store(x, norm_weight, eps, packed, num_heads, num_kv_heads, cos, sin, slots,
                        k_cache, v_cache, config=None, kv_scales=None) -> torch.Tensor:
    """noesis.kernels.row_gemv.norm_qkv_rope_store through the packed qkv projection: rms_norm
    of one token x [1, K], q and k rotated, k and v stored at cache slot slots[0] (quantized
    with `kv_scales` [2, Hkv(, 1)] into an fp8 cache). Returns qkv [1, (H + 2 Hkv) d]."""
    heads = num_heads + 2 * num_kv_heads
    head_dim = packed.qweight.shape[0] // heads
    half = head_dim // 2
    rows, *rest = config or packed_row_config(QKV, packed, packed.qweight.shape[0],
                                              x.shape[1], x.device)
    config = (math.gcd(rows, half), *rest)  # a program's rows stay inside a half head
    assert cos.shape[-1] == head_dim and slots.numel() >= 1
    assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1
    assert v_cache.stride()[:2] == k_cache.stride()[:2]
    assert (kv_scales is not None) == (k_cache.dtype == torch.float8_e4m3fn)
    assert kv_scales is None or kv_scales.is_contiguous() and kv_scales.numel() == 2 * num_kv_heads
    y = torch.empty(1, packed.qweight.shape[0], device=x.device, dtype=x.dtype)
    return _launch(
        QKV, x, packed, y, lambda rows: heads * (half // rows), config, norm=norm_weight, eps=eps,
        pair=half, rope=(cos, sin, slots, k_cache.view(-1, *k_cache.shape[2:]),
                         v_cache.view(-1, *v_cache.shape[2:])),
        heads=(num_heads, num_kv_heads, head_dim), kv_scales=kv_scales,
    )
