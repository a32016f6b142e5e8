"""BitLinear: quantization-aware training of ternary projections, and their packed export.

Forward (BitNet b1.58): weights ternarized with their absmean scale, activations quantized to int8
per token with their absmax; the product is taken on the integer values (exact even under bf16
autocast: |q| <= 128 and w in {-1, 0, 1} are exact in bf16, sums accumulate in float32) and scaled
back. Backward: straight-through, i.e. the gradients of x @ dequantized(W)^T with the rounding and
the scales held fixed. The model keeps float latent weights; only the export packs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from noesis.ternary.quant import (
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    absmean_ternary,
    pack,
    quantize_activations,
)

# Projections of the tiny trainer's Llama layers that become BitLinear.
PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


class BitLinear(nn.Linear):
    """nn.Linear whose forward sees ternary weights and int8 activations (straight-through)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        q, s = quantize_activations(x32.detach())
        x_int = _straight_through(x32 * s, q)  # [..., K] integer-valued
        ternary, scale = absmean_ternary(self.weight.detach().float())
        w_int = _straight_through(self.weight / scale, ternary)  # [N, K] in {-1, 0, 1}
        y = F.linear(x_int, w_int).float() * (scale / s)  # [..., N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(_output_dtype(x))


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """What nn.Linear would return: the autocast dtype inside autocast, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` in the forward pass, the identity's gradient to `x` in the backward pass."""
    return x + (rounded - x).detach()


def to_bitlinear(model: nn.Module) -> nn.Module:
    """Swap every attention and MLP projection of a noesis.tiny Llama for a BitLinear that keeps
    the same weight Parameter (names, initialization and optimizer state are unchanged)."""
    for layer in model.model.layers:
        for block_name, names in PROJECTIONS.items():
            block = getattr(layer, block_name)
            for name in names:
                dense = getattr(block, name)
                bit = BitLinear(
                    dense.in_features, dense.out_features, dense.bias is not None, device="meta"
                )
                bit.weight = dense.weight
                bit.bias = dense.bias
                setattr(block, name, bit)
    return model


def packed_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a model with BitLinear projections: each projection as packed
    codes and float32 row scales (the tensor's absmean scale repeated), the rest in `dtype`."""
    bitlinear = {name for name, module in model.named_modules() if isinstance(module, BitLinear)}
    tensors = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in bitlinear and leaf == "weight":
            ternary, scale = absmean_ternary(tensor.detach().float().cpu())
            tensors[f"{module}.{PACKED_SUFFIX}"] = pack(ternary.to(torch.int8))
            tensors[f"{module}.{SCALE_SUFFIX}"] = scale.expand(tensor.shape[0]).contiguous()
        else:
            tensors[name] = tensor.detach().to("cpu", dtype).contiguous()
    return tensors
