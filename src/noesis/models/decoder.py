"""The shared pre-norm decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, and with routed experts
Qwen3-MoE, Mixtral, gpt-oss) with Hugging Face names.

Parameters mirror the checkpoints' names except for the fused `qkv_proj` and `gate_up_proj` and
the stacked experts; `weights/mapping.py` declares how checkpoint tensors land in them.
"""

from __future__ import annotations

import torch
from torch import nn

from noesis.kernels import ops
from noesis.models.config import ModelConfig
from noesis.models.layers import Attention, GatedMLP, RMSNorm, fusable_one_row
from noesis.models.moe import SparseMoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        moe = config.moe
        sparse = moe is not None and layer_index not in moe.dense_layers
        self.mlp = SparseMoeBlock(config) if sparse else GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, attention):
        """Pre-norm block on the residual stream; returns (block output, residual so far)."""
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, kv_cache, meta, attention)
        normed, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(normed), residual

    def forward_one_row(self, stream, cos, sin, kv_cache, meta, attention):
        """The same block for one token, on the whole residual stream in and out: four fused
        Triton projections and the attention (two launches at batch 1), six launches where
        forward makes ten and cuBLAS's split-K reductions."""
        stream = self.self_attn.forward_one_row(stream, self.input_layernorm, cos, sin,
                                                kv_cache, meta, attention)
        return self.mlp.forward_one_row(stream, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # The table comes from the checkpoint: `_weight` skips the random init, whose meta-device
        # normal_ imports torch._dynamo (about 1.5 s in every process that loads a model).
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """Token ids [T] -> final hidden states [T, D]; `compute_logits` projects chosen rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        if _is_ternary(config):  # packed 2-bit projections (noesis.ternary)
            from noesis.ternary.linear import use_ternary_projections

            use_ternary_projections(self, config)
        # Whether one-row steps take DecoderLayer.forward_one_row: decided at the first one,
        # once the weights are in (GGUF projections are packed after construction, a GPTQ
        # table's act-order is read at load); False set here or by a wrapper keeps them off.
        self.fuse_one_row: bool | None = None

    def forward(self, input_ids, cos, sin, kv_caches, meta, attention):
        """Returns (hidden, residual) [T, D]; their sum is the final residual stream (residual
        is None when hidden is that stream, as the fused one-row path returns it)."""
        hidden = self.model.embed_tokens(input_ids)  # [T, D]
        residual = None
        if self._one_row(hidden):  # batch-1 decode on CUDA
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                hidden = layer.forward_one_row(hidden, cos, sin, kv_cache, meta, attention)
            return hidden, residual
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, attention)
        return hidden, residual

    def _one_row(self, hidden: torch.Tensor) -> bool:
        """Whether this step runs the fused one-row blocks (see fuse_one_row)."""
        if not ops.one_row_fusion(hidden):
            return False
        if self.fuse_one_row is None:
            self.fuse_one_row = fusable_one_row(self.config, self)
        return self.fuse_one_row

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the chosen rows only: [B, D] -> [B, V] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        norm = self.model.norm
        if residual is None and self._one_row(hidden):
            return ops.norm_logits(hidden, norm.weight, norm.eps, weight)
        hidden, _ = norm.add_forward(hidden, residual)
        return torch.nn.functional.linear(hidden, weight).float()


def _is_ternary(config: ModelConfig) -> bool:
    quantization = config.raw.get("quantization_config") or {}
    return quantization.get("quant_method") == "ternary"
