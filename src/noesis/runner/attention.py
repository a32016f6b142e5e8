"""Attention over the paged KV cache. Two halves per layer: `rope_and_store` rotates q/k and
writes this step's keys/values into their slots; `attend` computes attention.

TorchPagedAttention is the portable backend (CPU, MPS, CUDA): prefills one sequence at a time
(causal over cached + new keys), single-token decodes together over gathered page tables.
TritonPagedAttention (CUDA) fuses RoPE with the cache write and runs decodes with a paged
split-K kernel that reads pages in place; prefills still use SDPA.

Two optional extras: `sinks` [H] (gpt-oss: a learned logit per head that joins every softmax
and contributes no value) and `softcap` (Gemma 2: scores -> cap * tanh(scores / cap)). SDPA has
neither, so attention with them runs as plain matmuls and softmax (`_attention_math`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from noesis.models.rope import apply_rotary
from noesis.runner.inputs import AttentionMetadata


class TorchPagedAttention:
    name = "torch-sdpa"

    def rope_and_store(self, q, k, v, cos, sin, kv_cache, meta: AttentionMetadata):
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_slots, Hkv, d]
        flat[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))
        return q, k

    def attend(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, Hkv, d], rotated
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Hkv, d]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,  # [H]
        softcap: float | None = None,
    ) -> torch.Tensor:
        extras = {"sinks": sinks, "softcap": softcap} if sinks is not None or softcap else {}
        if not meta.prefills:  # decode-only step: every row is a decode, in order
            return self.decode(q, kv_cache, meta, scale, sliding_window, **extras)
        attend = partial(_attention_math, **extras) if extras else _sdpa
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.ctx_len == span.q_len and sliding_window is None and not extras:
                # Nothing cached before: plain causal attention over the fresh k/v.
                out[rows] = _sdpa(q[rows][None], k[rows][None], v[rows][None], None, scale,
                                  causal=True)[0]
                continue
            if span.ctx_len == span.q_len:
                keys, values = k[rows], v[rows]
            else:
                keys, values = self.read(kv_cache, _page_slots(span.pages, meta.page_size,
                                                               span.ctx_len))
            first = span.ctx_len - span.q_len
            mask = _mask(first, span.q_len, span.ctx_len, sliding_window, q.device)
            out[rows] = attend(q[rows][None], keys[None], values[None], mask, scale)[0]
        if meta.decode_rows.numel():
            out[meta.decode_rows] = self.decode(
                q[meta.decode_rows], kv_cache, meta, scale, sliding_window, **extras
            )
        return out

    def decode(self, q, kv_cache, meta: AttentionMetadata, scale: float, window: int | None,
               sinks: torch.Tensor | None = None, softcap: float | None = None):
        """Single-token decodes: q [Bd, H, d] over their page tables -> [Bd, H, d]."""
        length = meta.max_decode_ctx
        if meta.decode_slots is None:  # once per step, shared by every layer
            offsets = torch.arange(meta.page_size, device=q.device)
            pages = meta.decode_pages[:, :, None] * meta.page_size
            meta.decode_slots = (pages + offsets).flatten(1)[:, :length]
        keys, values = self.read(kv_cache, meta.decode_slots)  # [Bd, L, Hkv, d]
        extras = sinks is not None or softcap is not None
        if q.shape[0] == 1 and window is None and not extras and not meta.ctx_bound:
            # every key visible: no mask
            return _sdpa(q[:, None], keys, values, None, scale)[:, 0]
        key_pos = torch.arange(length, device=q.device)
        query_pos = (meta.decode_ctx_lens - 1)[:, None]
        mask = key_pos[None, :] <= query_pos  # [Bd, L]
        if window is not None:
            mask &= key_pos[None, :] > query_pos - window
        if extras:
            return _attention_math(q[:, None], keys, values, mask[:, None, None, :], scale,
                                   sinks=sinks, softcap=softcap)[:, 0]
        return _sdpa(q[:, None], keys, values, mask[:, None, None, :], scale)[:, 0]

    def read(self, kv_cache, slots: torch.Tensor):
        """Keys and values [*slots.shape, Hkv, d] at cache slots (page * page_size + offset);
        the one place cached keys are read back (an fp8 cache dequantizes here, noesis.kv.fp8)."""
        return kv_cache.view(2, -1, *kv_cache.shape[-2:])[:, slots]


class TritonPagedAttention(TorchPagedAttention):
    name = "triton-paged"

    def __init__(self, max_model_len: int) -> None:
        from noesis.kernels import paged_decode, rope

        self.paged_decode, self.rope = paged_decode, rope
        # The kernel sizes its context splits for the longest possible context, not the
        # longest in the batch: one compiled variant, shared by graphs and eager steps.
        self.max_model_len = max_model_len
        # cuDNN's SDPA builds an execution plan for every new (query, key) length pair, about a
        # second each (measured on an H200 as 1 s time-to-first-token spikes when cached prefixes
        # made new shapes); the flash and memory-efficient kernels need no per-shape build.
        torch.backends.cuda.enable_cudnn_sdp(False)

    def rope_and_store(self, q, k, v, cos, sin, kv_cache, meta: AttentionMetadata):
        self.rope.rope_write_kv(q, k, v, cos, sin, meta.slot_mapping, kv_cache[0], kv_cache[1])
        return q, k

    def decode(self, q, kv_cache, meta: AttentionMetadata, scale: float, window: int | None,
               sinks: torch.Tensor | None = None, softcap: float | None = None):
        return self.paged_decode.paged_decode_attention(
            q, kv_cache[0], kv_cache[1], meta.decode_pages, meta.decode_ctx_lens, scale,
            self.max_model_len, window, sinks=sinks, softcap=softcap,
        )


def _page_slots(pages: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """The first `length` cache slots [length] of a page table [P]."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets).flatten()[:length]


def _mask(first_pos: int, q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    query_pos = torch.arange(first_pos, first_pos + q_len, device=device)[:, None]
    key_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask  # [q_len, ctx_len]


def _attention_math(q, k, v, mask, scale: float, sinks=None, softcap=None) -> torch.Tensor:
    """What _sdpa computes (mask required), plus sinks [H] and soft-capping, as Hugging Face's
    eager attention does them: scores in the inputs' dtype, softmax in float32."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2) if group > 1 else k
    v = v.repeat_interleave(group, dim=2) if group > 1 else v
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # [B, H, Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink takes its share and gives no value
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)


def _sdpa(q, k, v, mask, scale: float, causal: bool = False) -> torch.Tensor:
    """q [B, Lq, H, d], k/v [B, Lk, Hkv, d]; boolean mask broadcastable to [B, H, Lq, Lk], or
    None with `causal` for plain causal attention (Lq == Lk, SDPA's flash kernel), or None
    alone when every key is visible to every query."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
