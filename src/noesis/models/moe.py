"""The routed-expert MLP block (Qwen3-MoE, Mixtral, gpt-oss): a router and stacked experts.

The experts' weights are stacked [E, out, in] with gate and up as one [gate | up] projection;
`weights/mapping.py` declares how each family's checkpoint fills them. MXFP4 checkpoints loaded
on CUDA keep them packed (`keep_mxfp4_packed`). The computation is `kernels.moe.experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from noesis.kernels import moe as moe_ops
from noesis.kernels import ops
from noesis.models.config import ModelConfig
from noesis.weights.mxfp4 import MXFP4_BLOCK, Mxfp4Fragments, Mxfp4Weight

PROJECTIONS = ("gate_up_proj", "down_proj")


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
        self.packed = False
        self.fragments: dict[str, tuple[int, int]] = {}  # name -> (rows, cols) once repacked

    def keep_mxfp4_packed(self) -> None:
        """Before loading (on the meta device): hold each projection as the checkpoint stores
        it, uint8 `{name}_blocks` [E, N, K / 32, 16] and `{name}_scales` [E, N, K / 32], in
        place of the float [E, N, K]; they load under their own names."""
        for name in PROJECTIONS:
            experts, rows, cols = getattr(self, name).shape
            delattr(self, name)
            groups = cols // MXFP4_BLOCK
            for kind, shape in (("blocks", (experts, rows, groups, 16)),
                                ("scales", (experts, rows, groups))):  # fmt: skip
                tensor = torch.empty(shape, dtype=torch.uint8, device="meta")
                self.register_parameter(f"{name}_{kind}", nn.Parameter(tensor, False))
        self.packed = True

    def use_fragments(self) -> None:
        """After loading packed (CUDA): each projection repacked as tensor-core fragments
        (kernels/mxfp4_mma.py; the same bytes, padded to whole tiles), its stored blocks and
        scales freed one projection at a time."""
        for name in PROJECTIONS:
            blocks = getattr(self, f"{name}_blocks")
            scales = getattr(self, f"{name}_scales")
            packed = Mxfp4Fragments.pack(blocks, scales, gate_up=name == "gate_up_proj")
            delattr(self, f"{name}_blocks")
            delattr(self, f"{name}_scales")
            del blocks, scales
            self.register_buffer(f"{name}_words", packed.words)
            self.register_buffer(f"{name}_fragment_scales", packed.scales)
            self.fragments[name] = (packed.rows, packed.cols)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return moe_ops.experts(
            x,
            ids,
            weights,
            self._projection("gate_up_proj"),
            self._projection("down_proj"),
            self.activation,
            self.gate_up_proj_bias,
            self.down_proj_bias,
            residual,
        )

    def _projection(self, name: str) -> torch.Tensor | Mxfp4Weight | Mxfp4Fragments:
        if self.fragments:
            return Mxfp4Fragments(getattr(self, f"{name}_words"),
                                  getattr(self, f"{name}_fragment_scales"), *self.fragments[name],
                                  gate_up=name == "gate_up_proj")  # fmt: skip
        if self.packed:
            return Mxfp4Weight(getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales"))
        return getattr(self, name)


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

    def forward_one_row(self, stream: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """stream + moe(norm(stream)) for one token: the norm and the router in one kernel,
        the routing in one, the experts in three, the last adding the residual."""
        logits, normed = ops.norm_router(stream, norm, self.router)
        weights, ids = moe_ops.route(logits, self.top_k, self.routing, self.renormalize)
        return self.experts(normed, ids, weights, residual=stream)
