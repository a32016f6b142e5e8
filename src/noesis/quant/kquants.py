"""Encoders for llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K): float rows -> the bytes a GGUF file
stores, which noesis.weights.gguf (and the `gguf` package) decode. The `gguf` package decodes these
types but cannot encode them; benchmarks/quant_quality.py and the tests write K-quant files with
these.

A block is 256 values (QK_K) of one row:
- Q4_K / Q5_K: eight sub-blocks of 32, value = d * sc_j * q - dmin * m_j with q in [0, 15]
  (Q5_K: [0, 31]), six-bit sub-block scales sc_j and minimums m_j, and float16 d and dmin per
  block. Each sub-block's (scale, minimum) is fitted by weighted least squares over a few
  candidate grids (weights |x| + rms(x), as llama.cpp's reference quantizer weighs them), the
  minimum kept >= 0 (a sub-block's grid starts at or below zero).
- Q6_K: sixteen sub-blocks of 16, value = d * sc_j * (q - 32) with q in [0, 63] and signed
  eight-bit sc_j; each sub-block's scale fitted the same way, symmetric.
Then the sub-block scales are quantized against the block's float16 d, and every q is chosen
again against the stored (rounded) scales, so the error is the grid's, not the fit's.
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_STEPS = torch.arange(-10, 11, dtype=torch.float32) / 10  # candidate grid offsets, in q units


def quantize_k(values: np.ndarray | torch.Tensor, kind: str) -> np.ndarray:
    """Rows of float values [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * block bytes]
    in `kind`'s layout (Q4_K, Q5_K or Q6_K)."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"K-quant type {kind!r} is not one of {', '.join(BLOCK_BYTES)}")
    x = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the input may be read-only
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} values, got shape "
                         f"{tuple(x.shape)}")
    blocks = x.reshape(-1, QK_K)
    encoded = _q6_k(blocks) if kind == "Q6_K" else _q45_k(blocks, 31 if kind == "Q5_K" else 15)
    return encoded.numpy().reshape(*x.shape[:-1], -1)


def _q45_k(blocks: torch.Tensor, nmax: int) -> torch.Tensor:
    """Q4_K (nmax 15) or Q5_K (nmax 31) blocks [B, 256] -> bytes [B, 144 or 176]."""
    sub = blocks.reshape(-1, 8, 32)
    scale, minimum = _fit_affine(sub, nmax)  # [B, 8] each, minimum >= 0
    d, sc = _six_bits(scale)
    dmin, mn = _six_bits(minimum)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * mn)[..., None]
    q = torch.where(step > 0, torch.round((sub + offset) / step.clamp_min(1e-30)), 0.0)
    q = q.clamp(0, nmax).to(torch.int32).reshape(-1, 4, 2, 32)  # [B, pair of sub-blocks, 2, 32]
    low = q & 15
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # sub-block 2g low, 2g + 1 high
    parts = [_half_bytes(d), _half_bytes(dmin), _pack_scales(sc, mn)]
    if nmax == 31:  # Q5_K: the fifth bits, bit j of byte i for sub-block j's value i
        high = (q.reshape(-1, 8, 32) >> 4) & 1
        parts.append((high << torch.arange(8)[None, :, None]).sum(1))
    parts.append(qs)
    return torch.cat([p.to(torch.uint8) for p in parts], 1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [B, 256] -> bytes [B, 210]."""
    sub = blocks.reshape(-1, 16, 16)
    scale = _fit_symmetric(sub, 32)  # [B, 16], signed
    largest = torch.gather(scale, 1, scale.abs().argmax(1, keepdim=True))[:, 0]
    inverse = torch.where(largest != 0, -128 / largest.where(largest != 0, 1.0), 0.0)
    d = _as_half(torch.where(inverse != 0, 1 / inverse.where(inverse != 0, 1.0), 0.0))
    sc = torch.round(inverse[:, None] * scale).clamp(-128, 127)
    step = (d[:, None] * sc)[..., None]
    q = torch.where(step != 0, torch.round(sub / step.where(step != 0, 1.0)), 0.0)
    q = (q.clamp(-32, 31) + 32).to(torch.int32).reshape(-1, 2, 2, 2, 32)  # [B, h, n, j, 32]
    # value 128 h + 64 n + 32 j + i: low nibble n of ql byte 64 h + 32 j + i, high bits 2 (2 n + j)
    # of qh byte 32 h + i
    ql = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # [B, h, 2 n + j, 32]
    qh = (high << (2 * torch.arange(4))[None, None, :, None]).sum(2).reshape(-1, 64)
    return torch.cat([ql.to(torch.uint8), qh.to(torch.uint8),
                      sc.to(torch.int8).view(torch.uint8), _half_bytes(d)], 1)


def _fit_affine(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] ~ scale * q - minimum, q in [0, nmax], minimum >= 0: the best weighted fit of
    a grid of candidates (scale, minimum [...])."""
    weight = x.abs() + x.pow(2).mean(-1, keepdim=True).sqrt()
    low = x.amin(-1).clamp(max=0)
    span = (x.amax(-1) - low).clamp_min(1e-30)
    best_err = torch.full(low.shape, float("inf"))
    best_scale, best_min = span / nmax, -low
    for step in _STEPS:
        q = torch.round((x - low[..., None]) * ((nmax + step) / span)[..., None]).clamp(0, nmax)
        scale, offset = _weighted_line(q, x, weight)
        err = (weight * (scale[..., None] * q + offset[..., None] - x).pow(2)).sum(-1)
        better = (err < best_err) & (scale > 0)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, -offset, best_min)
    return best_scale, best_min


