"""Memory a model needs, counted from shapes before anything is allocated, against what the device
can still give: an absurd config.json is a clear error, not an allocation that fails or swaps."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from noesis.errors import ConfigError
from noesis.models.config import ModelConfig

# Parameter-name fragment -> (the part of the model, the config.json fields that size it).
PARTS = (
    ("embed_tokens", "the token embedding", ("vocab_size", "hidden_size")),
    ("lm_head", "the LM head", ("vocab_size", "hidden_size")),
    (".mlp.", "the MLP weights", ("num_hidden_layers", "intermediate_size", "hidden_size")),
    (
        ".self_attn.",
        "the attention weights",
        ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"),
    ),
)
OTHER_PART = ("the norms", ("num_hidden_layers", "hidden_size"))
# config.json field -> ModelConfig attribute
FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
}


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one part of a model needs, and what sets them (config fields and their values)."""

    part: str
    sized_by: str
    num_bytes: int


def weight_needs(model: nn.Module, config: ModelConfig, dtype: torch.dtype) -> list[MemoryNeed]:
    """Parameter bytes, by part, of `model` (built on the meta device) once cast to `dtype`;
    integer parameters (packed ternary codes) keep their own element size."""
    sizes: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    for name, param in model.named_parameters():
        elem = dtype.itemsize if param.is_floating_point() else param.element_size()
        sizes[_part(name)] += param.numel() * elem
    return [
        MemoryNeed(part, ", ".join(f"{f}={getattr(config, FIELDS[f]):,}" for f in fields), size)
        for (part, fields), size in sizes.items()
    ]


def check_fits(needs: list[MemoryNeed], device: torch.device, what: str, hint: str) -> None:
    """ConfigError naming the largest part if `needs` add up to more than `device` has free."""
    available = available_bytes(device)
    total = sum(need.num_bytes for need in needs)
    if available is None or total <= available:
        return
    largest = max(needs, key=lambda need: need.num_bytes)
    detail = (
        f"sized by {largest.sized_by}"
        if len(needs) == 1
        else f"the largest part is {largest.part} ({largest.sized_by}): {_gib(largest.num_bytes)}"
    )
    raise ConfigError(
        f"{what} would need {_gib(total)} but {device} has {_gib(available)} available; "
        f"{detail}. {hint}"
    )


def available_bytes(device: torch.device) -> int | None:
    """Bytes `device` can still allocate; None where that cannot be told (MPS, meta)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type == "cpu":
        return _host_available()
    return None


def _part(name: str) -> tuple[str, tuple[str, ...]]:
    for fragment, part, fields in PARTS:
        if fragment in name:
            return part, fields
    return OTHER_PART


def _host_available() -> int:
    """MemAvailable (free plus reclaimable cache), within the cgroup's limit when it has one."""
    available = _meminfo_available()
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def _meminfo_available() -> int | None:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file counts in kB
    return None


def _cgroup_headroom() -> int | None:
    """cgroup v2: memory.max minus memory.current; None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):,.1f} GiB"
