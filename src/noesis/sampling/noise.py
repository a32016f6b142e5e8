"""Counter-based random numbers on the device: uniform(seed, step, token) with no generator state.

A request's noise depends only on its seed and its step, never on the batch it lands in, and
needs no host round trip, so it can run inside a captured graph. The hash is lowbias32 (a
well-mixed 32-bit integer hash) applied twice, computed in int64 with explicit 32-bit masks.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] from int64 seeds [B] and steps [B]."""
    return uniform_at(seeds, steps, torch.arange(vocab_size, device=seeds.device))


def uniform_at(seeds: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The same noise for chosen token ids only: tokens [V] (every row) or [B, K] (per row)."""
    key = _mix32((seeds & MASK32) ^ _mix32(((seeds >> 32) & MASK32) ^ _mix32(steps & MASK32)))
    key2 = _mix32(key ^ 0x5BD1E995)
    x = _mix32(((tokens.to(torch.int64) * 0x9E3779B1) + key[:, None]) & MASK32)
    return unit_interval(_mix32(x ^ key2[:, None]))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 in (0, 1), never 0 or 1."""
    # 23 bits: (k + 0.5) / 2^23 is exact in float32, so u lies in [2^-24, 1 - 2^-24]. With 24
    # bits the top value rounded to 1.0, its Exp(1) noise to 0 and its score to +inf (or NaN for
    # a masked token): once in 2^24 tokens a token won whatever its probability.
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V]; argmax(p / E) samples from p."""
    return -torch.log(uniform(seeds, steps, vocab_size))


def exponential_at(seeds: torch.Tensor, steps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise of chosen token ids [B, K], equal to exponential()'s at those columns."""
    return -torch.log(uniform_at(seeds, steps, tokens))
