"""Where each model parameter comes from in a Hugging Face checkpoint: the declared exceptions.

Most parameters load under their own names. The fused projections are stacked from their parts,
unless the family's checkpoints already store them fused (Phi-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from noesis.models.config import ModelConfig

# fused parameter -> its parts, in row order
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
PREFUSED_FAMILIES = frozenset({"phi3"})
# Buffers some checkpoints carry that the model recomputes; never an error.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Source:
    key: str  # checkpoint tensor name
    rows: int | None  # rows this part fills in a fused parameter; None: the whole parameter


def sources_for(param_name: str, config: ModelConfig) -> list[Source]:
    module, _, leaf = param_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj not in FUSED_PARTS or config.family in PREFUSED_FAMILIES:
        return [Source(param_name, None)]
    parts = FUSED_PARTS[proj]
    rows = _part_rows(proj, config)
    return [Source(f"{parent}.{part}.{leaf}", n) for part, n in zip(parts, rows, strict=True)]


def _part_rows(proj: str, config: ModelConfig) -> tuple[int, ...]:
    if proj == "qkv_proj":
        return (config.q_size, config.kv_size, config.kv_size)
    return (config.intermediate_size, config.intermediate_size)


def is_ignored(key: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we skip on purpose: recomputed buffers, a tied head stored anyway."""
    if key.endswith(IGNORED_SUFFIXES):
        return True
    return config.tie_word_embeddings and key == "lm_head.weight"
