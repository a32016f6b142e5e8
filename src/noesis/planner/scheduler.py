"""Scheduler: decides which sequences run this step and how many tokens each. Pure Python.

Policy, in order: running sequences first (decodes and unfinished chunked prefills, oldest first),
then waiting sequences admitted FIFO while the token budget, the sequence cap and free pages allow.
When a running sequence needs a page and none is free, the newest running sequence is preempted
(its pages freed, to be recomputed later). With a prefix cache, an admitted sequence starts on
the cached pages of its longest cached prefix, and pages are cached as they fill.
Speculative decoding: a decoding sequence with proposals runs as a verify row of 1 + num_draft
tokens (its last token, then the proposals); the proposals count as computed only once
accepted, and pages holding nothing but rejected ones are freed.
Invariant: the scheduler imports no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from noesis.errors import OutOfKVCache
from noesis.kv.allocator import PageAllocator
from noesis.kv.prefix_cache import PrefixCache
from noesis.planner.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step; also the prefill chunk size

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step, starting at seq.num_computed (proposals included)
    num_draft: int = 0  # of which the last ones are proposals to verify (a verify row)
    samples: bool = field(init=False)  # the step reaches the last known token: sample a new one
    # SamplingParams.prompt_logprobs: the first rows fed whose logits score the prompt token
    # after them (positions before the prompt's last); 0 when not asked.
    num_scored: int = field(init=False)

    def __post_init__(self) -> None:
        seq, known = self.seq, self.num_tokens - self.num_draft
        self.samples = seq.num_computed + known == seq.num_tokens
        self.num_scored = 0
        if seq.params.prompt_logprobs is not None:
            self.num_scored = max(0, min(self.num_tokens, seq.prompt_len - 1 - seq.num_computed))


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The verify rows' proposals (a speculative.StepProposals, on the device: opaque here),
    # attached by the engine; None when no row verifies.
    proposals: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Cumulative token counts behind the throughput a server logs: prompt tokens computed
        # (prefill, recomputation after preemption included) and tokens generated.
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def add(self, seq: Sequence) -> None:
        pages = self.allocator.pages_for(seq.max_len)
        if pages > self.allocator.num_pages:
            raise OutOfKVCache(
                f"request {seq.request_id} may need {pages} KV pages ({seq.max_len} tokens); the "
                f"pool has {self.allocator.num_pages}: lower max_tokens or raise the KV cache size"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_drafts: dict[int, int] | None = None) -> StepPlan:
        """Plan one step. `num_drafts` maps seq_id -> proposals ready for a decoding sequence:
        it runs as a verify row, with fewer proposals when the budget or its length cap is
        short."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(plan, budget, num_drafts or {})
        if not plan.preempted:
            self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int, num_drafts: dict[int, int]) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_tokens >= seq.max_len:  # its pending last token ends it: nothing to run
                index += 1
                continue
            num_tokens = min(seq.num_uncomputed, budget)
            num_draft = 0
            if num_tokens == 1 and seq.num_pending == 0 and seq.seq_id in num_drafts:
                # The accepted proposals and the token after them must fit under max_len.
                room = seq.max_len - seq.num_tokens - 1
                num_draft = max(0, min(num_drafts[seq.seq_id], budget - 1, room))
                num_tokens += num_draft
            if not self._reserve_or_preempt(seq, num_tokens, plan):
                break  # seq itself was preempted; everything after it already was
            plan.scheduled.append(ScheduledSeq(seq, num_tokens, num_draft))
            budget -= num_tokens
            index += 1
        return budget

    def _reserve_or_preempt(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Give `seq` pages for `num_tokens` more tokens, preempting the newest others if needed."""
        need = self._pages_missing(seq, num_tokens)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        seq.pages.extend(self.allocator.allocate(need))
        return True

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted while its last step ran: admit once it is read back
                break
            # Prompt logprobs need the logits of every prompt position: no cached prefix.
            if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
                self.prefix_cache.attach(seq)
            num_tokens = min(seq.num_uncomputed, budget)
            need = self._pages_missing(seq, num_tokens)
            if not self.allocator.can_allocate(need):
                self._release_pages(seq)  # waiting sequences hold no pages
                break
            if self.prefix_cache is not None:
                self.prefix_cache.record_admission(seq)
            self.waiting.popleft()
            seq.pages.extend(self.allocator.allocate(need))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens

    def _pages_missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.allocator.pages_for(seq.num_computed + num_tokens) - len(seq.pages))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_pages(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release_pages(self, seq: Sequence) -> None:
        self.allocator.free(reversed(seq.pages))  # tail first: it is evicted before the prefix
        seq.pages = []
        seq.num_computed = 0
        seq.num_cached_pages = 0

    def update(
        self, plan: StepPlan, sampled: dict[int, int], accepted: dict[int, list[int]] | None = None
    ) -> list[Sequence]:
        """Record a finished step: `advance` and `resolve` at once (the synchronous loop).
        Returns the sequences that finished this step."""
        self.advance(plan)
        return [seq for seq in self.resolve(plan, sampled, accepted) if seq.finished]

    def advance(self, plan: StepPlan) -> None:
        """A step was launched: its known tokens count as computed (proposals wait for their
        verdict), and each sampling sequence owes one pending token, so the next step can be
        planned before this one is read back."""
        for item in plan.scheduled:
            seq, known = item.seq, item.num_tokens - item.num_draft
            self.num_prompt_tokens += max(0, min(known, seq.prompt_len - seq.num_computed))
            seq.num_computed += known
            if item.samples:
                item.seq.num_pending += 1

    def resolve(
        self, plan: StepPlan, sampled: dict[int, int], accepted: dict[int, list[int]] | None = None
    ) -> list[Sequence]:
        """A launched step was read back: append the sampled tokens, cache filled pages, finish
        what stops. `sampled` maps seq_id -> new token for every scheduled sequence whose
        `samples` was true; `accepted` (verify rows) the proposals kept before it, whose KV the
        step wrote. A stop inside that chain ends the sequence there: later tokens are dropped.
        Sequences finished meanwhile (a stop found while this step ran, an abort) are skipped:
        their token is dropped. Returns the sequences that took a token, in plan order
        (finished ones among them)."""
        took = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.finished:
                continue
            reason = None
            if item.samples:
                seq.num_pending -= 1
                kept = accepted.get(seq.seq_id, []) if accepted else []
                length = len(seq.token_ids)
                reason = self._append_chain(seq, [*kept, sampled[seq.seq_id]])
                self.num_generated_tokens += len(seq.token_ids) - length
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
            elif item.num_draft:
                self._trim_pages(seq)
            if item.samples:
                took.append(seq)
        return took

    def _append_chain(self, seq: Sequence, tokens: list[int]) -> FinishReason | None:
        """Append tokens one at a time, as that many plain steps would, up to a stop (whose
        reason is returned). All but the last were fed this step (accepted proposals): their
        KV is computed."""
        for index, token in enumerate(tokens):
            seq.token_ids.append(token)
            if index < len(tokens) - 1:
                seq.num_computed += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                return reason
        return None

    def _trim_pages(self, seq: Sequence) -> None:
        """Free the tail pages past the computed tokens: they hold only rejected proposals
        (rolled back), as a plain decode would have left them."""
        keep = self.allocator.pages_for(seq.num_computed)
        if len(seq.pages) > keep:
            self.allocator.free(reversed(seq.pages[keep:]))
            del seq.pages[keep:]

    @staticmethod
    def _stop_reason(seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.stop_ids:
            return FinishReason.STOP
        if len(seq.token_ids) >= seq.max_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish `seq` now (stop condition, stop string or abort) and free its pages."""
        if seq.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(reversed(seq.pages))
        seq.pages = []
        seq.num_pending = 0  # a step still running for it is dropped when read back
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
