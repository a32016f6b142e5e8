"""Triton version of the sampler's exponential race (argmax of logits / T - log E) and of the
greedy argmax, for CUDA. Its noise must equal sampling/noise.py's bit for bit: the same
lowbias32 hash of (seed, step, token), so the kernel picks the torch path's token (checked in
tests/unit/test_kernels.py under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
