"""Blocks shared by the decoder families: RMSNorm, fused-projection attention, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from noesis.kernels import ops
from noesis.models.config import ModelConfig
from noesis.quant.linear import PackedLinear, projection


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention with q/k/v in one projection; the KV cache and kernel come from outside.
    Optional: attention sinks (gpt-oss) and soft-capped scores (Gemma 2)."""

    def __init__(self, config: ModelConfig, layer_index: int = 0, norm=None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.sliding_window = config.window(layer_index)
        self.softcap = config.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        self.qkv_proj = projection(
            config, config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, parts=3
        )
        self.o_proj = projection(config, self.q_size, config.hidden_size, config.o_bias)
        if config.qk_norm:
            norm = norm or RMSNorm
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, kv_cache, meta, attention) -> torch.Tensor:
        q, k, v = self._split_heads(self.qkv_proj(x))
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = attention.rope_and_store(q, k, v, cos, sin, kv_cache, meta)
        out = attention.attend(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                               **self._extras())
        return ops.row_projection(out.reshape(x.shape[0], self.q_size), self.o_proj)

    def forward_one_row(self, stream, norm: RMSNorm, cos, sin, kv_cache, meta, attention):
        """stream + attention(norm(stream)) for one token: norm, qkv (its bias), RoPE and the
        cache write in one kernel (with per-head q/k norms, two: the projection, then the RoPE
        kernel normalizes the heads), the output projection (its bias) and the residual add in
        another."""
        qk_norm = None
        if self.q_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        qkv = ops.norm_qkv_rope_store(
            stream, norm.weight, norm.eps, self.qkv_proj, self.num_heads,
            self.num_kv_heads, cos, sin, meta.slot_mapping, kv_cache, qk_norm,
        )
        q, k, v = self._split_heads(qkv)
        out = attention.attend(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                               **self._extras())
        return ops.gemv(out.reshape(1, self.q_size), self.o_proj, residual=stream)

    def _extras(self) -> dict:
        """The backend's optional arguments, passed only when set."""
        extras = {}
        if self.sinks is not None:
            extras["sinks"] = self.sinks
        if self.softcap is not None:
            extras["softcap"] = self.softcap
        return extras

    def _split_heads(self, qkv: torch.Tensor):
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim),
                k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up in one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = projection(
            config, config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, parts=2
        )
        self.down_proj = projection(
            config, config.intermediate_size, config.hidden_size, config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))

    def forward_one_row(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """stream + mlp(norm(stream)) for one token: norm, gate/up and SiLU-multiply in one
        kernel, down and the residual add in another."""
        act = ops.norm_glu(stream, norm.weight, norm.eps, self.gate_up_proj)
        return ops.gemv(act, self.down_proj, residual=stream)


# The fused one-row block over packed int4 / int8 weights (noesis.quant.packed_row) is correct but
# slower than the unfused packed GEMVs: H100, 8B AWQ int4 g128, batch 1, 2026-11-28: 230-299 tok/s
# fused against 303-308 unfused, its own tuned configs included (benchmarks/RESULTS.md). Off
# until it wins; tests and benchmarks/gpu_quant.py turn it on.
PACKED_ONE_ROW = False


def fusable_one_row(config: ModelConfig, model: nn.Module) -> bool:
    """Whether the decoder's blocks can take the fused one-row path: projections the one-row
    kernels read (plain linear, with or without bias, or, with PACKED_ONE_ROW, bias-free packed
    int4 / int8 in whole-tile groups), dense or routed-expert MLPs, attention with or without
    sinks but not soft-capped, rotary over the whole head, q/k norms (RMSNorm, with row_gemv's
    plain projections: the RoPE kernel normalizes the heads). Asked once the weights are in (a
    GPTQ projection's act-order is read from its loaded table)."""
    if config.attn_softcap is not None:
        return False
    modules = dict(model.named_modules())
    linears = [m for name, m in modules.items()
               if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "router"))]
    rotary = config.rope.rotary_dim or config.head_dim
    if config.qk_norm:  # the RoPE kernel normalizes the heads the plain projection made
        norms_and_qkv = [m for name, m in modules.items()
                         if name.endswith(("q_norm", "k_norm", "qkv_proj"))]
        if any(type(m) not in (RMSNorm, nn.Linear) for m in norms_and_qkv):
            return False
    return (all(_one_row_projection(m) for m in linears)
            and rotary == config.head_dim and config.head_dim % 2 == 0)


def _one_row_projection(proj: nn.Module) -> bool:
    if type(proj) is nn.Linear:
        return True
    return (PACKED_ONE_ROW and type(proj) is PackedLinear and proj.bias is None
            and proj.fragments is None and proj.whole_tile_groups())
