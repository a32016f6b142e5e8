"""Triton version of sampling.metrics.token_metrics for CUDA: two launches and a top-k instead of a
dozen elementwise passes over [B, V].

Pass 1 splits each row into chunks; a program per (row, chunk) reads its logits once and keeps
the softmax moments about its running maximum m: l = sum e^(x-m), a = sum e^(x-m)(x-m),
b = sum e^(x-m)(x-m)^2, rescaled when m grows (d = m_old - m_new: l' = e^d l,
a' = e^d (a + d l), b' = e^d (b + 2 d a + d^2 l)). Pass 2 merges a row's chunks the same way and
reads off H = log l - a/l and varentropy = b/l - (a/l)^2 (the variance of log p is that of x under
p); the top-k values (torch.topk) give the top-k mass and the margin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
MAX_CHUNKS = 64  # chunks per row: enough programs to fill the GPU at batch 1


@triton.jit
def _partial_moments(x_ptr, out_ptr, vocab, stride, CHUNK: tl.constexpr,
                     NUM_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    a_sum = tl.zeros((), tl.float32)
    b_sum = tl.zeros((), tl.float32)
    bad = tl.zeros((), tl.float32)
    for offset in range(0, CHUNK, BLOCK):  # fixed trip count; masks cut the tail
        cols = start + offset + tl.arange(0, BLOCK)
        inside = cols < end
        x = tl.load(x_ptr + row * stride + cols, mask=inside, other=-float("inf"))
        bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.float32), axis=0)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        finite = x > -float("inf")  # then new_m is finite too
        z = tl.where(finite, x - new_m, 0.0)
        e = tl.where(finite, tl.exp(z), 0.0)
        d = tl.where(m > -float("inf"), m - new_m, 0.0)
        scale = tl.where(m > -float("inf"), tl.exp(d), 0.0)
        b_sum = scale * (b_sum + 2 * d * a_sum + d * d * l_sum) + tl.sum(e * z * z, axis=0)
        a_sum = scale * (a_sum + d * l_sum) + tl.sum(e * z, axis=0)
        l_sum = scale * l_sum + tl.sum(e, axis=0)
        m = new_m
    base = out_ptr + (row * NUM_CHUNKS + part) * 5
    tl.store(base + 0, m)
    tl.store(base + 1, l_sum)
    tl.store(base + 2, a_sum)
    tl.store(base + 3, b_sum)
    tl.store(base + 4, bad)


@triton.jit
def _merge(partials_ptr, top_ptr, out_ptr, top_k, NUM_CHUNKS: tl.constexpr,
           TOP_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    parts = tl.arange(0, NUM_CHUNKS)
    base = partials_ptr + (row * NUM_CHUNKS + parts) * 5
    m = tl.load(base + 0)
    l_part = tl.load(base + 1)
    a_part = tl.load(base + 2)
    b_part = tl.load(base + 3)
    bad = tl.sum(tl.load(base + 4), axis=0)
    top_m = tl.max(m, axis=0)
    seen = m > -float("inf")
    d = tl.where(seen, m - top_m, 0.0)
    scale = tl.where(seen, tl.exp(d), 0.0)
    l_sum = tl.sum(scale * l_part, axis=0)
    a_sum = tl.sum(scale * (a_part + d * l_part), axis=0)
    b_sum = tl.sum(scale * (b_part + 2 * d * a_part + d * d * l_part), axis=0)
    mean = a_sum / l_sum
    entropy = tl.maximum(tl.log(l_sum) - mean, 0.0)  # rounding can take it just below 0
    varentropy = tl.maximum(b_sum / l_sum - mean * mean, 0.0)
    ks = tl.arange(0, TOP_K)
    top = tl.load(top_ptr + row * top_k + ks, mask=ks < top_k, other=-float("inf"))
    probs = tl.where(top > -float("inf"), tl.exp(top - top_m) / l_sum, 0.0)
    first = tl.max(tl.where(ks == 0, probs, 0.0), axis=0)
    second = tl.max(tl.where(ks == 1, probs, 0.0), axis=0)
    broken = (bad > 0) | (top_m == -float("inf"))
    nan = float("nan")
    tl.store(out_ptr + row * 4 + 0, tl.where(broken, nan, entropy))
    tl.store(out_ptr + row * 4 + 1, tl.where(broken, nan, varentropy))
    tl.store(out_ptr + row * 4 + 2, tl.where(broken, nan, tl.sum(probs, axis=0)))
    tl.store(out_ptr + row * 4 + 3, tl.where(broken, nan, first - second))


def token_metrics(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """float32 logits [B, V] (last dim contiguous) -> [B, 4], as sampling.metrics.token_metrics."""
    batch, vocab = logits.shape
    chunks = min(MAX_CHUNKS, triton.next_power_of_2(max(1, -(-vocab // (4 * BLOCK)))))
    chunk = -(-vocab // chunks)
    partials = torch.empty(batch, chunks, 5, device=logits.device, dtype=torch.float32)
    block = min(BLOCK, triton.next_power_of_2(chunk))
    _partial_moments[(batch, chunks)](logits, partials, vocab, logits.stride(0), CHUNK=chunk,
                                      NUM_CHUNKS=chunks, BLOCK=block)  # fmt: skip
    k = min(top_k, vocab)
    top = logits.topk(k, dim=-1).values.contiguous()  # [B, k], best first
    out = torch.empty(batch, 4, device=logits.device, dtype=torch.float32)
    _merge[(batch,)](partials, top, out, k, NUM_CHUNKS=chunks,
                     TOP_K=triton.next_power_of_2(max(k, 2)))  # fmt: skip
    return out
