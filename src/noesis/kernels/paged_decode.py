"""Triton paged decode attention (split-K): one query token per sequence over its paged context.

Compared with the torch paged attention
in tests/unit/test_kernels.py (TRITON_INTERPRET=1 on a CPU), and compiled for sm_90 in
tests/unit/test_kernels_compile.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from noesis.kernels import pdl
from noesis.kernels.pdl import gdc_launch_dependents, gdc_wait


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


def split_programs(pairs: int, max_splits: int) -> int:
    """Programs per (sequence, KV head) in the partial kernel's grid, and so partials to merge:
    one per split up to about 4,096 programs in all, then each takes every n-th split. A
    program per possible split of max_model_len (2,048 per KV head at 131k tokens of 64) cost
    more to launch than the attention itself at short contexts, and its partials' buffer
    grew with max_model_len (537 MB at batch 64 and 131k tokens of 64-dim heads)."""
    return max(1, min(max_splits, max(8, SPLIT_GRID // pairs)))


SPLIT_GRID = 4096


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
    ctx_len = tl.load(lens_ptr + b)  # step inputs, copied in before the step's first kernel
    num_splits = tl.cdiv(ctx_len, PART)
    first_split = _first_split(ctx_len, window, PART, HAS_WINDOW)
    if tl.program_id(2) >= num_splits - first_split:
        return
    if PDL:
        gdc_wait()  # q and this token's k/v come from the kernel before
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
    # The grid's third axis is capped (paged_decode_attention): this program takes splits
    # first_split + program_id(2), + num_programs(2), ... of the context, carrying one online
    # softmax through them, and writes one partial (a while loop: the interpreter's range
    # takes no tensors). A sliding window's splits start at the first it reaches.
    part = tl.program_id(2)
    num_parts = tl.minimum(tl.num_programs(2), num_splits - first_split)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    split = first_split + part
    while split < num_splits:
        start = split * PART
        end = tl.minimum(start + PART, ctx_len)
        for block in range(0, PART, BLOCK_N):  # fixed trip count; masks cut the tail
            tokens = start + block + tl.arange(0, BLOCK_N)
            tok_ok = tokens < end
            if HAS_WINDOW:
                tok_ok = tok_ok & (tokens > query_pos - window)
            pages = tl.load(tables_ptr + b * stride_tb + tokens // PAGE_SIZE, mask=tok_ok,
                            other=0)  # fmt: skip
            offsets = (pages * stride_kp + (tokens % PAGE_SIZE) * stride_ks
                       + kv_head * stride_kh)  # fmt: skip
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
        split += tl.num_programs(2)
    if PDL:
        gdc_launch_dependents()
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if FP8:  # v's scale, once per partial (the merge is linear in the partials' outputs)
        out = out * tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
    out_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + part * stride_os
    tl.store(out_ptrs + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + part, lse, mask=row_ok)
    if FUSED_REDUCE:
        # The last program of (sequence, KV head) to finish merges the partials: one launch
        # instead of a second kernel. The barrier orders every thread's stores before the
        # counter's release; the counter goes back to zero for the next launch.
        tl.debug_barrier()
        counter = counters_ptr + b * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_parts - 1:
            tl.debug_barrier()
            tl.store(counter, 0)
            m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_run = tl.zeros([GROUP_PAD], tl.float32)
            if HAS_SINKS:  # the sink starts the merge: its logit, weight exp(0), no value
                m_run = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
                l_run = tl.full([GROUP_PAD], 1.0, tl.float32)
            merged = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
            s = 0
            while s < num_parts:  # (a while loop: Triton's interpreter runs it too)
                lse_s = tl.load(part_lse_ptr + b * stride_lb + heads * stride_lh + s,
                                mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                partial = tl.load(
                    part_out_ptr + b * stride_ob + heads[:, None] * stride_oh
                    + s * stride_os + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0, cache_modifier=".cg",
                )
                m_new = tl.maximum(m_run, lse_s)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_run - m_safe)
                weight = tl.exp(lse_s - m_safe)
                merged = merged * alpha[:, None] + partial * weight[:, None]
                l_run = l_run * alpha + weight
                m_run = m_new
                s += 1
            l_run = tl.where(l_run == 0.0, 1.0, l_run)
            final = out_ptr + b * stride_fb + heads[:, None] * stride_fh + dims[None, :]
            tl.store(final, merged / l_run[:, None],
                     mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip


@triton.jit
def _first_split(ctx_len, window, PART: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The first split a sequence's query reaches: 0, or under a sliding window the one
    holding token ctx_len - window (the splits before it would be read only to be masked)."""
    first = ctx_len * 0  # (ctx_len's integer type on both branches)
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window, 0) // PART
    return first


