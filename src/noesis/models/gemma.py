"""Gemma 2 and Gemma 3 (text): a decoder of its own, with Hugging Face names.

What sets it apart from the shared decoder: RMSNorm scaled by (1 + weight) in float32, norms
after attention and after the MLP as well as before, embeddings scaled by sqrt(hidden), GeGLU
(tanh GELU), attention scaled by query_pre_attn_scalar, alternating sliding/global layers, and
Gemma 2's soft-capping of attention scores and logits. Gemma 3 adds q/k norms and gives its
sliding layers their own rotary (the runner's cos/sin then hold both tables side by side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from noesis.models.config import ModelConfig
from noesis.models.layers import Attention


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with gate and up in one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(config)
        eps, dim = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        # Gemma 3's sliding layers rotate with the second half of the stacked tables.
        local = config.rope.local is not None and self.self_attn.sliding_window is not None
        self.rope_half = 1 if local else 0

    def forward(self, stream, cos, sin, kv_cache, meta, attention) -> torch.Tensor:
        if cos.shape[-1] != self.self_attn.head_dim:  # stacked global | local tables
            cos, sin = cos.chunk(2, dim=-1)[self.rope_half], sin.chunk(2, dim=-1)[self.rope_half]
        hidden = self.self_attn(self.input_layernorm(stream), cos, sin, kv_cache, meta, attention)
        stream = stream + self.post_attention_layernorm(hidden)
        hidden = self.mlp(self.pre_feedforward_layernorm(stream))
        return stream + self.post_feedforward_layernorm(hidden)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # The table comes from the checkpoint: `_weight` skips the random init, whose meta-device
        # normal_ imports torch._dynamo (about 1.5 s in every process that loads a model).
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaLM(nn.Module):
    """Token ids [T] -> final residual stream [T, D]; `compute_logits` projects chosen rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_softcap

    def forward(self, input_ids, cos, sin, kv_caches, meta, attention):
        """Returns (stream, None): the residual stream whole, as DecoderLM's fused path does."""
        stream = self.model.embed_tokens(input_ids)  # [T, D]
        # rounded to the weights' dtype first, as transformers does
        stream = stream * torch.tensor(self.embed_scale, dtype=stream.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            stream = layer(stream, cos, sin, kv_cache, meta, attention)
        return stream, None

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Final norm, LM head and soft-cap over the chosen rows: [B, D] -> [B, V] float32."""
        if residual is not None:
            hidden = hidden + residual
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.model.norm(hidden), weight)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
