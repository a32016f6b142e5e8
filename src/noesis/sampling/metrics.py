"""Per-token uncertainty metrics of the distribution a row samples from, computed on the device.

The distribution is softmax of the logits the sampler receives: after the grammar masks and the
penalties, before the request's temperature and truncation (top-k/top-p/min-p). So a masked
token counts as impossible, and the control plane, which moves temperature and top_p, reads a
signal that its own knobs do not move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.kernels import ops

METRICS_TOP_K = 5  # the top-k of `top_k_mass`
NUM_METRICS = 4  # columns of `token_metrics`: entropy, varentropy, top-k mass, margin


@dataclass(frozen=True, slots=True)
class TokenMetrics:
    """One sampled position. Entropies in nats; probabilities in [0, 1]."""

    entropy: float  # H = -sum p log p
    varentropy: float  # sum p (log p + H)^2: how unevenly the surprise is spread
    top_k_mass: float  # probability of the METRICS_TOP_K most likely tokens
    margin: float  # p(top-1) - p(top-2)

    @classmethod
    def from_row(cls, row: list[float]) -> TokenMetrics | None:
        """A host row of `token_metrics`, or None for a row without metrics (NaN)."""
        if row[0] != row[0]:
            return None
        return cls(*row)


def token_metrics(logits: torch.Tensor, top_k: int = METRICS_TOP_K) -> torch.Tensor:
    """logits [B, V] -> [B, NUM_METRICS] float32 on the same device: entropy, varentropy,
    top-k mass, top-1/top-2 margin. Pure tensor work, no host sync. A row with no finite logit
    (NaN, or every token masked) gives NaN. On CUDA two Triton launches that read each logit
    once, top-k included (sampling.metrics_kernel); elsewhere the PyTorch reference below."""
    if ops.use_triton(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        from noesis.sampling import metrics_kernel

        return metrics_kernel.token_metrics(logits, top_k)
    return reference_metrics(logits, top_k)


def reference_metrics(logits: torch.Tensor, top_k: int = METRICS_TOP_K) -> torch.Tensor:
    """token_metrics in PyTorch: log-softmax, then one reduction per metric."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    p = logp.exp()
    allowed = p > 0  # masked tokens: p = 0, log p = -inf; 0 * -inf must count as 0
    logp = torch.where(allowed, logp, 0.0)
    entropy = (p * logp).sum(dim=-1).neg().clamp_min(0.0) + 0.0  # [B]; + 0.0 turns -0.0 to 0
    varentropy = (p * (logp + entropy[:, None]).square()).sum(dim=-1)
    vocab = logits.shape[-1]
    top = p.topk(min(top_k, vocab), dim=-1).values  # [B, k], best first
    second = top[:, 1] if vocab > 1 else torch.zeros_like(entropy)
    stacked = torch.stack([entropy, varentropy, top.sum(dim=-1), top[:, 0] - second], dim=1)
    broken = ~torch.isfinite(logits.amax(dim=-1))  # NaN, +inf, or nothing allowed
    return torch.where(broken[:, None], float("nan"), stacked)
