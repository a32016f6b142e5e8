"""Triton kernels for the CUDA decode path: paged attention (split-K), fused add+RMSNorm,
SiLU-and-multiply, RoPE fused with the KV-cache write, one-row projections with their
neighbours fused (batch-1 decode), the sampler's exponential race and the grammar bitmask.

Each is compared with a PyTorch reference (the torch paths in kernels/ops.py, or the unfused
steps) in tests/unit/test_kernels.py, which runs them under TRITON_INTERPRET=1 on a CPU, and
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

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _GDC = True
except ImportError:  # older Triton: the kernels run without PDL (their branches stay untaken)
    _GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

# Programmatic dependent launch (Hopper on): the batch-1 path's kernels (one-row projections and
# decode attention) let the next kernel launch while they finish, and wait for the one before
# them only when they start reading. On by default on sm_90 and later (EngineConfig.pdl,
# `--no-pdl`, turns it off): on an H200 it took the 8B shape's batch-1 graph from 4.10 to
# 3.93-3.98 ms and the 1B one's from 0.879 to 0.804-0.814 (graph_ab.py --what pdl, 2026-11-23).
# Never under Triton's interpreter, which cannot run the griddepcontrol instructions, and not
# with a Triton too old to emit them.
PDL = _GDC


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """griddepcontrol needs compute capability 9.0 (Hopper) or later."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(x: torch.Tensor) -> dict:
    """The launch's PDL constexpr and, when on, the launch option."""
    on = PDL and x.is_cuda and _pdl_capable(x.device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


# ---- paged decode attention -------------------------------------------------------------------

def partition_size(batch: int) -> int:
    """Context tokens per split: small batches need many splits to fill the GPU; large ones
    fill it anyway and pay for the splits in the merge. Timed inside CUDA graphs on an H200
    (benchmarks/tune_paged_decode.py, 8B heads): 64 is best at batch 1 from 384 to 4,000
    tokens; 256 at batch 64 (700 tokens) and 128 (600 tokens: 113 us against 118 with 512)."""
    return 64 if batch <= 8 else 256


def fused_merge(batch: int) -> bool:
    """Whether the splits merge in the partial kernel's launch (the last split to finish merges
    them, serially) rather than in a second kernel. In graphs on an H200: batch 128 at 600
    tokens 118 us against 120, batch 64 at 700 62 against 68; but at batch 1 the serial merge
    of 64-token splits loses from 1,024 tokens on (17.6 us against 7.7 at 2,048), and batch 8
    at 1,024 (19.9 against 15.6)."""
    return batch > 8


def pipeline_stages(batch: int) -> int:
    """Software-pipeline depth of the partial kernel's loop: 2 measured faster above batch 8."""
    return 3 if batch <= 8 else 2


@triton.jit(do_not_specialize=["window", "stride_tb", "stride_ob", "stride_lb", "stride_fb"])
def _paged_decode_partial(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr, counters_ptr, out_ptr,
    sinks_ptr, kv_scales_ptr, scale, window, softcap,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_fb, stride_fh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, FUSED_REDUCE: tl.constexpr, PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)  # step inputs, copied in before the step's first kernel
    start = split * PART
    if start >= ctx_len:
        return
    if PDL:
        gdc_wait()  # q and this token's k/v come from the kernel before
    end = tl.minimum(start + PART, ctx_len)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    query_pos = ctx_len - 1
    if FP8:  # keys and values stored divided by a per-head scale: k's joins the score scale
        scale = scale * tl.load(kv_scales_ptr + kv_head)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for block in range(0, PART, BLOCK_N):  # fixed trip count; masks cut the tail
        tokens = start + block + tl.arange(0, BLOCK_N)
        tok_ok = tokens < end
        if HAS_WINDOW:
            tok_ok = tok_ok & (tokens > query_pos - window)
        pages = tl.load(tables_ptr + b * stride_tb + tokens // PAGE_SIZE, mask=tok_ok, other=0)
        offsets = pages * stride_kp + (tokens % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8:
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 2 / (1 + e^-2x) - 1
            scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if PDL:
        gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if FP8:  # v's scale, once per split (the merge is linear in the splits' outputs)
        out = out * tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
    out_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(out_ptrs + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)
    if FUSED_REDUCE:
        # The last split of (sequence, KV head) to finish merges all of them: one launch instead
        # of a second kernel. The barrier orders every thread's stores before the counter's
        # release; the counter goes back to zero for the next launch.
        tl.debug_barrier()
        counter = counters_ptr + b * tl.num_programs(1) + kv_head
        num_splits = tl.cdiv(ctx_len, PART)
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.debug_barrier()
            tl.store(counter, 0)
            m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_run = tl.zeros([GROUP_PAD], tl.float32)
            if HAS_SINKS:  # the sink starts the merge: its logit, weight exp(0), no value
                m_run = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
                l_run = tl.full([GROUP_PAD], 1.0, tl.float32)
            merged = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
            s = 0
            while s < num_splits:  # (a while loop: Triton's interpreter runs it too)
                lse_s = tl.load(part_lse_ptr + b * stride_lb + heads * stride_lh + s,
                                mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(
                    part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
                    cache_modifier=".cg",
                )
                m_new = tl.maximum(m_run, lse_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_run - m_safe)
                weight = tl.exp(lse_s - m_safe)
                merged = merged * alpha[:, None] + part * weight[:, None]
                l_run = l_run * alpha + weight
                m_run = m_new
                s += 1
            l_run = tl.where(l_run == 0.0, 1.0, l_run)
            final = out_ptr + b * stride_fb + heads[:, None] * stride_fh + dims[None, :]
            tl.store(final, merged / l_run[:, None], mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["stride_ob", "stride_lb"])
def _paged_decode_reduce(
    part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
    PART: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    ctx_len = tl.load(lens_ptr + b)
    num_splits = tl.cdiv(ctx_len, PART)
    splits = tl.arange(0, MAX_SPLITS)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + head * stride_lh + splits, mask=split_ok,
                  other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.where(split_ok, tl.exp(lse - lse_max), 0.0)
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:  # the sink's share of the softmax, with no value
        total += tl.exp(sink - lse_max)
    total = tl.where(total == 0.0, 1.0, total)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    parts = tl.load(
        part_out_ptr + b * stride_ob + head * stride_oh + splits[:, None] * stride_os
        + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    out = tl.sum(parts * (weights / total)[:, None], axis=0)
    tl.store(out_ptr + b * stride_fb + head * stride_fh + dims, out, mask=dim_ok)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_COUNTERS = 1 << 16  # (sequence, KV head) pairs one fused launch can merge


def _split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for the fused split merge, one buffer per device for the process's
    life (graphs capture its address); every launch leaves them zero again."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, d]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int
    ctx_lens: torch.Tensor,  # [B] int
    scale: float,
    max_ctx: int,
    window: int | None = None,
    tuning: dict | None = None,
    *,
    sinks: torch.Tensor | None = None,  # [H]: gpt-oss's per-head logit joining each softmax
    softcap: float | None = None,  # Gemma 2: scores -> softcap * tanh(scores / softcap)
    kv_scales: torch.Tensor | None = None,  # [2, Hkv] float32: an fp8 cache's per-head scales
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context. Returns [B, H, d].
    The context is split for parallelism; the splits merge in a second kernel, or, for larger
    batches, in the same launch (the last split of each (sequence, KV head) to finish merges
    them); a sink joins the merge. An fp8 cache (`kv_scales`) is loaded as stored and scaled
    in the kernel. `tuning` overrides the launch (partition, block_n, num_warps, num_stages,
    fused_reduce): benchmarks only."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert ctx_lens.stride(0) == 1 and q.stride(2) == 1 and k_cache.stride(3) == 1
    group = num_heads // num_kv_heads
    tuning = tuning or {}
    partition = tuning.get("partition") or partition_size(batch)
    max_splits = max(1, triton.cdiv(max_ctx, partition))
    fused = tuning.get("fused_reduce", fused_merge(batch))
    fused = fused and batch * num_kv_heads <= MAX_COUNTERS
    part_out = torch.empty(batch, num_heads, max_splits, head_dim, device=q.device,
                           dtype=torch.float32)
    part_lse = torch.empty(batch, num_heads, max_splits, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    counters = _split_counters(q.device) if fused else part_lse  # unread when not fused
    dim_pad = triton.next_power_of_2(head_dim)
    sinks_arg = sinks if sinks is not None else part_lse  # unread without sinks
    scales_arg = kv_scales if kv_scales is not None else part_lse  # unread without fp8
    _paged_decode_partial[(batch, num_kv_heads, max_splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, part_out, part_lse, counters, out,
        sinks_arg, scales_arg, scale, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, PAGE_SIZE=page_size,
        BLOCK_N=tuning.get("block_n") or min(64 if dim_pad <= 128 else 32, partition),
        PART=partition, HAS_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FUSED_REDUCE=fused,
        HAS_SINKS=sinks is not None, HAS_SOFTCAP=softcap is not None, FP8=kv_scales is not None,
        num_warps=tuning.get("num_warps", 4), **_pdl(q),
        num_stages=tuning.get("num_stages") or pipeline_stages(batch),
    )
    if fused:
        return out
    _paged_decode_reduce[(batch, num_heads)](
        part_out, part_lse, ctx_lens, out, sinks_arg,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, MAX_SPLITS=triton.next_power_of_2(max_splits),
        PART=partition, HAS_SINKS=sinks is not None, num_warps=4, **_pdl(q),
    )
    return out


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


# ---- one-row projections, with what surrounds them fused (batch-1 decode) -----------------------

PLAIN, GLU, QKV = 0, 1, 2  # _row_gemv modes; a kernel reads only constexpr globals:
_PLAIN, _GLU, _QKV = tl.constexpr(PLAIN), tl.constexpr(GLU), tl.constexpr(QKV)


@triton.jit
def _row_gemv(
    x_ptr, norm_ptr, w_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    N, eps, stride_slot, stride_cache_head,
    K: tl.constexpr, MODE: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PDL: tl.constexpr,
):
    """y = W @ f(x) for one row x [K], ROWS output rows per program (two blocks of them, PAIR
    rows apart, in the GLU and QKV modes), the whole of K in BLOCK_K tiles, no split-K.
    STAGES > 1 software-pipelines the tiles through shared memory (cp.async), so that many
    tiles are in flight per thread; 1 issues each tile's loads when its iteration starts.

    NORM: f is RMSNorm with weight norm_ptr, recomputed by every program (x is a few KB, read
    from L2). PLAIN: y = W f(x), plus res when RESIDUAL. GLU: W is [gate | up], PAIR = I
    apart; y [I] = silu(gate) * up. QKV: W is [q heads | k heads | v heads]; a program takes
    ROWS rows from each half of one head (PAIR = HEAD_DIM / 2), rotates q and k with cos/sin
    [HEAD_DIM / 2], and stores k and v at the cache slot as well as in y.

    Every value is rounded to the model dtype where the unfused kernels round it."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty  # the model's; y may be float32 (logits)
    pid = tl.program_id(0)
    if MODE == _QKV:
        BLOCKS_PER_HEAD: tl.constexpr = HEAD_DIM // 2 // ROWS
        head = pid // BLOCKS_PER_HEAD
        j = (pid % BLOCKS_PER_HEAD) * ROWS + tl.arange(0, ROWS)
        rows = head * HEAD_DIM + j
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
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
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            squares += v * v
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    x_first = _x_tile(x_ptr, norm_ptr, first, K, rstd, NORM, DTYPE)[None, :]
    acc = w_first.to(tl.float32) * x_first
    acc_pair = w_first_pair.to(tl.float32) * x_first
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        cols = k + tl.arange(0, BLOCK_K)
        xf = _x_tile(x_ptr, norm_ptr, cols, K, rstd, NORM, DTYPE)[None, :]
        tile_ok = row_ok[:, None] & (cols < K)[None, :]
        acc += tl.load(w_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * xf
        if MODE != _PLAIN:
            acc_pair += tl.load(w_rows + PAIR * K + cols[None, :], mask=tile_ok,
                                other=0.0).to(tl.float32) * xf
    if PDL:
        gdc_launch_dependents()
    y = tl.sum(acc, 1).to(DTYPE)
    if MODE == _PLAIN:
        if RESIDUAL:
            y = y + tl.load(res_ptr + rows, mask=row_ok, other=0.0)
        tl.store(y_ptr + rows, y, mask=row_ok)
    elif MODE == _GLU:
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE)
        tl.store(y_ptr + rows, act * tl.sum(acc_pair, 1).to(DTYPE), mask=row_ok)
    else:
        pair = tl.sum(acc_pair, 1).to(DTYPE)
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
            if head < NUM_HEADS + NUM_KV_HEADS:
                dst = k_cache_ptr + slot * stride_slot + (head - NUM_HEADS) * stride_cache_head
            else:
                dst = (v_cache_ptr + slot * stride_slot
                       + (head - NUM_HEADS - NUM_KV_HEADS) * stride_cache_head)
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


def row_gemv_config(mode: int, weight: torch.Tensor) -> tuple[int, int, int, int]:
    key = (mode, *weight.shape)
    if key in ROW_GEMV_TUNED:
        return ROW_GEMV_TUNED[key]
    tuned = _device_configs(weight.device).get(",".join(map(str, key)))
    return tuple(tuned) if tuned else ROW_GEMV_CONFIGS[mode]


def _launch_row_gemv(mode, x, weight, y, programs, config, *, norm=None, eps=0.0,
                     residual=None, pair=0, rope=None, heads=(0, 0, 0)):
    rows, block_k, warps, stages = config or row_gemv_config(mode, weight)
    n, k = weight.shape
    assert x.shape == (1, k) and weight.is_contiguous()
    assert residual is None or residual.shape == (1, n) and residual.is_contiguous()
    x = x.contiguous()
    cos, sin, slots, k_cache, v_cache = rope or (x, x, x, x, x)
    _row_gemv[(programs(rows),)](
        x, norm if norm is not None else x, weight, y,
        residual if residual is not None else x, cos, sin, slots, k_cache, v_cache,
        y.shape[-1], eps, k_cache.stride(0) if rope else 0, k_cache.stride(1) if rope else 0,
        K=k, MODE=mode, NORM=norm is not None, RESIDUAL=residual is not None, ROWS=rows,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)), STAGES=stages, PAIR=pair,
        HEAD_DIM=heads[2], NUM_HEADS=heads[0], NUM_KV_HEADS=heads[1], num_warps=warps,
        **_pdl(x),
    )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
         config=None) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ residual [1, N]) -> [1, N], without split-K. In CUDA graphs
    on an H200 (benchmarks/gemv_fused.py), before its first tile was peeled off the loop for
    PDL: o_proj of Llama-3.1-8B 11.4 us against cuBLAS's 13.2, of Llama-3.2-1B 3.1 against
    5.0."""
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=x.dtype)
    return _launch_row_gemv(PLAIN, x, weight, y, lambda rows: triton.cdiv(y.shape[1], rows),
                            config, residual=residual)


def norm_logits(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                config=None) -> torch.Tensor:
    """float32 logits [1, V] of rms_norm(x) for one row x [1, K] through the LM head [V, K],
    rounded to the model dtype first as the unfused head's output is."""
    y = torch.empty(1, weight.shape[0], device=x.device, dtype=torch.float32)
    return _launch_row_gemv(PLAIN, x, weight, y, lambda rows: triton.cdiv(y.shape[1], rows),
                            config, norm=norm_weight, eps=eps)


def norm_glu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
             config=None) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) for one row x [1, K] and gate_up [2I, K] -> [1, I]."""
    half = gate_up.shape[0] // 2
    y = torch.empty(1, half, device=x.device, dtype=x.dtype)
    return _launch_row_gemv(GLU, x, gate_up, y, lambda rows: triton.cdiv(half, rows), config,
                            norm=norm_weight, eps=eps, pair=half)


def norm_qkv_rope_store(x, norm_weight, eps, qkv, num_heads, num_kv_heads, cos, sin, slots,
                        k_cache, v_cache, config=None) -> torch.Tensor:
    """The fused qkv projection of rms_norm(x) for one token x [1, K], q and k rotated (cos/sin
    [1, head_dim], equal halves), k and v stored at cache slot slots[0] (caches [pages,
    page_size, Hkv, d]). Returns qkv [1, (H + 2 Hkv) d], rotated."""
    heads = num_heads + 2 * num_kv_heads
    head_dim = qkv.shape[0] // heads
    half = head_dim // 2
    rows, *rest = config or row_gemv_config(QKV, qkv)
    rows = math.gcd(rows, half)  # a program's rows stay inside a half head (a power of two)
    config = (rows, *rest)
    assert cos.shape[-1] == head_dim and slots.numel() >= 1
    assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1
    assert v_cache.stride()[:2] == k_cache.stride()[:2]
    y = torch.empty(1, qkv.shape[0], device=x.device, dtype=x.dtype)
    return _launch_row_gemv(
        QKV, x, qkv, y, lambda rows: heads * (half // rows), config, norm=norm_weight, eps=eps,
        pair=half, rope=(cos, sin, slots, k_cache.view(-1, *k_cache.shape[2:]),
                         v_cache.view(-1, *v_cache.shape[2:])),
        heads=(num_heads, num_kv_heads, head_dim),
    )


# ---- RoPE + KV-cache write ----------------------------------------------------------------------


@triton.jit
def _rope_write(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_kt, stride_vt, stride_cos, stride_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr, HALF_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
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
    # Eager rounds each product to the model dtype before the add; do the same.
    r1 = (x1 * cos.to(dtype)).to(dtype) - (x2 * sin.to(dtype)).to(dtype)
    r2 = (x2 * cos.to(dtype)).to(dtype) + (x1 * sin.to(dtype)).to(dtype)
    tl.store(head_ptr + half, r1, mask=ok)
    tl.store(head_ptr + ROT_HALF + half, r2, mask=ok)
    if is_key:
        slot = tl.load(slots_ptr + token)
        dst = k_cache_ptr + slot * stride_slot + kv_head * stride_cache_head
        tl.store(dst + half, r1, mask=ok)
        tl.store(dst + ROT_HALF + half, r2, mask=ok)
        rest = 2 * ROT_HALF + tl.arange(0, DIM_PAD)  # channels past the rotary part pass through
        rest_ok = rest < HEAD_DIM
        tl.store(dst + rest, tl.load(head_ptr + rest, mask=rest_ok, other=0.0), mask=rest_ok)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        v_src = v_ptr + token * stride_vt + kv_head * HEAD_DIM
        v_dst = v_cache_ptr + slot * stride_slot + kv_head * stride_cache_head
        tl.store(v_dst + dims, tl.load(v_src + dims, mask=dim_ok, other=0.0), mask=dim_ok)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> None:
    """Rotate q [T, H, d] and k [T, Hkv, d] in place and store k, v at cache `slots`.

    Heads must be packed (stride d) inside each token row; rows may be strided (views of a fused
    qkv). cos/sin are [T, rotary_dim] with equal halves; channels past rotary_dim pass through.
    k_cache/v_cache are [num_pages, page_size, Hkv, d], addressed by slot = page * size + offset.
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert slots.stride(0) == 1 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert q.stride(1) == head_dim and k.stride(1) == head_dim and v.stride(1) == head_dim
    rot_half = cos.shape[1] // 2
    _rope_write[(tokens, num_heads + num_kv_heads)](
        q, k, v, cos, sin, slots, k_cache, v_cache,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROT_HALF=rot_half, HALF_PAD=triton.next_power_of_2(rot_half),
        DIM_PAD=triton.next_power_of_2(head_dim), num_warps=1,
    )


# ---- sampling: the exponential race, fused ------------------------------------------------------

@triton.jit
def _mix32(x):
    # lowbias32 in int64 with explicit 32-bit masks, exactly as sampling/noise.py computes it.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _race_partial(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr, flag_ptr, V, stride_l, stride_t,
    stride_seed, stride_step, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    GREEDY: tl.constexpr, REPORT: tl.constexpr,
):
    """Best (score, index) of one vocabulary chunk of one row, score = logit / T - log(E) with
    E = -log(u(seed, step, token)); a row with T == 0 scores the plain logit (greedy), and so
    does every row under GREEDY, which reads no temperature, seed or step. Ties: the lowest
    index. Under REPORT also the chunk's flags: 2 if a logit is NaN or +inf, | 1 if one is
    finite."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if not GREEDY:
        temp = tl.load(temp_ptr + row * stride_t)
        seed = tl.load(seed_ptr + row * stride_seed)
        step = tl.load(step_ptr + row * stride_step)
        key = _mix32((seed & 0xFFFFFFFF) ^ _mix32(((seed >> 32) & 0xFFFFFFFF)
                                                ^ _mix32(step & 0xFFFFFFFF)))
        key2 = _mix32(key ^ 0x5BD1E995)
        safe_temp = tl.where(temp == 0.0, 1.0, temp)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = (chunk * CHUNK).to(tl.int64)  # an all -inf chunk answers its first index
    broken = tl.zeros((), tl.int32)
    usable = tl.zeros((), tl.int32)
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        ok = cols < V
        logit = tl.load(logits_ptr + row * stride_l + cols, mask=ok, other=float("-inf"))
        if REPORT:
            nan_or_inf = (logit != logit) | (logit == float("inf"))
            broken = tl.maximum(broken, tl.max(nan_or_inf.to(tl.int32), axis=0))
            usable = tl.maximum(usable, tl.max((logit > float("-inf")).to(tl.int32), axis=0))
        if GREEDY:
            score = logit
        else:
            x = _mix32(((cols.to(tl.int64) * 0x9E3779B1) + key) & 0xFFFFFFFF)
            x = _mix32(x ^ key2)
            u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            noisy = logit / safe_temp - tl.log(-tl.log(u))
            score = tl.where(temp == 0.0, logit, noisy)
            score = tl.where(ok, score, float("-inf"))
        value = tl.max(score, axis=0)
        index = tl.argmax(score, axis=0).to(tl.int64) + chunk * CHUNK + offset
        better = value > best_val
        best_idx = tl.where(better, index, best_idx)
        best_val = tl.where(better, value, best_val)
    tl.store(val_ptr + row * num_chunks + chunk, best_val)
    tl.store(idx_ptr + row * num_chunks + chunk, best_idx)
    if REPORT:
        tl.store(flag_ptr + row * num_chunks + chunk, broken * 2 + usable)


@triton.jit
def _best_chunk(val_ptr, idx_ptr, out_ptr, flag_ptr, rep_ptr, num_chunks, BLOCK: tl.constexpr,
                REPORT: tl.constexpr):
    """Per row, the index held by its best chunk (ties: the first chunk, so the lowest index).
    Under REPORT also that index again, or -1 where a chunk saw NaN or +inf or none saw a
    finite logit: the row cannot give a token."""
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK)
    values = tl.load(val_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                     other=float("-inf"))
    best = tl.argmax(values, axis=0)
    token = tl.load(idx_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, token)
    if REPORT:
        flags = tl.load(flag_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=0)
        fine = (tl.max(flags & 2, axis=0) == 0) & (tl.max(flags & 1, axis=0) == 1)
        tl.store(rep_ptr + row, tl.where(fine, token, -1))


def _race(logits, temperature, seeds, steps, chunk: int, report: bool = False):
    """Two launches: every (row, chunk)'s best, then every row's best chunk. Greedy when
    temperature is None. With `report`, (ids, reported ids): -1 in the second for a row that
    cannot give a token, at no extra launch."""
    batch, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    values = torch.empty(batch, num_chunks, device=logits.device, dtype=torch.float32)
    index = torch.empty(batch, num_chunks, device=logits.device, dtype=torch.int64)
    flags = torch.empty(batch, num_chunks, device=logits.device, dtype=torch.int32) if report \
        else values  # unread without REPORT
    greedy = temperature is None
    if greedy:  # the pointers go unread
        temperature = seeds = steps = logits
    if logits.stride(-1) != 1:
        raise ValueError("the race needs logits with unit stride along the vocabulary")
    # The knobs may be columns of one [B, 3] tensor (the runner copies them in one go).
    _race_partial[(batch, num_chunks)](
        logits, temperature, seeds, steps, values, index, flags, vocab, logits.stride(0),
        temperature.stride(0), seeds.stride(0), steps.stride(0), num_chunks,
        CHUNK=chunk, BLOCK=min(chunk, 1024), GREEDY=greedy, REPORT=report, num_warps=4,
    )
    out = torch.empty(batch, device=logits.device, dtype=torch.int64)
    reported = torch.empty_like(out) if report else out
    _best_chunk[(batch,)](values, index, out, flags, reported, num_chunks,
                          BLOCK=max(triton.next_power_of_2(num_chunks), 16), REPORT=report,
                          num_warps=1)
    return (out, reported) if report else out


def exponential_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                     steps: torch.Tensor, report: bool = False):
    """Sampled ids [B] from logits [B, V] float32: argmax(logits / T - log E), E ~ Exp(1) from
    the counter hash of (seed, step, token); T == 0 rows take the argmax. One kernel over
    chunks of the vocabulary, then the best chunk per row (ties: the lowest index). `report`:
    see _race."""
    return _race(logits, temperature, seeds, steps, chunk=4096, report=report)


def greedy_argmax(logits: torch.Tensor, report: bool = False):
    """Row-wise argmax [B, V] float32 -> [B] int64 in two launches (torch's two-stage argmax
    takes five): 1,024-entry chunks, so a single row spreads over ~125 programs at a 128k
    vocabulary. Ties resolve to the lowest index, as torch.argmax does; NaN is not ordered.
    `report`: see _race."""
    return _race(logits, None, None, None, chunk=1024, report=report)


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


# ---- grammar masks ------------------------------------------------------------------------------


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
