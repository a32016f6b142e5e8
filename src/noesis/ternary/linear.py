"""TernaryLinear, the engine's packed projection, and the hook that installs it in a decoder.

A checkpoint whose config.json has `"quantization_config": {"quant_method": "ternary", ...}`
stores every attention and MLP projection as `<proj>.weight_packed` (uint8) and
`<proj>.weight_scale` (one per output row); `weights/loader.py` fills them like any parameter
(stacking q/k/v and gate/up rows) and then calls `check_loaded`. Embeddings, norms and the LM head
stay float.
"""

from __future__ import annotations

import torch
from torch import nn

from noesis.errors import UnsupportedModel
from noesis.models.config import ModelConfig
from noesis.ternary import kernel
from noesis.ternary.quant import (
    TernaryFormatError,
    check_codes,
    check_packed,
    reference_linear,
)

SUPPORTED = {"bits": 2, "weight_scale": "per_output_row", "activation": "int8_per_token_absmax"}
# (submodule, projection) pairs of a decoder layer that become ternary
PROJECTIONS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


class TernaryLinear(nn.Module):
    """y = quant8(x) @ W^T * scale (+ bias), W ternary and packed 4 weights per byte."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        packed = torch.empty(out_features, -(-in_features // 4), dtype=torch.uint8)
        self.weight_packed = nn.Parameter(packed, requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Batch-1 decode calls are a few microseconds: skip every no-op reshape and cast.
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, K]
        if flat.device.type == "cpu":
            lib = kernel.library()
            y = kernel.run(lib, flat, self.weight_packed, self.weight_scale, self.in_features)
        else:  # the same arithmetic in PyTorch: the compiled kernel is CPU only
            y = reference_linear(flat, self.weight_packed, self.weight_scale, self.in_features)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias

    def check_loaded(self, name: str) -> None:
        """Called by the weight loader once the tensors are in: reject corrupt contents."""
        try:
            check_packed(self.weight_packed, self.out_features, self.in_features)
            if not self.weight_packed.is_contiguous():
                raise TernaryFormatError("packed ternary weight is not contiguous")
            check_codes(self.weight_packed)
        except TernaryFormatError as exc:
            raise TernaryFormatError(f"{name}.weight_packed: {exc}") from None
        scale = self.weight_scale.float()
        if not (torch.isfinite(scale).all() and (scale >= 0).all()):
            raise TernaryFormatError(f"{name}.weight_scale holds negative or non-finite values")
        if self.weight_packed.device.type == "cpu":
            kernel.library()  # build (or find) the kernel now: a missing compiler fails the load

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def use_ternary_projections(model: nn.Module, config: ModelConfig) -> None:
    """Replace each layer's attention and MLP projections with TernaryLinear of the same shape."""
    check_quantization_config(config.raw["quantization_config"])
    for layer in model.model.layers:
        for block_name, proj_name in PROJECTIONS:
            block = getattr(layer, block_name)
            dense = getattr(block, proj_name)
            ternary = TernaryLinear(dense.in_features, dense.out_features, dense.bias is not None)
            setattr(block, proj_name, ternary)


def check_quantization_config(quantization: dict) -> None:
    """Raise UnsupportedModel for a ternary variant this runtime does not implement."""
    wrong = [
        f"{key}={quantization.get(key)!r} (supported: {value!r})"
        for key, value in SUPPORTED.items()
        if quantization.get(key, value) != value
    ]
    if wrong:
        raise UnsupportedModel("unsupported ternary quantization_config: " + ", ".join(wrong))
