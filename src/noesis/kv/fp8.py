"""fp8 (e4m3) KV pages: keys and values stored as torch.float8_e4m3fn, each divided by a fixed
scale per layer, K/V and KV head, half the bytes of a bf16 cache (twice the pages).

Scales are fixed once at load from a calibration forward (noesis.runner.fp8_attention), not at
the first request's prefill: a scale taken from whichever request came first would make every
later request's tokens depend on it, which breaks per-request reproducibility and replay. The
calibration's largest |k| and |v| of a head map to FP8_MAX / HEADROOM, so a later token may be
HEADROOM times larger before it clamps; e4m3 keeps its 3-bit mantissa for values down to 2^-6,
12 binades under that, so smaller values lose nothing to the headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
HEADROOM = 8.0
KV_CACHE_DTYPES = ("auto", "fp8")


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for EngineConfig.kv_cache_dtype ("auto": the model's)."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return FP8 if name == "fp8" else model_dtype


@dataclass(slots=True)
class FP8LayerCache:
    """One attention layer's pages and the scales they were stored with."""

    data: torch.Tensor  # [2, pages, page_size, Hkv, d] float8_e4m3fn
    scales: torch.Tensor  # [2, Hkv, 1] float32, contiguous: stored value = x / scale

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device) -> FP8LayerCache:
        """Zeroed pages with unit scales (calibration sets the scales before any use)."""
        scales = torch.ones(2, shape[-2], 1, dtype=torch.float32, device=device)
        return cls(torch.zeros(shape, dtype=FP8, device=device), scales)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-head scales [2, Hkv, 1] from the calibration's largest |k| and |v| [2, Hkv]."""
    return (amax.float().clamp_min(1e-6) * HEADROOM / FP8_MAX)[..., None].contiguous()


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, d] / scale [Hkv, 1] as e4m3, clamped to its finite range (a cast past it
    gives NaN, not the largest value). The Triton writes store the same bits
    (noesis.kernels.e4m3)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def write_slots(cache: FP8LayerCache, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Quantize k, v [T, Hkv, d] into cache slots [T]. (Copies go through uint8 views: CPU
    index_copy_ and indexing have no e4m3 kernels; the bytes are the same.)"""
    flat = _bytes(cache).view(2, -1, *cache.data.shape[-2:])  # [2, num_slots, Hkv, d]
    flat[0].index_copy_(0, slots, quantize(k, cache.scales[0]).view(torch.uint8))
    flat[1].index_copy_(0, slots, quantize(v, cache.scales[1]).view(torch.uint8))


def read_slots(cache: FP8LayerCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys and values [2, *slots.shape, Hkv, d] in `dtype` at cache slots, dequantized: only
    the gathered slots are converted, never the whole pool."""
    stored = _bytes(cache).view(2, -1, *cache.data.shape[-2:])[:, slots].view(FP8)
    scales = cache.scales.view(2, *([1] * slots.dim()), -1, 1)
    return (stored.float() * scales).to(dtype)


def _bytes(cache: FP8LayerCache) -> torch.Tensor:
    return cache.data.view(torch.uint8)
