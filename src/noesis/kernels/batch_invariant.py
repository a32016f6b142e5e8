"""Batch-invariant Triton kernels: a row's result never depends on how many rows share the call.

cuBLAS and the flash kernels pick tile shapes, split-K and split-KV from the batch, so a token's
logits change with the traffic beside it. These kernels fix every reduction order by the weight's
(or the context's) shape alone:

- `linear`: a persistent matmul whose tile configuration depends on (N, K) only and never
  splits K, so each output's K-reduction runs in BLOCK_K steps, in order, whatever M is;
- `paged_attention`: one program per (query token, head) that walks its own keys in blocks of
  KV_BLOCK positions counted from position 0, in order, whatever shares the step; a token
  computes the same attention inside a prefill chunk, a one-shot prefill or a decode.

RMSNorm needs nothing new: `pointwise.add_rms_norm` runs one program per row already.
Both run under Triton's interpreter on the CPU (tests/unit/test_batch_invariant.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Keys per attention block. A token's blocks start at multiples of this from position 0, so
# they are the same in every step that computes it.
KV_BLOCK = 64
MATMUL_BLOCK_M = 64
MATMUL_BLOCK_K = 64
INTERPRETER_PROGRAMS = 4  # persistent programs when there is no GPU to count SMs on


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation."""
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, device=x.device, dtype=x.dtype)
    if rows == 0:
        return out
    block_n, warps, stages = _matmul_config(cols, depth, x.device)
    tiles = triton.cdiv(rows, MATMUL_BLOCK_M) * triton.cdiv(cols, block_n)
    programs = _num_programs(x.device)
    _matmul[(min(tiles, programs),)](
        x, weight, bias if bias is not None else weight, out, rows, cols, depth, tiles,
        triton.cdiv(rows, MATMUL_BLOCK_M),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        out.stride(1), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=block_n, BLOCK_K=MATMUL_BLOCK_K, NUM_PROGRAMS=programs,
        num_warps=warps, num_stages=stages,
    )
    return out


def _matmul_config(cols: int, depth: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) from the weight's shape and the device only, never from M: a
    config that followed M would change a row's reduction with its batch. Narrower column
    tiles where wide ones would leave SMs idle at batch 1 (decode is bandwidth-bound)."""
    wide = triton.cdiv(cols, 128) >= _num_programs(device)
    return (128, 8, 3) if wide else (64, 4, 4)


@functools.cache
def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _matmul(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, tiles, tiles_m, stride_xm,
            stride_xk, stride_wn, stride_wk, stride_om, stride_on, HAS_BIAS: tl.constexpr,
            IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            NUM_PROGRAMS: tl.constexpr):
    # Persistent: program p takes tiles p, p + NUM_PROGRAMS, ...; column-major over tiles, so
    # programs running together share a weight block.
    tile = tl.program_id(0)
    while tile < tiles:
        _matmul_tile(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, tile % tiles_m, tile // tiles_m,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                     HAS_BIAS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        tile += NUM_PROGRAMS


@triton.jit
def _matmul_tile(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, tile_m, tile_n,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one reduction order, the same for every M
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:  # float32 models: no TF32 rounding of the inputs
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    row_seq: torch.Tensor, tables: torch.Tensor, row_ctx: torch.Tensor,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention of every query row over its own sequence's cached keys.

    q [R, H, d]; caches [num_pages, page_size, Hkv, d]; row_seq [R] picks each row's page
    table in tables [S, P]; row_ctx [R] is how many keys the row sees (its position + 1).
    A row with row_ctx 0 (a graph's padding) gets zeros. Returns [R, H, d] in q's dtype."""
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads, dim, device=q.device, dtype=q.dtype)
    if rows == 0:
        return out
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    _paged_attention[(rows, heads)](
        q, k_cache, v_cache, out, row_seq, tables, row_ctx,
        sinks if sinks is not None else q, scale, softcap or 0.0, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=heads // kv_heads, PAGE_SIZE=page_size, HEAD_DIM=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=KV_BLOCK, HAS_SINKS=sinks is not None,
        SOFTCAP=softcap is not None, WINDOW=window is not None, num_warps=4,
    )
    return out


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, row_seq_ptr, tables_ptr, row_ctx_ptr,
                     sinks_ptr, scale, softcap, window, stride_qt, stride_qh, stride_kp,
                     stride_ks, stride_kh, stride_ot, stride_oh, stride_table,
                     GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr,
                     SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(row_seq_ptr + row)
    ctx = tl.load(row_ctx_ptr + row)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dims, mask=dim_ok,
                other=0.0).to(tl.float32)
    first = 0
    if WINDOW:
        first = tl.maximum(ctx - window, 0)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    # Blocks at multiples of BLOCK_N from position 0, in order, from the first holding a
    # visible key: the same blocks for a token in whatever step computes it.
    start = (first // BLOCK_N) * BLOCK_N
    while start < ctx:
        m, total, acc = _attend_block(
            q, k_ptr, v_ptr, tables_ptr + seq * stride_table, start, ctx, first, m, total, acc,
            scale, softcap, kv_head * stride_kh, stride_kp, stride_ks, dims, dim_ok, PAGE_SIZE,
            BLOCK_N, SOFTCAP)
        start += BLOCK_N
    if HAS_SINKS:  # the sink joins the softmax and adds no value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        acc = acc * tl.exp(m - m_new)
        total = total * tl.exp(m - m_new) + tl.exp(sink - m_new)
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _attend_block(q, k_ptr, v_ptr, table_ptr, start, ctx, first, m, total, acc, scale, softcap,
                  head_offset, stride_kp, stride_ks, dims, dim_ok, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr):
    """One block of keys folded into the running (max, sum, weighted values), online softmax."""
    pos = start + tl.arange(0, BLOCK_N)
    visible = (pos < ctx) & (pos >= first)
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=visible, other=0)
    slot = page * stride_kp + (pos % PAGE_SIZE) * stride_ks + head_offset
    where = slot[:, None] + dims[None, :]
    ok = visible[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + where, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + where, mask=ok, other=0.0).to(tl.float32)
    scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_N]
    if SOFTCAP:
        scores = softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)  # tanh
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new)
    total = total * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    return m_new, total, acc
