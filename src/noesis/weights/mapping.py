"""Where each model parameter comes from in a Hugging Face checkpoint: the declared exceptions.

Most parameters load under their own names. The fused projections are stacked from their parts,
unless the family's checkpoints already store them fused (Phi-3). Routed experts live in stacked
[num_experts, out, in] parameters: filled from one key per expert and part (Qwen3-MoE,
Mixtral), or from gpt-oss's stacked tensors, stored [num_experts, in, out] with gate and up
interleaved, in bf16 or as MXFP4 blocks and scales.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from noesis.models.config import CAPABILITIES, TEXT_PREFIX, ModelConfig
from noesis.quant.packing import checkpoint_shape, is_packed_layout, layout_name
from noesis.quant.scheme import LEAVES as PACKED_LEAVES
from noesis.quant.scheme import weight_quant

# fused parameter -> its parts, in row order
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
PREFUSED_FAMILIES = frozenset({"phi3"})
# stacked expert parameter -> its per-expert checkpoint parts, in row order
EXPERT_PARTS = {
    "qwen3_moe": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    "mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
}
# family -> (our name, the checkpoint's), applied in order
RENAMED = {
    "qwen3_moe": ((".mlp.router.", ".mlp.gate."),),
    "mixtral": ((".mlp.router.", ".mlp.gate."), (".mlp.", ".block_sparse_moe.")),
    "lfm2": (
        (".self_attn.o_proj.", ".self_attn.out_proj."),
        (".self_attn.q_norm.", ".self_attn.q_layernorm."),
        (".self_attn.k_norm.", ".self_attn.k_layernorm."),
        (".feed_forward.gate_proj.", ".feed_forward.w1."),
        (".feed_forward.up_proj.", ".feed_forward.w3."),
        (".feed_forward.down_proj.", ".feed_forward.w2."),
    ),
}
# Buffers some checkpoints carry that the model recomputes; never an error.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MXFP4_BLOCK = 32  # values per scale; two 4-bit values per byte


@dataclass(frozen=True)
class Source:
    key: str  # checkpoint tensor name
    rows: int | None  # rows this part fills in a fused parameter; None: the whole parameter
    offset: int = 0  # first of those rows
    expert: int | None = None  # index along dim 0 of a stacked expert parameter it fills
    # "same", "transposed" (last two dims), "mxfp4_blocks", "mxfp4_scales", or an AWQ / GPTQ
    # packed projection's (noesis.quant.packing), e.g. "awq4_qweight"
    layout: str = "same"
    interleaved: bool = False  # gpt-oss gate_up: gate and up rows alternate (dim 1)

    def shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's expected shape, given the parameter's."""
        shape = param_shape[1:] if self.expert is not None else param_shape
        if self.rows is not None:
            shape = (self.rows, *shape[1:])
        if self.layout == "transposed":
            return (*shape[:-2], shape[-1], shape[-2])
        if self.layout == "mxfp4_blocks":
            return (*shape[:-1], shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        if self.layout == "mxfp4_scales":
            return (*shape[:-1], shape[-1] // MXFP4_BLOCK)
        if is_packed_layout(self.layout):
            return checkpoint_shape(self.layout, shape)
        return shape


def sources_for(param_name: str, config: ModelConfig) -> list[Source]:
    sources = _sources(param_name, config)
    for ours, theirs in RENAMED.get(config.family, ()):
        sources = [_renamed(s, ours, theirs) for s in sources]
    prefix = TEXT_PREFIX.get(config.architecture)  # the text model inside a multimodal one
    if prefix is not None:
        sources = [replace(s, key=prefix + s.key) for s in sources]
    return sources


def _sources(param_name: str, config: ModelConfig) -> list[Source]:
    module, _, leaf = param_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj == "experts":
        return _expert_sources(module, leaf, config)
    layout = _packed_layout(leaf, config)
    if proj not in FUSED_PARTS or config.family in PREFUSED_FAMILIES:
        return [Source(param_name, None, layout=layout)]
    parts = FUSED_PARTS[proj]
    # a GPTQ g_idx table has one row per part; everything else stacks the parts' output rows
    rows = (1,) * len(parts) if leaf == "g_idx" else _part_rows(proj, config)
    offsets = [sum(rows[:i]) for i in range(len(rows))]
    return [
        Source(f"{parent}.{part}.{leaf}", n, offset, layout=layout)
        for part, n, offset in zip(parts, rows, offsets, strict=True)
    ]


def _packed_layout(leaf: str, config: ModelConfig) -> str:
    """"same", or the layout of an AWQ / GPTQ projection's tensor, converted as it loads."""
    quant = weight_quant(config) if leaf in PACKED_LEAVES else None
    return "same" if quant is None else layout_name(quant.method, quant.bits, leaf)


def _expert_sources(module: str, leaf: str, config: ModelConfig) -> list[Source]:
    moe = config.moe
    assert moe is not None  # only MoE models have an `experts` module
    if config.family in EXPERT_PARTS:  # one key per expert and part
        parts = EXPERT_PARTS[config.family][leaf]
        rows = moe.intermediate_size if len(parts) > 1 else None
        return [
            Source(f"{module}.{e}.{part}.weight", rows, i * (rows or 0), expert=e)
            for e in range(moe.num_experts)
            for i, part in enumerate(parts)
        ]
    interleaved = leaf.startswith("gate_up_proj")
    if leaf.endswith(("_bias", "_blocks", "_scales")):  # the last two: MXFP4 kept packed
        return [Source(f"{module}.{leaf}", None, interleaved=interleaved)]
    if moe.mxfp4:
        return [
            Source(f"{module}.{leaf}_{kind}", None, layout=f"mxfp4_{kind}", interleaved=interleaved)
            for kind in ("blocks", "scales")
        ]
    return [Source(f"{module}.{leaf}", None, layout="transposed", interleaved=interleaved)]


def _renamed(source: Source, ours: str, theirs: str) -> Source:
    return Source(
        source.key.replace(ours, theirs),
        source.rows,
        source.offset,
        source.expert,
        source.layout,
        source.interleaved,
    )


def _part_rows(proj: str, config: ModelConfig) -> tuple[int, ...]:
    if proj == "qkv_proj":
        return (config.q_size, config.kv_size, config.kv_size)
    return (config.intermediate_size, config.intermediate_size)


def capability_of(key: str, config: ModelConfig) -> str:
    """Which capability a checkpoint tensor serves: "text", or e.g. "vision"."""
    for capability, prefixes in CAPABILITIES.get(config.architecture, {}).items():
        if key.startswith(prefixes):
            return capability
    return "text"


def is_ignored(key: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we skip on purpose: recomputed buffers, a tied head stored anyway, and
    the weights of capabilities beyond text (never read)."""
    if key.endswith(IGNORED_SUFFIXES) or capability_of(key, config) != "text":
        return True
    head = TEXT_PREFIX.get(config.architecture, "") + "lm_head.weight"
    return config.tie_word_embeddings and key in ("lm_head.weight", head)
