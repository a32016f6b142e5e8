"""Proposers: the Proposer protocol, the Proposals they return, and NgramProposer (prompt lookup).

A proposer guesses up to k next tokens per request from its committed token history (prompt and
output so far). A model proposer also returns its distributions q, which verification needs for
rejection sampling; a deterministic one (n-gram) returns none, i.e. q is one-hot at its guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from noesis.sampling.sampler import SamplingTensors
from noesis.structured.matcher import GrammarMatcher


@dataclass(slots=True)
class Proposals:
    """What a proposer guessed for a batch of requests, in the order they were asked: the
    verify inputs, on the proposer's device."""

    proposed: torch.Tensor  # [n, k] long, padded with 0 past each row's count
    num_proposed: torch.Tensor  # [n] long, 0..k
    # [n, k, V] probabilities the draft sampled each proposal from (after the same penalties,
    # temperature and filters as the target's, see verify.processed_probs); None when the
    # proposals are deterministic.
    draft_probs: torch.Tensor | None = None
    # `proposed` on the host (None: `proposed` is a host tensor already), complete once
    # `host_ready` is (None: now): a draft's copy, started without waiting for it.
    host_proposed: torch.Tensor | None = None
    host_ready: torch.cuda.Event | None = None

    @classmethod
    def from_lists(cls, token_ids: Sequence[Sequence[int]], k: int | None = None,
                   device: torch.device | str = "cpu") -> Proposals:
        """Host lists (at most k each; k defaults to the longest) -> padded tensors."""
        k = max((len(ids) for ids in token_ids), default=0) if k is None else k
        proposed = torch.zeros((len(token_ids), k), dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            if len(ids) > k:
                raise ValueError(f"request {row} has {len(ids)} proposals, more than k={k}")
            proposed[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
        return cls(proposed.to(device), lengths.to(device))

    def proposed_on_host(self) -> torch.Tensor:
        """`proposed` [n, k] on the host: waits for a draft's copy (not for the device's
        later work), so a worker thread can read it while the verify forward runs."""
        if self.host_proposed is None:
            return self.proposed.cpu()
        if self.host_ready is not None:
            self.host_ready.synchronize()
        return self.host_proposed

    def to_lists(self) -> list[list[int]]:
        """Each row's proposals on the host (a device sync: for tests and the host side)."""
        rows = self.proposed.tolist()
        return [row[:count] for row, count in zip(rows, self.num_proposed.tolist(), strict=True)]


@dataclass(slots=True)
class StepProposals:
    """One engine step's proposals, for the runner to feed and verify: rows of `proposals` and
    the sequence each belongs to. The scheduler decides how many of a row's proposals run."""

    proposals: Proposals
    row_of: dict[int, int]  # seq_id -> row of `proposals`


class Proposer(Protocol):
    """Guesses each request's next tokens; `release` drops a finished request's state.

    histories: each request's committed tokens (prompt and output), which only grow between
    calls; depths: how many tokens each may propose (0: none); sampling: the requests' knobs
    with steps at the first proposed token, which a model proposer samples with (None: greedy);
    matchers (passed only when a request has a grammar): each request's grammar matcher or
    None, which a model proposer may draft under, leaving it in the state it found it.
    """

    def propose(self, request_ids: Sequence[object], histories: Sequence[Sequence[int]],
                depths: Sequence[int], sampling: SamplingTensors | None = None,
                matchers: Sequence[GrammarMatcher | None] | None = None) -> Proposals: ...

    def release(self, request_id: object) -> None: ...


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the history's last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it.

    Each request's n-grams are indexed as its history grows, so a step costs O(max_n) lookups
    plus the appended tokens, however long the history. Histories only grow: a request whose
    history is shorter than what was indexed, or differs at its last indexed token, is
    re-indexed from scratch.
    """

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[object, _NgramIndex] = {}

    def propose(self, request_ids: Sequence[object], histories: Sequence[Sequence[int]],
                depths: Sequence[int], sampling: SamplingTensors | None = None,
                matchers: Sequence[GrammarMatcher | None] | None = None) -> Proposals:
        """Lookups on the host; the proposals come back as CPU tensors (sampling is unused:
        a lookup is deterministic, so verify takes q as one-hot; so are matchers: the
        speculator cuts a lookup where its grammar refuses it)."""
        if not len(request_ids) == len(histories) == len(depths):
            raise ValueError("request_ids, histories and depths must have one entry per request")
        token_ids = []
        for request_id, history, depth in zip(request_ids, histories, depths, strict=True):
            index = self._index_for(request_id, history)
            token_ids.append(index.lookup(depth) if depth > 0 else [])
        return Proposals.from_lists(token_ids, max(depths, default=0))

    def release(self, request_id: object) -> None:
        self._indexes.pop(request_id, None)

    def _index_for(self, request_id: object, history: Sequence[int]) -> _NgramIndex:
        index = self._indexes.get(request_id)
        if index is None or not index.continues(history):
            index = self._indexes[request_id] = _NgramIndex(self.min_n, self.max_n)
        index.extend(history)
        return index


@dataclass(slots=True)
class _NgramIndex:
    """One request's n-grams -> the position just after their most recent occurrence.

    Only n-grams ending before the last token are in `_after`: the suffix itself must be matched
    against earlier text, so the n-grams ending at the last token wait until the next token
    arrives."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)

    def continues(self, history: Sequence[int]) -> bool:
        size = len(self.tokens)
        return len(history) >= size and (size == 0 or history[size - 1] == self.tokens[-1])

    def extend(self, history: Sequence[int]) -> None:
        for token in history[len(self.tokens):]:
            self._index_suffixes()  # the n-grams ending at the current last token become earlier
            self.tokens.append(int(token))

    def lookup(self, depth: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + depth]
        return []

    def _index_suffixes(self) -> None:
        tokens, end = self.tokens, len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._after[tuple(tokens[end - n:])] = end


def entropy_of(probs: torch.Tensor) -> torch.Tensor:
    """The entropy in nats of each distribution [..., V] -> [...] (0 log 0 counted as 0)."""
    return torch.special.entr(probs).sum(dim=-1)


def lengths_under_entropy(entropy: torch.Tensor, num_proposed: torch.Tensor,
                          cutoff: float) -> torch.Tensor:
    """Cut each row's proposals before the first position whose draft distribution has more
    entropy than `cutoff` (nats): the draft was guessing there. On the device, no sync.
    entropy [n, k] (entropy_of the draft's distributions), num_proposed [n] -> [n]."""
    confident = (entropy <= cutoff).to(torch.int64)
    return torch.minimum(num_proposed, confident.cumprod(dim=-1).sum(dim=-1))
