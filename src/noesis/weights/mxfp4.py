"""MXFP4 (OCP microscaling FP4) weights as gpt-oss stores its experts, dequantized on load.

A block of 32 values shares one power-of-two scale: `*_blocks` [..., G, 16] uint8 holds two
E2M1 codes per byte (the low nibble is the earlier value), `*_scales` [..., G] uint8 the
exponents biased by 127. The result is [..., G * 32].
"""

from __future__ import annotations

import torch

# E2M1 code -> value: sign bit, then two exponent bits and one mantissa bit.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G * 32] in `dtype`.
    Exact in float32 and bfloat16 (same exponent range); float16 may overflow."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2).to(dtype)
