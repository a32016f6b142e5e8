"""Batch-invariant Triton kernels: a row's result never depends on how many rows share the call.

cuBLAS and the flash kernels pick tile shapes, split-K and split-KV from the batch, so a token's
logits change with the traffic beside it. These kernels fix every reduction order by the weight's
(or the context's) shape alone:

- `linear`: a matmul whose tiling, K split included, depends on (N, K) and the device only:
  each output sums BLOCK_K steps in order within each of a fixed number of K ranges, then the
  ranges' float32 partials in order, whatever M is;
- `paged_attention`: one program per (query token, head) that walks its own keys in blocks of
  KV_BLOCK positions counted from position 0, in order, whatever shares the step; a token
  computes the same attention inside a prefill chunk, a one-shot prefill or a decode.

RMSNorm needs nothing new: `pointwise.add_rms_norm` runs one program per row already.
Both run under Triton's interpreter on the CPU (tests/unit/test_batch_invariant.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

# Keys per attention block. A token's blocks start at multiples of this from position 0, so
# they are the same in every step that computes it.
KV_BLOCK = 64
MATMUL_BLOCK_M = 64
MATMUL_BLOCK_K = 128
MIN_SPLIT_CHUNKS = 4  # BLOCK_K steps per split at least: shorter splits cost more than they fill
MIN_FILL = 0.7  # column tiles x K splits reach this share of the SMs, if K allows
REDUCE_BLOCK = 1024  # columns per program of the fixed-order sum of the splits
INTERPRETER_PROGRAMS = 4  # SMs to size splits by when there is no GPU to count them on
# Tiles measured best per GPU and weight shape (benchmarks/batch_invariant_sweep.py):
# {gpu name: {"N,K": [block_n, splits, warps, stages, block_k]}}
CONFIG_FILE = Path(__file__).with_name("batch_invariant_configs.json")


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """How `linear` tiles one weight: chosen from (N, K) and the device, never from M."""

    block_n: int
    splits: int  # K ranges of equal length, summed in order s = 0..splits-1
    warps: int
    stages: int
    block_k: int = MATMUL_BLOCK_K

    def as_list(self) -> list[int]:
        return [self.block_n, self.splits, self.warps, self.stages, self.block_k]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: MatmulConfig | None = None):
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation.

    Each output sums K in BLOCK_K steps, in order, within each of `splits` equal K ranges, and
    then the ranges' float32 partials in order: the same operations whatever M is. config:
    the weight's tiling (default: matmul_config's; a sweep passes its candidates)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, device=x.device, dtype=x.dtype)
    if rows == 0:
        return out
    config = config or matmul_config(cols, depth, x.device)
    split = config.splits > 1
    partials = (torch.empty(config.splits, rows, cols, device=x.device, dtype=torch.float32)
                if split else out)  # [S, M, N]
    tiles_m = triton.cdiv(rows, MATMUL_BLOCK_M)
    tiles_n = triton.cdiv(cols, config.block_n)
    chunks = triton.cdiv(depth, config.block_k)
    _matmul[(tiles_m * config.splits * tiles_n,)](
        x, weight, bias if bias is not None else weight, partials, rows, cols, depth, tiles_m,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        partials.stride(-2), partials.stride(-1), rows * cols,
        HAS_BIAS=bias is not None and not split, IEEE=x.dtype == torch.float32,
        SPLITS=config.splits, CHUNKS=chunks // config.splits,
        EVEN_K=depth % config.block_k == 0, BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.warps, num_stages=config.stages,
    )
    if split:
        _sum_splits[(rows, triton.cdiv(cols, REDUCE_BLOCK))](
            partials, bias if bias is not None else partials, out, cols, rows * cols,
            out.stride(0), SPLITS=config.splits, HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK, num_warps=4,
        )
    return out


def matmul_config(cols: int, depth: int, device: torch.device) -> MatmulConfig:
    """The tiling of an [N, K] weight on `device`; a config that followed M would change a
    row's reduction with its batch. At decode a step is bound by streaming the weights, which
    needs every SM busy: the tuned table's tiling for this GPU and shape where there is one,
    else heuristic_config's."""
    tuned = _tuned_configs(_device_name(device)).get(f"{cols},{depth}")
    return MatmulConfig(*tuned) if tuned is not None else heuristic_config(cols, depth, device)