def _weighted_line(q, x, w):
    """Weighted least squares x ~ scale * q + offset with offset <= 0."""
    sw, sq, sx = w.sum(-1), (w * q).sum(-1), (w * x).sum(-1)
    sqq, sqx = (w * q * q).sum(-1), (w * q * x).sum(-1)
    det = sw * sqq - sq * sq
    safe = det.where(det > 0, 1.0)
    scale = torch.where(det > 0, (sw * sqx - sq * sx) / safe, 0.0)
    offset = torch.where(det > 0, (sqq * sx - sq * sqx) / safe, 0.0)
    clipped = offset > 0  # the grid would start above zero: pin it at zero
    scale = torch.where(clipped, sqx / sqq.clamp_min(1e-30), scale)
    return scale, torch.where(clipped, 0.0, offset)


def _fit_symmetric(x: torch.Tensor, half: int) -> torch.Tensor:
    """x [..., n] ~ scale * q with q in [-half, half - 1]: the best fit (weights x^2) over
    candidate scales around the largest magnitude's."""
    weight = x * x
    largest = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))[..., 0]
    safe = largest.where(largest != 0, 1.0)
    best_err = torch.full(largest.shape, float("inf"))
    best = torch.zeros_like(largest)
    for step in _STEPS:
        q = torch.round(x * (-(half + step) / safe)[..., None]).clamp(-half, half - 1)
        sqq = (weight * q * q).sum(-1)
        scale = (weight * q * x).sum(-1) / sqq.clamp_min(1e-30)
        err = (weight * (scale[..., None] * q - x).pow(2)).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, scale, best)
    return torch.where(largest != 0, best, 0.0)


def _six_bits(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values [B, 8] -> (a float16 step per block [B] as float32, six-bit codes
    [B, 8]): values ~ step * code."""
    top = values.amax(1)
    step = _as_half(top / 63)
    codes = torch.where(step[:, None] > 0, torch.round(values / step.clamp_min(1e-30)[:, None]),
                        0.0)
    return step, codes.clamp(0, 63).to(torch.int32)


def _pack_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Six-bit scales and minimums [B, 8] -> Q4_K's 12 bytes: sub-blocks 0-3 in the low six bits
    of bytes 0-3 (scales) and 4-7 (minimums), 4-7 split into low nibbles in bytes 8-11 and their
    top two bits in the top bits of bytes 0-7."""
    low_sc, high_sc = sc[:, :4], sc[:, 4:]
    low_mn, high_mn = mn[:, :4], mn[:, 4:]
    return torch.cat([low_sc | ((high_sc >> 4) << 6), low_mn | ((high_mn >> 4) << 6),
                      (high_sc & 15) | ((high_mn & 15) << 4)], 1)


def _as_half(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).to(torch.float32)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 values [B] (float16-exact) -> their float16 bytes [B, 2], little-endian."""
    return values.to(torch.float16).view(torch.uint8).reshape(-1, 2)
