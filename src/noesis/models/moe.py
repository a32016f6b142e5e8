"""The routed-expert MLP block (Qwen3-MoE, Mixtral, gpt-oss): a router and stacked experts.

The experts' weights are stacked [E, out, in] with gate and up as one [gate | up] projection;
`weights/mapping.py` declares how each family's checkpoint fills them. The computation is
`kernels.moe.experts`, which backends may replace.
"""

from __future__ import annotations

import torch
from torch import nn

from noesis.kernels import moe as moe_ops
from noesis.models.config import ModelConfig


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        experts, hidden, inner = moe.num_experts, config.hidden_size, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inner))
            self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.activation = moe_ops.Activation(moe.swiglu_limit, moe.swiglu_alpha)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_ops.experts(
            x,
            ids,
            weights,
            self.gate_up_proj,
            self.down_proj,
            self.activation,
            self.gate_up_proj_bias,
            self.down_proj_bias,
        )


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum of each token's top-k experts, weighted by the router."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.routing, self.renormalize = moe.top_k, moe.routing, moe.renormalize
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        weights, ids = moe_ops.route(logits, self.top_k, self.routing, self.renormalize)
        return self.experts(x, ids, weights)
