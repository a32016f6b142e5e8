"""Triton version of sampling.metrics.token_metrics for CUDA: two launches, each logit read once.

Pass 1 splits each row into blocks of BLOCK logits, one program per (row, block), so that a
128k row spreads over ~128 programs even at batch 1. A program reads its block once and keeps
the softmax moments about the block's maximum m: l = sum e^(x-m), a = sum e^(x-m)(x-m),
b = sum e^(x-m)(x-m)^2, a count of NaN/+inf, and the block's TOP_K largest logits (with
repeats, as torch.topk counts them). Pass 2, one program per row, merges the blocks in a fixed
reduction order, so a row's result never depends on its batch (d = m_block - m_row:
l += e^d l_b, a += e^d (a_b + d l_b), b += e^d (b_b + 2 d a_b + d^2 l_b)), reads off
H = log l - a/l and varentropy = b/l - (a/l)^2 (the variance of log p is that of x under p),
and takes the row's top-k from the blocks' (the row's k largest are among them). No sort, no
torch.topk, no host sync; the grid depends only on the shape, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCKS = 256  # blocks per row at most: pass 2 holds a row's partials in registers
MIN_BLOCK = 1024  # logits per program: 128 programs over a 128k row, 8 per thread at 4 warps
MOMENTS = 5  # a block's partials row: m, l, a, b, bad (the kernels' "5"), then its top-k


@triton.jit
def _block_partials(x_ptr, partials_ptr, vocab, stride, num_blocks, BLOCK: tl.constexpr,
                    TOP_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + cols, mask=cols < vocab, other=-float("inf"))
    bad = tl.sum(((x != x) | (x == float("inf"))).to(tl.float32), axis=0)
    m = tl.max(x, axis=0)
    finite = x > -float("inf")  # then m is finite too
    z = tl.where(finite, x - m, 0.0)
    e = tl.where(finite, tl.exp(z), 0.0)
    base = partials_ptr + (row * num_blocks + part) * (5 + TOP_K)
    tl.store(base + 0, m)
    tl.store(base + 1, tl.sum(e, axis=0))
    tl.store(base + 2, tl.sum(e * z, axis=0))
    tl.store(base + 3, tl.sum(e * z * z, axis=0))
    tl.store(base + 4, bad)
    _store_top(x, base + 5, BLOCK, TOP_K)


@triton.jit
def _store_top(x, out_ptr, SIZE: tl.constexpr, TOP_K: tl.constexpr):
    """The TOP_K largest of x [SIZE], best first, to out_ptr[0:TOP_K]: each round takes the
    maximum and removes one entry holding it (the first), so a repeated value counts each time."""
    index = tl.arange(0, SIZE)
    for j in tl.static_range(TOP_K):
        best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        x = tl.where(index == at, -float("inf"), x)
        tl.store(out_ptr + j, best)


@triton.jit
def _merge(partials_ptr, out_ptr, num_blocks, BLOCKS: tl.constexpr, TOP_K: tl.constexpr,
           K_PAD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCKS)
    inside = parts < num_blocks
    row_ptr = partials_ptr + row * num_blocks * (5 + TOP_K)
    base = row_ptr + parts * (5 + TOP_K)
    m = tl.load(base + 0, mask=inside, other=-float("inf"))
    l_part = tl.load(base + 1, mask=inside, other=0.0)
    a_part = tl.load(base + 2, mask=inside, other=0.0)
    b_part = tl.load(base + 3, mask=inside, other=0.0)
    bad = tl.sum(tl.load(base + 4, mask=inside, other=0.0), axis=0)
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
    mass, first, second = _top_probs(row_ptr, num_blocks, top_m, l_sum, BLOCKS, TOP_K, K_PAD)
    broken = (bad > 0) | (top_m == -float("inf"))
    nan = float("nan")
    tl.store(out_ptr + row * 4 + 0, tl.where(broken, nan, entropy))
    tl.store(out_ptr + row * 4 + 1, tl.where(broken, nan, varentropy))
    tl.store(out_ptr + row * 4 + 2, tl.where(broken, nan, mass))
    tl.store(out_ptr + row * 4 + 3, tl.where(broken, nan, first - second))


@triton.jit
def _top_probs(row_ptr, num_blocks, top_m, l_sum, BLOCKS: tl.constexpr, TOP_K: tl.constexpr,
               K_PAD: tl.constexpr):  # fmt: skip
    """(top-k mass, p of the best, p of the second best) from the blocks' top-k logits."""
    slots = tl.arange(0, BLOCKS)[:, None] * (5 + TOP_K) + tl.arange(0, K_PAD)[None, :]  # [C, K]
    valid = (tl.arange(0, BLOCKS)[:, None] < num_blocks) & (tl.arange(0, K_PAD)[None, :] < TOP_K)
    x = tl.load(row_ptr + 5 + slots, mask=valid, other=-float("inf"))
    slots = tl.where(valid, slots, 2**30)
    mass = tl.zeros((), tl.float32)
    first = tl.zeros((), tl.float32)
    second = tl.zeros((), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(x, axis=1), axis=0)
        taken = tl.min(tl.min(tl.where(x == best, slots, 2**30), axis=1), axis=0)
        x = tl.where(slots == taken, -float("inf"), x)
        p = tl.where(best > -float("inf"), tl.exp(best - top_m) / l_sum, 0.0)
        mass += p
        if j == 0:
            first = p
        if j == 1:
            second = p
    return mass, first, second


def token_metrics(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """float32 logits [B, V] (last dim contiguous) -> [B, 4], as sampling.metrics.token_metrics."""
    batch, vocab = logits.shape
    block = block_size(vocab)
    blocks = -(-vocab // block)
    k = min(top_k, vocab)
    partials = torch.empty(batch, blocks, MOMENTS + k, device=logits.device, dtype=torch.float32)
    _block_partials[(batch, blocks)](logits, partials, vocab, logits.stride(0), blocks,
                                     BLOCK=block, TOP_K=k)  # fmt: skip
    out = torch.empty(batch, 4, device=logits.device, dtype=torch.float32)
    _merge[(batch,)](partials, out, blocks, BLOCKS=triton.next_power_of_2(blocks), TOP_K=k,
                     K_PAD=triton.next_power_of_2(max(k, 2)))  # fmt: skip
    return out


def block_size(vocab: int) -> int:
    """Logits per pass-1 program: MIN_BLOCK, more where the row would need over MAX_BLOCKS
    blocks, less (a power of two, at least 16) for a row shorter than one block."""
    wide = max(MIN_BLOCK, triton.next_power_of_2(-(-vocab // MAX_BLOCKS)))
    return min(wide, max(16, triton.next_power_of_2(vocab)))
