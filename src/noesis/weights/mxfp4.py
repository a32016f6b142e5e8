"""MXFP4 (OCP microscaling FP4) weights as gpt-oss stores its experts: dequantized on load, or
on CUDA kept packed (`Mxfp4Weight`) for the fused experts kernel (kernels/moe_triton.py).

A block of 32 values shares one power-of-two scale: `*_blocks` [..., G, 16] uint8 holds two
E2M1 codes per byte (the low nibble is the earlier value), `*_scales` [..., G] uint8 the
exponents biased by 127. The result is [..., G * 32].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

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
MXFP4_BLOCK = 32  # values per scale; two per byte


@dataclass(frozen=True)
class Mxfp4Weight:
    """Stacked expert weights [E, N, K] as stored: blocks [E, N, K / 32, 16] uint8, scales
    [E, N, K / 32] uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups, _ = self.blocks.shape
        return experts, rows, groups * MXFP4_BLOCK

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


def keeps_packed(device: torch.device) -> bool:
    """MXFP4 experts stay packed where the fused kernel reads them: CUDA. Elsewhere they are
    dequantized at load to the model dtype."""
    return device.type == "cuda"


def pack_experts(model: nn.Module) -> int:
    """Every experts module of `model` (built on the meta device) switched to packed MXFP4
    parameters before loading; returns how many."""
    from noesis.models.moe import Experts

    experts = [module for module in model.modules() if isinstance(module, Experts)]
    for module in experts:
        module.keep_mxfp4_packed()
    return len(experts)


def packed_memory_lines(
    index: dict, float_bytes: int, dtype: torch.dtype, device: torch.device
) -> dict[str, str]:
    """`noesis info`'s memory lines for an MXFP4 checkpoint: the text weights with the experts
    packed (CUDA) against all of them dequantized to `dtype` (elsewhere). `index` maps checkpoint
    keys to (file, shape); `float_bytes` is every text weight in `dtype`."""
    packed = expert_values = 0
    for key, (_, shape) in index.items():
        if key.endswith(("_blocks", "_scales")):
            packed += math.prod(shape)  # one byte each
            expert_values += math.prod(shape) * 2 if key.endswith("_blocks") else 0
    kept = float_bytes - expert_values * dtype.itemsize + packed
    name = str(dtype).removeprefix("torch.")
    return {
        "weights in memory": f"{_gib(kept)} (experts MXFP4-packed)" if keeps_packed(device)
        else f"{_gib(float_bytes)} (experts dequantized to {name} at load)",
        "mxfp4 experts": f"{_gib(packed)} packed; {_gib(kept)} in all on CUDA, "
                         f"{kept / float_bytes:.0%} of {_gib(float_bytes)} dequantized",
    }  # fmt: skip


def _gib(num_bytes: int) -> str:
    return (
        f"{num_bytes / (1 << 30):.2f} GiB"
        if num_bytes >= 1 << 30
        else f"{num_bytes / (1 << 20):.1f} MiB"
    )


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
