"""Pooled final hidden states of whole prompts (embeddings from the loaded decoder).

A prompt to embed is one prefill that samples nothing and keeps nothing: it runs through the
engine's own modules, rotary tables and attention code, but attends over its fresh keys only and
stores none, so it takes no KV page and leaves the running sequences' cache untouched. The engine
runs it on its own thread between two steps (Engine.embed), never during one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from noesis.errors import UnsupportedModel
from noesis.models.rope import apply_rotary
from noesis.runner.attention import TorchPagedAttention
from noesis.runner.inputs import AttentionMetadata, PrefillSpan

POOLINGS = ("last", "mean")


class CacheFreeAttention(TorchPagedAttention):
    """Causal attention over each span's own keys; nothing is written to the cache. (The fused
    one-row kernels of a 1-token prompt on CUDA write their key into the pool's scratch page,
    which no sequence reads.)"""

    name = "cache-free"

    def rope_and_store(self, q, k, v, cos, sin, kv_cache, meta: AttentionMetadata):
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@torch.inference_mode()
def pooled_hidden(runner, prompts: list[list[int]], pooling: str, max_tokens: int) -> torch.Tensor:
    """L2-normalized pooled final hidden states [N, D] (float32, on the host) of `prompts`,
    forwarded in batches of at most `max_tokens` tokens (a longer prompt goes alone)."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; supported: {', '.join(POOLINGS)}")
    if runner.kv.conv is not None:
        raise UnsupportedModel("embeddings need attention-only layers; this model's short "
                               "convolutions (LFM2) keep per-sequence state a pooled forward "
                               "has no slot for")
    pooled = [_forward_batch(runner, batch, pooling) for batch in _batches(prompts, max_tokens)]
    return F.normalize(torch.cat(pooled).float(), dim=-1).cpu()


def _batches(prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    batches: list[list[list[int]]] = [[]]
    used = 0
    for prompt in prompts:
        if batches[-1] and used + len(prompt) > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(prompt)
        used += len(prompt)
    return batches


def _forward_batch(runner, prompts: list[list[int]], pooling: str) -> torch.Tensor:
    """One forward of several prompts as prefill spans -> pooled rows [B, D]."""
    device, kv = runner.device, runner.kv
    lengths = [len(p) for p in prompts]
    starts = [sum(lengths[:i]) for i in range(len(prompts))]
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    no_pages = torch.empty(0, dtype=torch.int64, device=device)
    scratch = kv.scratch_page * kv.page_size + torch.arange(total, device=device) % kv.page_size
    meta = AttentionMetadata(
        page_size=kv.page_size,
        slot_mapping=scratch,
        prefills=[PrefillSpan(s, n, n, no_pages) for s, n in zip(starts, lengths, strict=True)],
        decode_rows=no_pages,
        decode_pages=no_pages.view(0, 0),
        decode_ctx_lens=no_pages,
        max_decode_ctx=0,
    )
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    cos, sin = runner.rope.cos_sin(positions, [(n, n, n) for n in lengths])
    hidden, residual = runner.model(ids, cos, sin, kv.layers, meta, CacheFreeAttention())
    if residual is not None:
        hidden = hidden + residual
    final = runner.model.model.norm(hidden)  # [T, D], as transformers' last hidden state
    if pooling == "last":
        ends = torch.tensor([s + n - 1 for s, n in zip(starts, lengths, strict=True)],
                            device=device)
        return final[ends]
    return torch.stack([final[s : s + n].float().mean(0)
                        for s, n in zip(starts, lengths, strict=True)])
