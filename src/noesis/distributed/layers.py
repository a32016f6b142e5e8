"""One rank's share of a model: its heads, its MLP (or experts', or conv) columns and its
vocabulary rows.

Each family's model is built from a shard config (heads, KV heads, the MLP and expert widths
divided by the ranks), so attention, the KV pool, the fused q/k/v and gate/up projections and
the experts are the single-process code on fewer columns. Modules swapped in after: o_proj and
down_proj become row-parallel (partial sums, one all-reduce each: two per layer), a routed-expert
block all-reduces its sum once (each expert's gate_up split by columns, its down by rows, the
router whole), an LFM2 short convolution keeps its channels' share, and the embedding and LM
head hold a slice of the vocabulary (the embedding all-reduces its rows, the head's logits are
gathered on rank 0, where the sampler runs). Biases after an all-reduce are added once.

KV heads split like the query heads when there are at least as many as ranks; with fewer, each
rank keeps the one KV head its query heads read (replicated on size / num_kv_heads ranks).
Per-head parameters shard with their heads (gpt-oss's sinks); q/k norms over head_dim, shared by
every head, are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from noesis.errors import ConfigError
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM
from noesis.models.gemma import GemmaLM
from noesis.models.lfm2 import Lfm2LM, ShortConv
from noesis.models.moe import SparseMoeBlock

DENSE = ("llama", "mistral", "qwen2", "qwen3", "phi3")
FAMILIES = (*DENSE, "gemma2", "gemma3", "qwen3_moe", "mixtral", "gpt_oss", "lfm2")


@dataclass(frozen=True)
class Shard:
    """Which part of a model one rank holds. `config` is the whole model's."""

    config: ModelConfig
    rank: int
    size: int

    @property
    def local(self) -> ModelConfig:
        """The config the rank's model is built from (hidden_size stays whole: the residual
        stream is replicated)."""
        c = self.config
        moe = c.moe and replace(c.moe, intermediate_size=c.moe.intermediate_size // self.size)
        return replace(c, num_heads=c.num_heads // self.size,
                       num_kv_heads=max(1, c.num_kv_heads // self.size),
                       intermediate_size=c.intermediate_size // self.size, moe=moe)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank keeps (its query heads' group when replicated)."""
        return self.rank * self.config.num_kv_heads // self.size

    @property
    def conv_channels(self) -> int:
        """LFM2: the short convolutions' channels per rank."""
        return self.config.hidden_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and head per rank; the last rank's tail past the vocabulary
        is zero padding."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_shardable(config: ModelConfig, size: int) -> None:
    """ConfigError unless `config` splits evenly over `size` ranks."""
    quant = (config.raw.get("quantization_config") or {}).get("quant_method")
    if config.family not in FAMILIES:
        raise ConfigError(f"tensor parallelism does not support family {config.family!r}; "
                          f"supported families: {', '.join(FAMILIES)}")
    if config.moe is not None and config.moe.mxfp4:
        raise ConfigError("tensor parallelism does not support MXFP4 expert weights yet: their "
                          "blocks are not sliced; use a bf16 checkpoint")
    if quant is not None:
        raise ConfigError(f"tensor parallelism does not support quantized ({quant}) checkpoints "
                          "yet: their packed weights are not sliced; use the bf16 or fp16 one")
    _check_divides(size, {"attention heads": config.num_heads,
                          "MLP width": config.intermediate_size})
    if config.moe is not None:
        _check_divides(size, {"expert width": config.moe.intermediate_size})
    if config.conv_layers:
        _check_divides(size, {"short-convolution channels": config.hidden_size})
    kv_heads = config.num_kv_heads
    if kv_heads % size and size % kv_heads:
        raise ConfigError(f"tensor_parallel_size {size} and the KV heads ({kv_heads}) must "
                          "divide one another")


def _check_divides(size: int, widths: dict[str, int]) -> None:
    uneven = [f"the {what} ({n})" for what, n in widths.items() if n % size]
    if uneven:
        raise ConfigError(f"tensor_parallel_size {size} must divide {' and '.join(uneven)}")


def parallel_model(shard: Shard, group) -> nn.Module:
    """The rank's model for its family (build it on the meta device, then load its slices)."""
    family = shard.config.family
    if family in ("gemma2", "gemma3"):
        return ParallelGemmaLM(shard, group)
    if family == "lfm2":
        return ParallelLfm2LM(shard, group)
    return ParallelDecoderLM(shard, group)


class ParallelDecoderLM(DecoderLM):
    """DecoderLM on one rank's shard (dense or routed experts); `compute_logits` gives rank 0
    the whole vocabulary."""

    def __init__(self, shard: Shard, group) -> None:
        super().__init__(shard.local)
        self.group = group
        split_modules(self, shard, group)
        self.fuse_one_row = False  # its kernels add the residual inside the unreduced projection

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: logits [B, V] float32 of the whole vocabulary; the other ranks: None."""
        return gather_logits(self, super().compute_logits(hidden, residual))


class ParallelGemmaLM(GemmaLM):
    """GemmaLM on one rank's shard (the logit soft-cap is elementwise: applied per slice)."""

    def __init__(self, shard: Shard, group) -> None:
        super().__init__(shard.local)
        self.group = group
        split_modules(self, shard, group)

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        return gather_logits(self, super().compute_logits(hidden, residual))


class ParallelLfm2LM(Lfm2LM):
    """Lfm2LM on one rank's shard: attention and MLP as the decoder's, each short convolution
    on this rank's channels."""

    def __init__(self, shard: Shard, group) -> None:
        super().__init__(shard.local)
        self.group = group
        split_modules(self, shard, group)
        for layer in self.model.layers:
            if layer.is_conv:
                layer.conv = ParallelShortConv(shard, group)

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        return gather_logits(self, super().compute_logits(hidden, residual))


def split_modules(model: nn.Module, shard: Shard, group) -> None:
    """Swap in the vocabulary slices, the row-parallel projections and the all-reducing expert
    blocks (the rest of `model`, built from the shard config, is already the rank's share)."""
    model.model.embed_tokens = VocabParallelEmbedding(shard, group)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(shard.config.hidden_size, shard.vocab_rows, bias=False)
    for layer in model.model.layers:
        attention = getattr(layer, "self_attn", None)  # LFM2's conv layers have none
        if attention is not None:
            attention.o_proj = RowParallelLinear.like(attention.o_proj, group)
        name = "feed_forward" if isinstance(model, Lfm2LM) else "mlp"
        mlp = getattr(layer, name)
        if isinstance(mlp, SparseMoeBlock):
            setattr(layer, name, ParallelMoeBlock(shard.local, group))
        else:
            mlp.down_proj = RowParallelLinear.like(mlp.down_proj, group)


def gather_logits(model: nn.Module, local: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: the ranks' logit slices [B, V / size] side by side, cut to [B, V]; others: None."""
    logits = model.group.gather_last(local)  # rank 0: [B, size * V / size]
    return logits[:, : model.config.vocab_size] if logits is not None else None


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice; other ids look up zeros, and the
    all-reduce fills each row from the rank that holds it."""

    def __init__(self, shard: Shard, group) -> None:
        super().__init__()
        self.group = group
        self.start, self.rows = shard.vocab_start, shard.vocab_rows
        self.weight = nn.Parameter(torch.empty(self.rows, shard.config.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, D]
        return self.group.all_reduce(hidden.masked_fill_(outside[:, None], 0))


class RowParallelLinear(nn.Linear):
    """A projection over this rank's input columns: partial sums, all-reduced, then the bias
    (whole on every rank, added once)."""

    group = None

    @classmethod
    def like(cls, linear: nn.Linear, group) -> RowParallelLinear:
        row = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        row.group = group
        return row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class ParallelMoeBlock(SparseMoeBlock):
    """The routed experts on this rank's columns of every expert: the router (whole) picks the
    same experts on every rank, each rank sums its partial outputs, one all-reduce adds them.
    The experts' down biases are loaded on rank 0 only (zeros elsewhere): added once."""

    def __init__(self, config: ModelConfig, group) -> None:
        super().__init__(config)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class ParallelShortConv(ShortConv):
    """LFM2's gated short convolution on this rank's channels: B, C and x are per channel, so
    in_proj splits by output rows, the depthwise kernel by channel and out_proj by input
    columns (row-parallel). The conv state pool is sized for every channel (the KV pool is
    built from the shard config, whose hidden size is whole); each rank uses its channels."""

    def __init__(self, shard: Shard, group) -> None:
        config, channels = shard.config, shard.conv_channels
        super().__init__(replace(config, hidden_size=channels))
        dim, bias = config.hidden_size, config.conv_bias
        self.in_proj = nn.Linear(dim, 3 * channels, bias=bias)
        self.out_proj = RowParallelLinear.like(nn.Linear(channels, dim, bias=bias), group)
        self.channel_start = shard.rank * channels

    def forward(self, x, state, meta):
        channels = self.conv.weight.shape[0]
        mine = replace(state, inputs=state.inputs.narrow(-1, self.channel_start, channels))
        return super().forward(x, mine, meta)