def heuristic_config(cols: int, depth: int, device: torch.device) -> MatmulConfig:
    """matmul_config where no tiling was measured for the GPU and shape: the widest column
    tile (128, 64, 32) that still gives most SMs a program, and only where even 32 columns
    do not, K split in two, four, ... (On an H100 the measured best tilings of the 8B shapes
    are of this kind: splits beyond that only added partial sums.)"""
    programs = _num_programs(device)
    block_n = next((n for n in (128, 64) if triton.cdiv(cols, n) >= MIN_FILL * programs), 32)
    tiles = triton.cdiv(cols, block_n)
    chunks = triton.cdiv(depth, MATMUL_BLOCK_K)
    splits = 1
    while (tiles * splits < MIN_FILL * programs and chunks % (2 * splits) == 0
           and chunks // (2 * splits) >= MIN_SPLIT_CHUNKS):
        splits *= 2
    return MatmulConfig(block_n, splits, warps=4, stages=3 if block_n == 128 else 4)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def _tuned_configs(gpu: str) -> dict[str, list[int]]:
    if not CONFIG_FILE.exists():
        return {}
    return json.loads(CONFIG_FILE.read_text()).get(gpu, {})


@functools.cache
def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _matmul(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, tiles_m, stride_xm,
            stride_xk, stride_wn, stride_wk, stride_om, stride_on, stride_os,
            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
            CHUNKS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (row tile, K split, column tile) per program: out [M, N] (SPLITS 1) or the split's
    float32 partial, plane s of out [S, M, N]. Row tiles vary fastest, so programs running
    together share a weight block."""
    pid = tl.program_id(0)
    tile_m = pid % tiles_m
    split = (pid // tiles_m) % SPLITS
    tile_n = pid // (tiles_m * SPLITS)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(CHUNKS):  # the one reduction order, the same for every M
        ks = (split * CHUNKS + chunk) * BLOCK_K + tl.arange(0, BLOCK_K)
        x_mask, w_mask = row_ok[:, None], col_ok[:, None]
        if not EVEN_K:
            x_mask, w_mask = x_mask & (ks[None, :] < K), w_mask & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=x_mask,
                    other=0.0)
        # The weight block as stored, [BLOCK_N, BLOCK_K] rows along K, and its transpose into
        # the MMA: asynchronous copies straight to shared memory, no transpose in registers.
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :] * stride_wk, mask=w_mask,
                    other=0.0)
        if IEEE:  # float32 models: no TF32 rounding of the inputs
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptr += split.to(tl.int64) * stride_os
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits(partials_ptr, b_ptr, out_ptr, N, stride_ps, stride_om, SPLITS: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = ((p[0] + p[1]) + p[2]) + ... (+ bias), the splits in order, for one row's
    block of columns; partials [S, M, N] float32, contiguous."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    where = partials_ptr + row.to(tl.int64) * N + cols
    acc = tl.load(where, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(where + split * stride_ps, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    row_seq: torch.Tensor, tables: torch.Tensor, row_ctx: torch.Tensor,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention of every query row over its own sequence's cached keys.

    q [R, H, d]; caches [num_pages, page_size, Hkv, d]; row_seq [R] picks each row's page
    table in tables [S, P]; row_ctx [R] is how many keys the row sees (its position + 1).
    A row with row_ctx 0 (a graph's padding) gets zeros. Returns [R, H, d] in q's dtype.
    One program per (row, KV head) serves the KV head's query heads together, so each key
    block is read once for all of them."""
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads, dim, device=q.device, dtype=q.dtype)
    if rows == 0:
        return out
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    _paged_attention[(rows, kv_heads)](
        q, k_cache, v_cache, out, row_seq, tables, row_ctx,
        sinks if sinks is not None else q, scale, softcap or 0.0, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE_SIZE=page_size,
        HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=KV_BLOCK,
        HAS_SINKS=sinks is not None, SOFTCAP=softcap is not None, WINDOW=window is not None,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, row_seq_ptr, tables_ptr, row_ctx_ptr,
                     sinks_ptr, scale, softcap, window, stride_qt, stride_qh, stride_kp,
                     stride_ks, stride_kh, stride_ot, stride_oh, stride_table,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                     IEEE: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(row_seq_ptr + row)
    ctx = tl.load(row_ctx_ptr + row)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    members = tl.arange(0, BLOCK_G)  # the query heads of this KV head, padded to an MMA's rows
    heads = kv_head * GROUP + members
    head_ok = members < GROUP
    q_where = q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_where, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [G, D]
    first = 0
    if WINDOW:
        first = tl.maximum(ctx - window, 0)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    # Blocks at multiples of BLOCK_N from position 0, in order, from the first holding a
    # visible key: the same blocks for a token in whatever step computes it.
    start = (first // BLOCK_N) * BLOCK_N
    while start < ctx:
        m, total, acc = _attend_block(
            q, k_ptr, v_ptr, tables_ptr + seq * stride_table, start, ctx, first, m, total, acc,
            scale, softcap, kv_head * stride_kh, stride_kp, stride_ks, dims, dim_ok, PAGE_SIZE,
            BLOCK_N, SOFTCAP, IEEE)
        start += BLOCK_N
    if HAS_SINKS:  # the sink joins the softmax and adds no value
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        acc = acc * tl.exp(m - m_new)[:, None]
        total = total * tl.exp(m - m_new) + tl.exp(sink - m_new)
    out = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
    out_where = out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_where, out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _attend_block(q, k_ptr, v_ptr, table_ptr, start, ctx, first, m, total, acc, scale, softcap,
                  head_offset, stride_kp, stride_ks, dims, dim_ok, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One block of keys folded into the running (max, sum, weighted values) of every query
    head of the program, online softmax; q [G, D], m and total [G], acc [G, D]."""
    pos = start + tl.arange(0, BLOCK_N)
    visible = (pos < ctx) & (pos >= first)
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=visible, other=0)
    slot = page * stride_kp + (pos % PAGE_SIZE) * stride_ks + head_offset
    where = slot[:, None] + dims[None, :]
    ok = visible[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + where, mask=ok, other=0.0)  # [N, D]
    v = tl.load(v_ptr + where, mask=ok, other=0.0)
    if IEEE:  # float32 models: no TF32 rounding
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    if SOFTCAP:
        scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)  # tanh
    scores = tl.where(visible[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, total, acc
