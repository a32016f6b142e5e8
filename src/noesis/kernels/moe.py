"""Routed experts: which experts each token takes (`route`) and their gated MLPs (`experts`).

`experts` is the one call the models make, over stacked weights gate_up [E, 2I, H] ([gate | up]
rows) and down [E, H, I], in the model dtype or (CUDA only) MXFP4-packed. On CUDA it is the fused
Triton kernels of kernels/moe_triton.py: one launch per projection, no host sync, graph
capturable. Elsewhere the PyTorch path groups the (token, expert) pairs by expert, runs each
expert's two projections over its own rows and scatters the weighted results back: the work of
the active experts only, at the price of one host sync for the group sizes. `gathered` and
`masked` are sync-free PyTorch references (tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from noesis.weights.mxfp4 import Mxfp4Fragments, Mxfp4Weight


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation over [.., 2I] laid out [gate | up]: silu(gate) * up, or with
    `limit` gpt-oss's clamped SwiGLU (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = clamp(gate, max=limit)."""

    limit: float | None = None
    alpha: float = 1.702

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def route(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]).

    "softmax_topk": softmax over all experts in float32, the top k, renormalized to sum 1 when
    asked (Qwen3-MoE's norm_topk_prob; Mixtral always); "topk_softmax": the top k logits, then a
    softmax over them (gpt-oss). Weights come back float32 for softmax_topk (as Mixtral keeps
    them), in the logits' dtype for topk_softmax. On CUDA one fused launch
    (moe_triton.route), elsewhere `torch_route`."""
    if logits.is_cuda:
        from noesis.kernels import moe_triton

        return moe_triton.route(logits, top_k, routing, renormalize)
    return torch_route(logits, top_k, routing, renormalize)


def torch_route(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool):
    """`route` in PyTorch ops, on any device (the reference of the fused kernel)."""
    if routing == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


def experts(
    x: torch.Tensor,  # [T, H]
    ids: torch.Tensor,  # [T, k] expert of each (token, slot)
    weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor | Mxfp4Fragments,  # [E, 2I, H]
    down: torch.Tensor | Mxfp4Fragments,  # [E, H, I]
    activation: Activation,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H] in x's dtype, plus
    residual (one more rounding) when given: on CUDA added in the experts' last kernel."""
    if x.is_cuda:
        from noesis.kernels import moe_triton

        return moe_triton.experts(x, ids, weights, gate_up, down, activation.limit,
                                  activation.alpha, gate_up_bias, down_bias, residual)  # fmt: skip
    if any(isinstance(w, Mxfp4Weight | Mxfp4Fragments) for w in (gate_up, down)):
        raise ValueError(f"MXFP4-packed experts run on CUDA only, not {x.device} (other "
                         "devices dequantize them at load)")  # fmt: skip
    out = grouped(x, ids, weights, gate_up, down, activation, gate_up_bias, down_bias)
    return out if residual is None else out + residual


def grouped(x, ids, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    """Pairs sorted by expert; each active expert runs once over its tokens (one host sync)."""
    top_k = ids.shape[1]
    flat = ids.flatten()  # [P], pair p = token p // k, slot p % k
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # the host sync
    pair_weights = weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        hidden = _expert(x[tokens], expert, gate_up, down, activation, gate_up_bias, down_bias)
        out.index_add_(0, tokens, (hidden * pair_weights[pairs, None]).to(x.dtype))
    return out


def gathered(x, ids, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    """Each pair's expert weights gathered and applied batched: no sync, no data-dependent
    shapes; reads (and copies) k experts per token, so for small batches only."""
    tokens, top_k = ids.shape
    flat = ids.flatten()
    rows = x.repeat_interleave(top_k, dim=0)  # [P, H]
    hidden = torch.bmm(gate_up[flat], rows[:, :, None])[..., 0]  # [P, 2I]
    if gate_up_bias is not None:
        hidden = hidden + gate_up_bias[flat]
    hidden = torch.bmm(down[flat], activation(hidden)[:, :, None])[..., 0]  # [P, H]
    if down_bias is not None:
        hidden = hidden + down_bias[flat]
    hidden = hidden * weights.flatten()[:, None]
    return hidden.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


def masked(x, ids, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    """Every expert over every token, weighted by its routing weight (zero where not chosen):
    no sync, fixed shapes, the compute of all experts."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        weight = (weights * (ids == expert)).sum(dim=1, keepdim=True)  # [T, 1]
        hidden = _expert(x, expert, gate_up, down, activation, gate_up_bias, down_bias)
        out += (hidden * weight).to(x.dtype)
    return out


def _expert(x, expert, gate_up, down, activation, gate_up_bias, down_bias):
    up_bias = None if gate_up_bias is None else gate_up_bias[expert]
    out_bias = None if down_bias is None else down_bias[expert]
    hidden = activation(F.linear(x, gate_up[expert], up_bias))
    return F.linear(hidden, down[expert], out_bias)
