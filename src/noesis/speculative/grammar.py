"""Grammar-constrained speculation: the token mask at each verified position, from the row's
matcher advanced tentatively over its proposals and rolled back; the proposals a grammar lets a
deterministic proposer offer; a draft model's logits masked while it drafts. The matchers end
every call (and every draft) in the state they began in.

Position j of a verify row is masked with the grammar's state after proposals[:j]. The walk
stops at the first proposal the grammar forbids (verify rejects it: its p is 0, so no later one
can be accepted) and after one that completes the match (the request ends there: the engine
cuts the chain at that token). Positions past the walk are left all-allowed: no token sampled
there is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from noesis.speculative.proposer import Proposals
from noesis.structured.bitmask import ALL_ALLOWED, apply_token_bitmask_, bitmask_width
from noesis.structured.matcher import GrammarMatcher


def grammar_prefix(matcher: GrammarMatcher, proposals: Sequence[int]) -> int:
    """How many leading proposals the grammar takes (up to and including one that completes
    the match). For a deterministic proposer, which may then offer only these."""
    consumed = _advance(matcher, proposals)
    matcher.rollback(consumed)
    return consumed


class VerifyMasks:
    """Fills the verify rows' masks [n, k + 1, W] on a worker thread while the target forward
    runs, then one non-blocking copy to the device (as structured.bitmask.MaskFiller does for
    plain rows). `start` before the forward, `result` after; the matchers must not be touched
    in between. A draft's proposals are read from their host copy, which the worker waits for
    (the draft's work only: the forward queued after it keeps the device busy)."""

    def __init__(self, vocab_size: int) -> None:
        self.width = bitmask_width(vocab_size)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noesis-verify-mask")
        self._pending: Future[torch.Tensor] | None = None

    def start(
        self,
        matchers: Sequence[GrammarMatcher | None],
        proposals: Proposals,
        rows: Sequence[int],
        depths: Sequence[int],
        positions: int,
    ) -> None:
        """One verify row per matcher (None: a free row): its proposals are row rows[i] of
        `proposals`, depths[i] of them verified, in a step of `positions` (k + 1) positions."""
        if self._pending is not None:
            raise RuntimeError("VerifyMasks.start called twice without result()")
        self._pending = self._worker.submit(
            self._fill, list(matchers), proposals, list(rows), list(depths), positions
        )

    def result(self, device: torch.device) -> torch.Tensor:
        """The masks [n, k + 1, W] int32 on `device`."""
        if self._pending is None:
            raise RuntimeError("VerifyMasks.result called without start()")
        pending, self._pending = self._pending, None  # reset first: a failed fill raises here
        masks = pending.result()
        if device.type == "cpu":
            return masks
        return masks.to(device, non_blocking=True)  # pinned: the caching allocator keeps it

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _fill(self, matchers, proposals: Proposals, rows, depths, positions) -> torch.Tensor:
        n = len(matchers)
        shape = (n * positions, self.width)  # fill_next_token_bitmask writes rows of a 2-D mask
        buffer = torch.full(
            shape, ALL_ALLOWED, dtype=torch.int32, pin_memory=torch.cuda.is_available()
        )
        host = proposals.proposed_on_host() if any(m is not None for m in matchers) else None
        for i, matcher in enumerate(matchers):
            if matcher is not None:
                tokens = host[rows[i], : depths[i]].tolist()
                _fill_row(matcher, tokens, buffer, i * positions)
        return buffer.view(n, positions, self.width)


def _fill_row(
    matcher: GrammarMatcher, proposals: list[int], buffer: torch.Tensor, first: int
) -> None:
    """buffer[first + j]: the mask after proposals[:j], for j up to where the walk stops."""
    matcher.fill_next_token_bitmask(buffer, first)
    walked = _advance(
        matcher, proposals, lambda j: matcher.fill_next_token_bitmask(buffer, first + j)
    )
    matcher.rollback(walked)


def _advance(
    matcher: GrammarMatcher, proposals: Sequence[int], after: Callable[[int], None] | None = None
) -> int:
    """Feed proposals until one is refused or one completes the match (an end token would
    still be taken after it, but the request ends there); how many were taken. `after(j)`
    runs once j are taken, unless the j-th completed the match. Should the matcher raise,
    what was taken is rolled back first."""
    consumed = 0
    try:
        for token in proposals:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            consumed += 1
            if matcher.is_terminated():
                break
            if after is not None:
                after(consumed)
    except BaseException:
        matcher.rollback(consumed)
        raise
    return consumed


class DraftGuide:
    """A draft model's rows masked by their grammars while it drafts, so that it proposes what
    the grammar allows: position 0 with each matcher's current mask; position j > 0 after the
    matcher took the tokens drafted before it, when `per_token` (reading each drafted token
    back costs nothing on the CPU; on CUDA it would be a host sync per drafted token, so there
    only position 0 is masked, and verify rejects the rest where the grammar forbids it).
    `finish` rolls every matcher back to where it began."""

    def __init__(
        self,
        matchers: Sequence[GrammarMatcher | None],
        vocab_size: int,
        device: torch.device,
        per_token: bool,
    ) -> None:
        self.matchers = list(matchers)
        self.width = bitmask_width(vocab_size)
        self.device, self.per_token = device, per_token
        self._taken = [0] * len(self.matchers)
        self._walking = [m is not None for m in self.matchers]  # still in step with the draft

    def mask(self, j: int, logits: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """The draft's logits [r, V] at position j, masked out of place; drafted [r, k]."""
        if j > 0 and not self.per_token:
            return logits
        if j > 0:
            self._take(drafted[:, j - 1].tolist())
        cuda = self.device.type == "cuda"  # pinned: the copy does not wait for the stream
        shape = (len(self.matchers), self.width)
        buffer = torch.full(shape, ALL_ALLOWED, dtype=torch.int32, pin_memory=cuda)
        for row, matcher in enumerate(self.matchers):
            if self._walking[row]:
                matcher.fill_next_token_bitmask(buffer, row)
        mask = buffer.to(self.device, non_blocking=cuda)
        return apply_token_bitmask_(logits.clone(), mask)

    def finish(self) -> None:
        for matcher, taken in zip(self.matchers, self._taken, strict=True):
            if matcher is not None and taken:
                matcher.rollback(taken)

    def _take(self, tokens: list[int]) -> None:
        """Each walking matcher takes its row's drafted token; a row whose grammar refuses it
        or completed is no longer masked (verify settles what follows)."""
        for row, matcher in enumerate(self.matchers):
            if self._walking[row]:
                taken = _advance(matcher, tokens[row : row + 1])
                self._taken[row] += taken
                self._walking[row] = taken == 1 and not matcher.is_terminated()
