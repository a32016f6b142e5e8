"""BERT encoders (BertModel) with Hugging Face names: token ids -> contextual hidden states.

A post-LN encoder: word + position + token-type embeddings and a LayerNorm, then blocks of
bidirectional self-attention and a GELU MLP, each followed by residual add and LayerNorm. What
sentence-embedding checkpoints need; BERT's own pooler (a tanh over [CLS]) is not built, since
sentence embeddings pool the hidden states instead (noesis.sidecars.embedder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from noesis.errors import InvalidModelConfig, UnsupportedModel

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> BertConfig:
        """config.json -> BertConfig; anything but an absolute-position BERT is refused."""
        if raw.get("model_type") != "bert":
            raise UnsupportedModel(f"the embedding model must be a BERT checkpoint (model_type "
                                   f"'bert'), got {raw.get('model_type')!r}")
        position = raw.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise UnsupportedModel(f"BERT with {position!r} position embeddings is not supported")
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act {act!r}; supported: {sorted(ACTIVATIONS)}")
        config = cls(
            _count(raw, "vocab_size"), _count(raw, "hidden_size"),
            _count(raw, "num_hidden_layers"), _count(raw, "num_attention_heads"),
            _count(raw, "intermediate_size"), _count(raw, "max_position_embeddings"),
            _count(raw, "type_vocab_size", 2), float(raw.get("layer_norm_eps", 1e-12)), act,
        )  # fmt: skip
        if config.hidden_size % config.num_heads:
            raise InvalidModelConfig("num_attention_heads", f"{config.num_heads} heads do not "
                                     f"divide hidden_size {config.hidden_size}")
        return config


def _count(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 22:
        raise InvalidModelConfig(name, f"must be an integer in [1, 2^22], got {value!r}")
    return value


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] -> [B, L, D]; every token is of type 0 (single sentences)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, L, D], key_mask [B, L] (True: a real token) -> [B, L, D]."""
        batch, length, dim = x.shape
        q, k, v = (proj(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))  # [B, H, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return out.transpose(1, 2).reshape(batch, length, dim)


class BertSelfOutput(nn.Module):
    """dense, then LayerNorm of the residual sum (post-LN); also BertOutput's shape."""

    def __init__(self, in_size: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    """input_ids [B, L] and key_mask [B, L] -> last hidden states [B, L, D]."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, key_mask)
        return hidden
