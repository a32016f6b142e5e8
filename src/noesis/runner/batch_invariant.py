"""Batch-invariant mode (EngineConfig(batch_invariant=True)): a token's logits, and so a request's
tokens, do not depend on what else shares its steps, how its prompt was chunked, or whether it
was preempted and recomputed.

Two ways, by device. On CUDA the model runs on kernels whose reduction order depends on shapes
the batch does not change (noesis.kernels.batch_invariant): every projection and the LM head
through a matmul with one tiling (K split included) per weight, attention for prefill and
decode rows alike through one paged kernel that walks each token's keys in fixed blocks, RMSNorm
one row per program; the fused one-row decode path (a different reduction) is off. Elsewhere
(CPU, MPS), where library kernels choose their blocking and vector tails by the whole tensor's
size, the runner computes one token at a time: every row of a step is a one-token forward over
its own cache, and every sampled row is sampled alone.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from noesis.errors import ConfigError
from noesis.kernels import ops
from noesis.models.decoder import DecoderLM
from noesis.runner.attention import TorchPagedAttention
from noesis.runner.inputs import AttentionMetadata
from noesis.sampling.sampler import SamplerOutput, sample

if TYPE_CHECKING:
    from noesis.planner.scheduler import StepPlan
    from noesis.planner.sequence import Sequence
    from noesis.runner.runner import LaunchedStep, ModelRunner


def enable(runner: ModelRunner, kernels: bool | None = None) -> None:
    """Put `runner` in batch-invariant mode, before any graph is captured. kernels: run the
    batch-invariant Triton kernels (default: on CUDA with Triton), else one token at a time."""
    config = runner.model.config
    if config.conv_layers:
        raise ConfigError("batch_invariant does not support short-convolution layers (LFM2): "
                          "their per-sequence state is stepped a whole chunk at a time")
    if kernels is None:
        kernels = ops.use_triton(torch.empty(0, device=runner.device))
    if not kernels:
        runner.row_by_row = True
        return
    _check_kernel_support(runner.model)
    for module in list(runner.model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, BatchInvariantLinear.wrap(child))
    runner.model.fuse_one_row = False  # its fused one-row kernels reduce differently
    runner.model.compute_logits = partial(compute_logits, runner.model)
    runner.attention = BatchInvariantAttention()


def _check_kernel_support(model: nn.Module) -> None:
    """The kernel path covers the dense decoder (DecoderLM) with plain linear projections."""
    config = model.config
    reasons = []
    if type(model) is not DecoderLM:
        reasons.append(f"{type(model).__name__} computes its logits its own way")
    if config.moe is not None:
        reasons.append("routed experts run grouped kernels sized by the batch")
    if any(name.endswith("_proj") and type(m) is not nn.Linear
           for name, m in model.named_modules() if not list(m.children())):
        reasons.append("its projections are not plain linear layers (ternary?)")
    if reasons:
        raise ConfigError(f"batch_invariant on CUDA does not support {config.architecture}: "
                          f"{'; '.join(reasons)}")


class BatchInvariantLinear(nn.Linear):
    """nn.Linear through the batch-invariant matmul; shares the wrapped layer's parameters."""

    @classmethod
    def wrap(cls, linear: nn.Linear) -> BatchInvariantLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from noesis.kernels import batch_invariant as kernels

        flat = x.reshape(-1, self.in_features)
        out = kernels.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def compute_logits(model: DecoderLM, hidden: torch.Tensor, residual: torch.Tensor | None):
    """DecoderLM.compute_logits with the LM head through the batch-invariant matmul."""
    from noesis.kernels import batch_invariant as kernels

    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    hidden, _ = model.model.norm.add_forward(hidden, residual)
    return kernels.linear(hidden, weight).float()


