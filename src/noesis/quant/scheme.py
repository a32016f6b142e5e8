"""Which weight-only quantization a checkpoint declares (AWQ or GPTQ), read from config.json's
quantization_config and checked against what noesis runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from noesis.errors import UnsupportedModel
from noesis.models.config import ModelConfig

METHODS = ("awq", "gptq")
# The dense decoder families: every attention and MLP projection is a Attention / GatedMLP one.
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})
BITS = {"awq": (4,), "gptq": (4, 8)}
LEAVES = ("qweight", "qzeros", "scales", "g_idx")  # checkpoint tensors of a packed projection


@dataclass(frozen=True)
class WeightQuant:
    """One packed projection format: the checkpoint layout, the bits per weight and the number
    of input columns sharing a scale and a zero point (-1: all of them, one per output row)."""

    method: str  # "awq" or "gptq"
    bits: int  # 4 or 8
    group_size: int

    @property
    def pack(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    def group_of(self, in_features: int) -> int:
        """Input columns per group for a projection of `in_features` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method.upper()} int{self.bits}, {group}"


def weight_quant(config: ModelConfig) -> WeightQuant | None:
    """The checkpoint's AWQ / GPTQ scheme, None for a float checkpoint (or another method, such
    as ternary or MXFP4, handled elsewhere); UnsupportedModel naming what noesis cannot run."""
    quant = config.raw.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method not in METHODS:
        return None
    if config.family not in FAMILIES:
        raise UnsupportedModel(
            f"{method} checkpoints of family {config.family!r} are not supported "
            f"(supported: {sorted(FAMILIES)})"
        )
    bits = quant.get("bits", quant.get("w_bit"))
    if bits not in BITS[method]:
        raise UnsupportedModel(f"{method} with bits={bits!r} (supported: {BITS[method]})")
    group_size = quant.get("group_size", quant.get("q_group_size"))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
        group_size > 0 or group_size == -1 and method == "gptq"
    ):
        raise UnsupportedModel(f"{method} with group_size={group_size!r}")
    _check_method_fields(method, quant)
    return WeightQuant(method, bits, group_size)


def _check_method_fields(method: str, quant: dict[str, Any]) -> None:
    """AWQ's "gemm" layout with zero points; GPTQ's v1 layout (zero points stored minus one)."""
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModel(f"awq version {version!r} (supported: 'gemm')")
        if quant.get("zero_point", True) is not True:
            raise UnsupportedModel("awq without zero points (zero_point=false) is not supported")
        return
    layout = quant.get("checkpoint_format", "gptq")
    if layout != "gptq":
        raise UnsupportedModel(f"gptq checkpoint_format {layout!r} (supported: 'gptq')")


def awq_config(group_size: int) -> dict[str, Any]:
    """The quantization_config of an int4 checkpoint written in AWQ's gemm layout."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
            "zero_point": True}


def gptq_config(bits: int, group_size: int) -> dict[str, Any]:
    """The quantization_config of a symmetric GPTQ checkpoint without act-order."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq"}