@triton.jit(do_not_specialize=["max_parts", "window", "stride_ob", "stride_lb"])
def _paged_decode_reduce(
    part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, sinks_ptr, max_parts, window,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr,
    PART: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """Merges one (sequence, head)'s partials (one per partial-kernel program its context,
    or its sliding window, reaches; at most `max_parts`), CHUNK at a time with a running max:
    the work follows the context, not max_model_len (a tile of every possible split spilled
    registers at a model's full context: 4-8 KB a thread at 40k-128k tokens)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    ctx_len = tl.load(lens_ptr + b)
    num_parts = tl.minimum(tl.cdiv(ctx_len, PART) - _first_split(ctx_len, window, PART,
                                                                 HAS_WINDOW), max_parts)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    if HAS_SINKS:  # the sink starts the merge: its logit, weight exp(0), no value
        m_run = tl.load(sinks_ptr + head).to(tl.float32)
        total = tl.full([], 1.0, tl.float32)
    merged = tl.zeros([DIM_PAD], tl.float32)
    first = 0
    while first < num_parts:  # (a while loop: Triton's interpreter runs it too)
        parts_at = first + tl.arange(0, CHUNK)
        part_ok = parts_at < num_parts
        lse = tl.load(part_lse_ptr + b * stride_lb + head * stride_lh + parts_at, mask=part_ok,
                      other=float("-inf"))
        parts = tl.load(
            part_out_ptr + b * stride_ob + head * stride_oh + parts_at[:, None] * stride_os
            + dims[None, :], mask=part_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        m_new = tl.maximum(m_run, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_safe)
        weights = tl.where(part_ok, tl.exp(lse - m_safe), 0.0)
        merged = merged * alpha + tl.sum(parts * weights[:, None], axis=0)
        total = total * alpha + tl.sum(weights, axis=0)
        m_run = m_new
        first += CHUNK
    total = tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * stride_fb + head * stride_fh + dims, merged / total, mask=dim_ok)


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
    The context is split for parallelism, a program per split up to a cap (`split_programs`),
    past which each program carries its online softmax over every n-th split (under a sliding
    window only the splits the window reaches, so its cost follows the window, not the
    context); the programs' partials merge in a second kernel, or, for larger batches, in the
    same launch (the last program of each (sequence, KV head) to finish merges them); a sink
    joins the merge. An fp8 cache (`kv_scales`) is loaded as stored and scaled in the kernel.
    `tuning` overrides the launch (partition, block_n, num_warps, num_stages, fused_reduce):
    benchmarks only."""
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert ctx_lens.stride(0) == 1 and q.stride(2) == 1 and k_cache.stride(3) == 1
    group = num_heads // num_kv_heads
    tuning = tuning or {}
    partition = tuning.get("partition") or partition_size(batch)
    max_splits = max(1, triton.cdiv(max_ctx, partition))
    fused = tuning.get("fused_reduce", fused_merge(batch))
    fused = fused and batch * num_kv_heads <= MAX_COUNTERS
    parts = split_programs(batch * num_kv_heads, max_splits)  # partials per (sequence, head)
    part_out = torch.empty(batch, num_heads, parts, head_dim, device=q.device,
                           dtype=torch.float32)  # fmt: skip
    part_lse = torch.empty(batch, num_heads, parts, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    counters = _split_counters(q.device) if fused else part_lse  # unread when not fused
    dim_pad = triton.next_power_of_2(head_dim)
    sinks_arg = sinks if sinks is not None else part_lse  # unread without sinks
    scales_arg = kv_scales if kv_scales is not None else part_lse  # unread without fp8
    _paged_decode_partial[(batch, num_kv_heads, parts)](
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
        num_warps=tuning.get("num_warps", 4), **pdl.pdl_launch(q),
        num_stages=tuning.get("num_stages") or pipeline_stages(batch),
    )
    if fused:
        return out
    _paged_decode_reduce[(batch, num_heads)](
        part_out, part_lse, ctx_lens, out, sinks_arg, parts, window or 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, CHUNK=min(32, triton.next_power_of_2(parts)),
        PART=partition, HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None,
        num_warps=4, **pdl.pdl_launch(q),
    )
    return out