class BatchInvariantAttention(TorchPagedAttention):
    """Every query row, prefill or decode, through one paged kernel over its own keys."""

    name = "batch-invariant"

    def __init__(self) -> None:
        self._layout_of: tuple[AttentionMetadata, tuple] | None = None

    def rope_and_store(self, q, k, v, cos, sin, kv_cache, meta: AttentionMetadata):
        if not ops.use_triton(q):
            return super().rope_and_store(q, k, v, cos, sin, kv_cache, meta)
        from noesis.kernels import rope

        rope.rope_write_kv(q, k, v, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1])
        return q, k

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, sinks=None, softcap=None) -> torch.Tensor:
        from noesis.kernels import batch_invariant as kernels

        row_seq, tables, row_ctx = self._layout(meta, q.shape[0])
        return kernels.paged_attention(q, kv_cache[0], kv_cache[1], row_seq, tables, row_ctx,
                                       scale, sliding_window, sinks, softcap)

    def _layout(self, meta: AttentionMetadata, rows: int):
        """(row -> table index [R], page tables [S, P], keys seen per row [R]), built once
        per step (every layer shares the step's metadata) and on the device, without a sync."""
        if self._layout_of is not None and self._layout_of[0] is meta:
            return self._layout_of[1]
        device = meta.slot_mapping.device
        if not meta.prefills:  # decodes only (graphs): row i is decode i
            layout = (torch.arange(rows, device=device), meta.decode_pages, meta.decode_ctx_lens)
        else:
            layout = _mixed_layout(meta, rows, device)
        self._layout_of = (meta, layout)
        return layout


def _mixed_layout(meta: AttentionMetadata, rows: int, device):
    spans = meta.prefills
    width = max([span.pages.numel() for span in spans] + [meta.decode_pages.shape[1]])
    tables = torch.zeros(len(spans) + meta.decode_pages.shape[0], width, dtype=torch.int64,
                         device=device)
    row_seq = torch.zeros(rows, dtype=torch.int64, device=device)
    row_ctx = torch.zeros(rows, dtype=torch.int64, device=device)
    for index, span in enumerate(spans):
        tables[index, : span.pages.numel()] = span.pages
        rows_of = slice(span.q_start, span.q_start + span.q_len)
        row_seq[rows_of] = index
        first = span.ctx_len - span.q_len + 1
        row_ctx[rows_of] = torch.arange(first, span.ctx_len + 1, device=device)
    decodes = meta.decode_rows.numel()
    if decodes:
        tables[len(spans) :, : meta.decode_pages.shape[1]] = meta.decode_pages
        row_seq[meta.decode_rows] = torch.arange(len(spans), len(spans) + decodes, device=device)
        row_ctx[meta.decode_rows] = meta.decode_ctx_lens
    return row_seq, tables, row_ctx


# ---- one token at a time (CPU, MPS) -------------------------------------------------------------


def forward_rows(runner: ModelRunner, plan: StepPlan, previous: LaunchedStep | None):
    """ModelRunner.forward_eager, one token at a time in plan order (a sequence's tokens in
    order, so each sees the keys of those before it): logits [R, V] of the sampled rows, then
    of the scored ones (prompt logprobs)."""
    inputs = runner.prepare(plan, previous)
    page_size = runner.kv.page_size
    logits, scored, row = [], [], 0  # scored: prompt-logprob rows, after the sampled ones
    for item in plan.scheduled:
        seq, start, count = item.seq, item.seq.num_computed, item.num_tokens
        sampled = range(count - 1 - item.num_draft, count) if item.samples else range(0)
        for offset in range(count):
            position = start + offset
            pages = seq.pages[: position // page_size + 1]
            meta = AttentionMetadata(
                page_size=page_size,
                slot_mapping=inputs.attn.slot_mapping[row : row + 1],
                prefills=[],
                decode_rows=runner._tensor([0]),
                decode_pages=runner._tensor([pages]),
                decode_ctx_lens=runner._tensor([position + 1]),
                max_decode_ctx=position + 1,
            )
            cos, sin = runner.rope.cos_sin(inputs.positions[row : row + 1],
                                           [(1, position + 1, seq.prompt_len)])
            hidden, residual = runner.model(inputs.input_ids[row : row + 1], cos, sin,
                                            runner.kv.layers, meta, runner.attention)
            if offset in sampled:
                logits.append(runner.model.compute_logits(hidden, residual))  # [1, V]
            elif offset < item.num_scored:
                scored.append(runner.model.compute_logits(hidden, residual))
            row += 1
    logits += scored
    return torch.cat(logits) if logits else None


def sample_rows(runner: ModelRunner, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
    """sample(), one row at a time; every row gets the batch's logprob width and metrics."""
    batch = runner.sampling_tensors(seqs)
    outs = []
    for index, seq in enumerate(seqs):
        knobs = dataclasses.replace(runner.sampling_tensors([seq]),
                                    max_logprobs=batch.max_logprobs, metrics=batch.metrics)
        outs.append(sample(logits[index : index + 1], knobs))
    fields = [None if getattr(outs[0], f.name) is None
              else torch.cat([getattr(out, f.name) for out in outs])
              for f in dataclasses.fields(SamplerOutput)]  # fmt: skip
    return SamplerOutput(*fields)
