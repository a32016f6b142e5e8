"""What `noesis info` says about an AWQ / GPTQ checkpoint: weights counted as values, and their
bytes in memory packed against what the same weights take as floats."""

from __future__ import annotations

import math

import torch

from noesis.models.config import ModelConfig
from noesis.quant.scheme import LEAVES, WeightQuant, weight_quant


def values_held(key: str, count: int, quant: WeightQuant | None) -> int:
    """Weight values in a checkpoint tensor of `count` elements: an int32 word of codes holds
    `pack` of them; scales, zero points and g_idx hold none."""
    if quant is None:
        return count
    leaf = key.rpartition(".")[2]
    if leaf == "qweight":
        return count * quant.pack
    return 0 if leaf in LEAVES else count


def packed_weight_lines(index: dict, config: ModelConfig, dtype: torch.dtype) -> dict[str, str]:
    """{"quantization", "weights in memory", "weights as float"} for an AWQ / GPTQ checkpoint
    (text tensors of `index`, name -> (file, shape)); {} for any other."""
    from noesis.weights.mapping import capability_of, is_ignored

    quant = weight_quant(config)
    if quant is None:
        return {}
    packed = floats = 0
    for key, (_, shape) in index.items():
        if capability_of(key, config) != "text" or is_ignored(key, config):
            continue
        in_memory, as_float = _bytes(key.rpartition(".")[2], math.prod(shape), quant, dtype)
        packed, floats = packed + in_memory, floats + as_float
    share = packed / floats if floats else 0.0
    return {
        "quantization": f"{quant.describe()} (packed projections; the rest in {_name(dtype)})",
        "weights in memory": f"{_size(packed)} packed ({share:.0%} of the float size)",
        "weights as float": f"{_size(floats)} in {_name(dtype)}",
    }


def _bytes(leaf: str, count: int, quant: WeightQuant, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes in PackedLinear's layout, bytes of the same weights as floats) of one tensor."""
    elem = dtype.itemsize
    if leaf == "qweight":
        return count * 4, count * quant.pack * elem
    if leaf == "qzeros":  # unpacked to floats in memory
        return count * quant.pack * elem, 0
    if leaf == "scales":
        return count * elem, 0
    if leaf == "g_idx":
        return count * 4, 0
    return count * elem, count * elem


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _size(num_bytes: int) -> str:
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / (1 << 30):.2f} GiB"
