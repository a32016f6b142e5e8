"""Attention over the paged KV cache with PyTorch SDPA: the portable backend (CPU, MPS, CUDA).

Writes this step's keys/values into their slots, then attends: prefills one sequence at a time
(causal over cached + new keys), single-token decodes together over gathered page tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from noesis.runner.inputs import AttentionMetadata


class TorchPagedAttention:
    name = "torch-sdpa"

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Hkv, d]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        _write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.ctx_len == span.q_len:  # nothing cached before: attend to the fresh k/v
                keys, values = k[rows], v[rows]
            else:
                keys, values = _gather(kv_cache, span.pages[None], span.ctx_len)
                keys, values = keys[0], values[0]
            mask = _mask(
                span.ctx_len - span.q_len, span.q_len, span.ctx_len, sliding_window, q.device
            )
            out[rows] = _sdpa(q[rows][None], keys[None], values[None], mask, scale)[0]
        if meta.decode_rows.numel():
            out[meta.decode_rows] = self._decode(q, kv_cache, meta, scale, sliding_window)
        return out

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float, window: int | None):
        keys, values = _gather(kv_cache, meta.decode_pages, meta.max_decode_ctx)  # [Bd, L, Hkv, d]
        key_pos = torch.arange(meta.max_decode_ctx, device=q.device)
        query_pos = (meta.decode_ctx_lens - 1)[:, None]
        mask = key_pos[None, :] <= query_pos  # [Bd, L]
        if window is not None:
            mask &= key_pos[None, :] > query_pos - window
        mask = mask[:, None, None, :]  # [Bd, 1, 1, L]
        return _sdpa(q[meta.decode_rows][:, None], keys, values, mask, scale)[:, 0]


def _write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_slots, Hkv, d]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def _gather(kv_cache: torch.Tensor, pages: torch.Tensor, length: int):
    """Keys and values [B, length, Hkv, d] laid out contiguously from page tables [B, P]."""
    batch = pages.shape[0]
    keys = kv_cache[0][pages].reshape(batch, -1, *kv_cache.shape[-2:])[:, :length]
    values = kv_cache[1][pages].reshape(batch, -1, *kv_cache.shape[-2:])[:, :length]
    return keys, values


def _mask(first_pos: int, q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    query_pos = torch.arange(first_pos, first_pos + q_len, device=device)[:, None]
    key_pos = torch.arange(ctx_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask  # [q_len, ctx_len]


def _sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [B, Lq, H, d], k/v [B, Lk, Hkv, d], boolean mask broadcastable to [B, H, Lq, Lk]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
