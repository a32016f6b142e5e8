"""Ternary arithmetic and the packed format: absmean weights, absmax int8 activations, 2-bit codes.

Packed format (one safetensors pair per projection, `<proj>.weight_packed` and
`<proj>.weight_scale`): row n of the [N, K] ternary weight is ceil(K / 4) uint8 bytes; weight k is
the 2-bit code w + 1 (0, 1 or 2; 3 never occurs) at bits 2 * (k % 4) of byte k // 4, and the
padding fields of the last byte hold code 1 (zero). The dequantized weight is w * scale[n].

Scales are stored per output row although training uses one absmean scale per tensor (BitNet
b1.58): the engine stacks q/k/v and gate/up into fused projections, whose rows then carry different
scales, and a row scale costs 4 bytes against ceil(K / 4) bytes of codes (under 1% at K >= 512).
"""

from __future__ import annotations

import torch

from noesis.errors import CheckpointError

QUANT_METHOD = "ternary"
WEIGHT_EPS = 1e-5  # floor of the absmean scale: an all-zero weight stays zero
ACTIVATION_EPS = 1e-5  # floor of a token's absmax
ACTIVATION_MAX = 127.0
PACKED_SUFFIX = "weight_packed"
SCALE_SUFFIX = "weight_scale"


class TernaryFormatError(CheckpointError):
    """A packed ternary tensor has the wrong dtype or shape, or holds an invalid code."""


def quantization_config() -> dict[str, object]:
    """The `quantization_config` entry of a ternary checkpoint's config.json."""
    return {
        "quant_method": QUANT_METHOD,
        "bits": 2,
        "packing": "4 codes (w + 1) per uint8 along the input dimension, low bits first",
        "weight_scale": "per_output_row",
        "activation": "int8_per_token_absmax",
        "modules_not_converted": ["model.embed_tokens", "lm_head"],
    }


def absmean_ternary(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w in {-1, 0, 1} as float, absmean scale): weight ~ w * scale, one scale per tensor."""
    scale = weight.abs().mean().clamp(min=WEIGHT_EPS)
    return (weight / scale).round().clamp(-1, 1), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) with q = clamp(round(x * s), -128, 127) integer-valued float and s = 127 / absmax
    per token (last dimension); x ~ q / s. The CPU kernel repeats these float32 operations."""
    s = ACTIVATION_MAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=ACTIVATION_EPS)
    return (x * s).round().clamp(-128, 127), s


def pack(ternary: torch.Tensor) -> torch.Tensor:
    """[N, K] values in {-1, 0, 1} -> [N, ceil(K / 4)] uint8 codes."""
    if ternary.dim() != 2:
        raise ValueError(f"pack expects a 2-D weight, got shape {list(ternary.shape)}")
    if not torch.isin(ternary, torch.tensor([-1, 0, 1], dtype=ternary.dtype)).all():
        raise ValueError("pack expects values in {-1, 0, 1}")
    rows, cols = ternary.shape
    codes = (ternary.to(torch.int16) + 1).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, -cols % 4), value=1).view(rows, -1, 4)  # [N, B, 4]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return (codes << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, ceil(K / 4)] uint8 codes -> [N, K] int8 in {-1, 0, 1}; raises on a corrupt tensor."""
    check_packed(packed, packed.shape[0] if packed.dim() == 2 else -1, in_features)
    check_codes(packed)
    return _codes_to_ternary(packed, in_features)


def _codes_to_ternary(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """unpack without checks: no host sync, so it can run inside a captured CUDA graph."""
    codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)  # [N, B, 4]
    return codes.flatten(1)[:, :in_features].to(torch.int8) - 1


def check_packed(packed: torch.Tensor, out_features: int, in_features: int) -> None:
    """Raise TernaryFormatError unless `packed` is uint8 [out_features, ceil(in_features / 4)]."""
    expected = (out_features, -(-in_features // 4))
    if packed.dtype != torch.uint8:
        raise TernaryFormatError(f"packed ternary weight must be uint8, got {packed.dtype}")
    if tuple(packed.shape) != expected:
        raise TernaryFormatError(
            f"packed ternary weight has shape {list(packed.shape)}, expected {list(expected)} "
            f"for a {out_features}x{in_features} weight"
        )


def check_codes(packed: torch.Tensor) -> None:
    """Raise TernaryFormatError if any 2-bit field is 3 (corrupt or not a ternary tensor)."""
    for shift in (0, 2, 4, 6):
        if ((packed >> shift) & 3 == 3).any():
            raise TernaryFormatError(
                "packed ternary weight holds code 3 (only 0, 1, 2 are valid): corrupt tensor"
            )


def dequantize(packed: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float weight [N, K] = w * scale[n] that a packed projection stands for."""
    return unpack(packed, in_features).float() * scale.float()[:, None]


def reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int
) -> torch.Tensor:
    """y = (q / s) @ (w * scale)^T in float32: what the kernel computes, in plain PyTorch.
    Trusts `packed` (checked at load), so that it runs inside captured CUDA graphs."""
    q, s = quantize_activations(x.float())
    weight = _codes_to_ternary(packed, in_features).float() * scale.float()[:, None]  # [N, K]
    return torch.nn.functional.linear(q / s, weight)
