"""Sequence: one request's tokens, KV pages and progress as the scheduler sees them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from noesis.sampling.params import SamplingParams
from noesis.structured.matcher import GrammarMatcher  # no torch: the planner stays host-only


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # a failure of this request alone (its knobs, grammar, logits); see `error`
    CONTENT_FILTER = "content_filter"  # a sidecar (noesis.sidecars) blocked it; see `filter_reason`
    PRUNED = "pruned"  # the binding gate stopped this branch (noesis.control.branches)


@dataclass(slots=True)
class Sequence:
    """Prompt plus generated tokens; `num_computed` of them have their KV in `pages`."""

    seq_id: int
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    max_len: int  # prompt + allowed new tokens, never past the context window
    seed: int
    stop_ids: frozenset[int] = frozenset()
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full pages
    num_cached_pages: int = 0  # leading pages taken from or given to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    matcher: GrammarMatcher | None = None  # the request's grammar state, fed each sampled token
    # Per-token temperature and top_p from the control plane (noesis.control.knobs.TokenKnobs),
    # fed each sampled token's metrics; None: the params' own.
    knobs: Any = None
    # Tokens sampled by steps still running on the device (overlapped scheduling): they count
    # towards the length and progress, and join `token_ids` when their step is read back.
    num_pending: int = 0
    # Speculative decoding: proposals verified for this sequence, and those accepted.
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens known or being sampled: `token_ids` plus the pending ones."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output(self) -> int:
        """Output tokens known, pending ones included (the seeded sampler's step counter)."""
        return self.num_tokens - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
