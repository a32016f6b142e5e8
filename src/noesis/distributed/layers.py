"""One rank's share of a decoder: its heads, its MLP columns and its vocabulary rows.

The shared decoder is built from a shard config (heads, KV heads and the MLP width divided by
the ranks), so attention, the KV pool and the fused q/k/v and gate/up projections are the
single-process code on fewer columns. Three kinds of module are swapped in after: o_proj and
down_proj become row-parallel (partial sums, one all-reduce each: two per layer), and the
embedding and LM head hold a slice of the vocabulary (the embedding all-reduces its rows, the
head's logits are gathered on rank 0, where the sampler runs).

KV heads split like the query heads when there are at least as many as ranks; with fewer, each
rank keeps the one KV head its query heads read (replicated on size / num_kv_heads ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from noesis.errors import ConfigError
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM

# The shared decoder's dense families with q/k/v and gate/up stored apart in the checkpoint.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Shard:
    """Which part of a model one rank holds. `config` is the whole model's."""

    config: ModelConfig
    rank: int
    size: int

    @property
    def local(self) -> ModelConfig:
        """The config the rank's decoder is built from."""
        c = self.config
        return replace(c, num_heads=c.num_heads // self.size,
                       num_kv_heads=max(1, c.num_kv_heads // self.size),
                       intermediate_size=c.intermediate_size // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank keeps (its query heads' group when replicated)."""
        return self.rank * self.config.num_kv_heads // self.size

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
    if config.family not in FAMILIES or config.moe is not None or quant is not None:
        kind = f"quantized ({quant})" if quant else f"family {config.family!r}"
        raise ConfigError(f"tensor parallelism does not support {kind} models yet; supported "
                          f"families: {', '.join(FAMILIES)}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size or config.intermediate_size % size:
        raise ConfigError(
            f"tensor_parallel_size {size} must divide the attention heads ({heads}) and the MLP "
            f"width ({config.intermediate_size})")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(f"tensor_parallel_size {size} and the KV heads ({kv_heads}) must "
                          "divide one another")


class ParallelDecoderLM(DecoderLM):
    """DecoderLM on one rank's shard; `compute_logits` gives rank 0 the whole vocabulary."""

    def __init__(self, shard: Shard, group) -> None:
        super().__init__(shard.local)
        self.group = group
        self.model.embed_tokens = VocabParallelEmbedding(shard, group)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(self.config.hidden_size, shard.vocab_rows, bias=False)
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear.like(layer.self_attn.o_proj, group)
            layer.mlp.down_proj = RowParallelLinear.like(layer.mlp.down_proj, group)
        self.fuse_one_row = False  # its kernels add the residual inside the unreduced projection

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: logits [B, V] float32 of the whole vocabulary; the other ranks: None."""
        local = super().compute_logits(hidden, residual)  # [B, V / size]
        logits = self.group.gather_last(local)  # rank 0: [B, size * V / size]
        return logits[:, : self.config.vocab_size] if logits is not None else None


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
