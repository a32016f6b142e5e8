"""ForwardInputs: one step's tokens, positions, KV slots and attention layout, as device tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """A sequence feeding more than one token (or resuming after cached tokens) this step."""

    q_start: int  # first row in the flattened token batch
    q_len: int
    ctx_len: int  # tokens in the cache after this step's writes
    pages: torch.Tensor  # [num_pages] page ids covering ctx_len


@dataclass(slots=True)
class AttentionMetadata:
    page_size: int
    slot_mapping: torch.Tensor  # [T] cache slot (page * page_size + offset) of each new token
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor  # [Bd] rows of single-token decodes
    decode_pages: torch.Tensor  # [Bd, max_pages] page tables, padded with page 0
    decode_ctx_lens: torch.Tensor  # [Bd]
    max_decode_ctx: int  # the longest decode context, or a bound on it when `ctx_bound`
    # Cache slots [Bd, max_decode_ctx] of every decode's context, built on first use by a backend
    # that gathers (the SDPA one), then shared by all layers of the step.
    decode_slots: torch.Tensor | None = None
    # max_decode_ctx bounds the contexts without being one of them (a graph's static layout):
    # a lone decode still needs its mask.
    ctx_bound: bool = False


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    # [B + P] rows whose logits the step needs: the last token of each sampling sequence (all
    # of a verify row's), then the rows scoring prompt tokens (ScheduledSeq.num_scored)
    sample_rows: torch.Tensor
    rope_lengths: list[tuple[int, int, int]]  # (num_tokens, end, prompt_len) per sequence
