"""Speculator: speculative decoding's seam in the engine. Before a step it picks the sequences
that speculate and asks the proposer; the scheduler gets their proposal counts, the runner the
proposals; after the step it books each verify's outcome (depth controllers, counters).

Which sequences speculate: a running sequence decoding its next token whose last token is on
the host (not pending), whose controller asks for a depth above 0, and which has room for one
more token past the proposals, whatever its options: a grammar's rows are masked at every
verified position (speculative.grammar), logit bias and logprobs are verify's as the sampler's.
A lookup's proposals for a constrained row stop where its grammar would refuse one.
No request speculates while more than `max_batch` run (when set), nor, once graphs are
captured (`capture_graphs`), while a verify step could not replay them: the running
sequences plus the proposals each would make must fit the largest graph (`max_rows`). An
eager verify step costs what ~20 replayed decode steps cost on a launch-bound model, and a step
of more rows is compute-bound anyway.

Counters: in total (`counts`) and per output channel (`channels`: Harmony's analysis,
commentary, final, plus header and other; "text" for a tokenizer without Harmony's tokens), a
row booked to the channel of the first position it fills. Besides the verify rows and their
proposed and accepted tokens, every row that sampled a token (`target_rows`, plain or verify,
of a request running while speculation is on) and the tokens those rows added (`generated`):
generated / target_rows is the tokens a request gets per target forward (1.0 without
speculation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from noesis.planner.sequence import Sequence as Seq
from noesis.planner.sequence import SequenceStatus
from noesis.speculative.adaptive import DepthController
from noesis.speculative.channels import ChannelScheme, ChannelTracker
from noesis.speculative.config import SpeculativeConfig
from noesis.speculative.grammar import grammar_prefix
from noesis.speculative.proposer import NgramProposer, Proposals, Proposer, StepProposals

if TYPE_CHECKING:
    from noesis.engine.engine import EngineConfig
    from noesis.engine.loading import LoadedModel

COUNTERS = ("verify_rows", "proposed", "accepted", "target_rows", "generated")

# Draft model: its KV pool holds what every sequence could need, capped to this share of the
# target's KV budget (it is the smaller model, and its cache is rebuilt from the history).
DRAFT_KV_SHARE = 0.25


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 scheme: ChannelScheme | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.scheme = scheme if scheme is not None else ChannelScheme()
        self._controllers: dict[int, DepthController] = {}  # seq_id -> its depth controller
        self._trackers: dict[int, ChannelTracker] = {}  # seq_id -> where its output stands
        self._paused = False  # the running batch is over config.max_batch or max_rows
        self.max_rows: int | None = None  # rows of the largest verify step that replays a graph
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.channels = {name: dict.fromkeys(COUNTERS, 0) for name in self.scheme.names}

    @classmethod
    def build(
        cls, engine: EngineConfig, target: LoadedModel, max_model_len: int, kv_memory: int
    ) -> Speculator:
        """The configured proposer: a draft model loaded next to the target (on its device, in
        its dtype, pages of its size), or prompt lookup. `kv_memory`: the target's KV budget."""
        config = engine.speculative
        scheme = ChannelScheme.of(target.tokenizer)
        if config.method == "ngram":
            return cls(config, NgramProposer(config.ngram_max, config.ngram_min), scheme)
        from noesis.speculative.draft import DraftProposer, head_rows

        wanted = engine.max_num_seqs * -(-max_model_len // engine.page_size)
        vocab = target.config.vocab_size
        head_ids = None
        if config.draft_vocab is not None and config.draft_vocab < vocab:
            tokenizer = target.tokenizer
            always = (*tokenizer.control_tokens().id_set, *tokenizer.eos_token_ids)
            head_ids = head_rows(vocab, config.draft_vocab, always)
        proposer = DraftProposer.load(
            config.draft,
            vocab,
            str(target.device),
            str(target.dtype).removeprefix("torch."),
            kv_memory=int(kv_memory * DRAFT_KV_SHARE),
            head_ids=head_ids,
            num_pages=wanted,
            page_size=engine.page_size,
            max_model_len=max_model_len,
            entropy_cutoff=config.entropy_cutoff,
        )
        return cls(config, proposer, scheme)

    @property
    def needs_knobs(self) -> bool:
        """Whether the proposer samples (a draft model): it needs the rows' sampling tensors."""
        return not isinstance(self.proposer, NgramProposer)

    def capture_graphs(self, max_rows: int, capture: bool = True) -> float:
        """The target captured graphs of up to `max_rows` rows: speculate only while a verify
        step fits them, and capture a draft model's own graphs; the seconds that took."""
        self.max_rows = max_rows
        if isinstance(self.proposer, NgramProposer):
            return 0.0
        return self.proposer.capture_graphs(max_rows, capture)

    def wants(self, seq: Seq) -> bool:
        """Whether `seq` would propose at its next step (so that step waits for this one's
        tokens on the host instead of overlapping)."""
        return not self._paused and not seq.finished and self._depth(seq) > 0

    def propose(
        self, running: Sequence[Seq], knobs: Callable | None = None
    ) -> tuple[StepProposals | None, dict[int, int]]:
        """Proposals for the running sequences that speculate this step, and seq_id -> how
        many each may verify (the scheduler's `num_drafts`). `knobs(seqs)` builds their
        sampling tensors for a proposer that samples."""
        limit = self.config.max_batch
        # Paused by the running batch as a whole, whichever of its sequences are ready this
        # step: deciding on the ready ones only un-paused every step whose sequences still had
        # a token in flight, and `wants` then kept the next step from overlapping (at batch 64
        # every other step ran without overlap).
        depth = {seq.seq_id: self._depth(seq) for seq in running}
        widest = len(running) + sum(depth.values())
        self._paused = ((limit is not None and len(running) > limit)
                        or (self.max_rows is not None and widest > self.max_rows))  # fmt: skip
        seqs = [] if self._paused else [seq for seq in running if self._ready(seq, depth)]
        depths = [depth[seq.seq_id] for seq in seqs]
        if not seqs:
            return None, {}
        tensors = knobs(seqs) if knobs is not None and self.needs_knobs else None
        guided = {}  # passed only when a row has a grammar
        if any(s.matcher is not None for s in seqs):
            guided["matchers"] = [s.matcher for s in seqs]
        proposals = self.proposer.propose(
            [s.request_id for s in seqs], [s.token_ids for s in seqs], depths, tensors, **guided
        )
        # A lookup's counts are on the host already; a draft's stay on the device (reading
        # them would sync), so its rows verify their full depth and mask the rest.
        if proposals.num_proposed.device.type == "cpu":
            depths = _grammar_cut(seqs, proposals)
        row_of = {seq.seq_id: row for row, seq in enumerate(seqs)}
        num_drafts = {seq.seq_id: n for seq, n in zip(seqs, depths, strict=True) if n > 0}
        return StepProposals(proposals, row_of), num_drafts

    def summary(self) -> dict:
        """The configuration and counters with their rates (`rates`), in total and per
        channel: the eval report's view."""
        return {
            "method": self.config.method,
            "draft": self.config.draft,
            "k": self.config.k,
            **rates(self.counts),
            "channels": {name: rates(counts) for name, counts in self.channels.items()},
        }

    def record(self, seq: Seq, proposed: int, accepted: int) -> None:
        """One sampled step of `seq`, read back and appended: `proposed` proposals judged (0:
        a plain step), `accepted` of them kept."""
        channel = self._count_tokens(seq)
        if seq.seq_id not in self._controllers:
            return  # never asked for a depth (speculation paused): no controller to feed
        self._controllers[seq.seq_id].record(proposed, accepted)
        if proposed:
            seq.spec_proposed += proposed
            seq.spec_accepted += accepted
            for counts in (self.counts, self.channels[channel]):
                counts["verify_rows"] += 1
                counts["proposed"] += proposed
                counts["accepted"] += accepted

    def release(self, seq: Seq) -> None:
        """The request ended: drop its controller, its channel tracker and the proposer's
        state (a draft's pages)."""
        self._controllers.pop(seq.seq_id, None)
        self._trackers.pop(seq.seq_id, None)
        self.proposer.release(seq.request_id)

    def _count_tokens(self, seq: Seq) -> str:
        """Book the tokens `seq` took since its last step to the channel of the first of
        them, and move its tracker past them; returns that channel."""
        tracker = self._trackers.get(seq.seq_id)
        if tracker is None:
            tracker = self._trackers[seq.seq_id] = self.scheme.tracker()
            tracker.advance(seq.token_ids[: seq.prompt_len])
        channel = tracker.channel
        taken = tracker.advance(seq.token_ids)
        if taken:
            for counts in (self.counts, self.channels[channel]):
                counts["target_rows"] += 1
                counts["generated"] += taken
        return channel

    def _ready(self, seq: Seq, depth: dict[int, int]) -> bool:
        return (
            seq.status is SequenceStatus.RUNNING
            and seq.num_pending == 0
            and seq.num_computed == len(seq.token_ids) - 1
            and len(seq.token_ids) + 1 < seq.max_len
            and depth[seq.seq_id] > 0
        )

    def _depth(self, seq: Seq) -> int:
        controller = self._controllers.get(seq.seq_id)
        if controller is None:
            controller = self._controllers[seq.seq_id] = DepthController(self.config)
        return controller.depth


def rates(counts: dict[str, int]) -> dict:
    """`counts` (COUNTERS) with acceptance (accepted / proposed), mean accepted length
    (accepted per verify row), tokens per verify row (that plus the token after them) and
    tokens per target row (generated / target_rows); None where nothing was counted."""
    rows, targets = counts["verify_rows"], counts["target_rows"]
    proposed, accepted = counts["proposed"], counts["accepted"]
    return {
        **counts,
        "acceptance": accepted / proposed if proposed else None,
        "mean_accepted_length": accepted / rows if rows else None,
        "tokens_per_verify": (accepted + rows) / rows if rows else None,
        "tokens_per_target_row": counts["generated"] / targets if targets else None,
    }


def _grammar_cut(seqs: Sequence[Seq], proposals: Proposals) -> list[int]:
    """Each row's count of host proposals (a lookup's), cut for a constrained row where its
    grammar refuses one or after one that completes it: verifying those could keep nothing.
    (A deterministic guess may be dropped for what it is; a draft's sampled one may not: its
    rejection must come from the acceptance test, or the output leaves the target's
    distribution. And its tokens are on the device.) Updates proposals.num_proposed."""
    counts = proposals.num_proposed.tolist()
    for row, seq in enumerate(seqs):
        if seq.matcher is not None and counts[row]:
            offered = proposals.proposed[row, : counts[row]].tolist()
            counts[row] = grammar_prefix(seq.matcher, offered)
    proposals.num_proposed = torch.tensor(counts, dtype=torch.int64)
    return counts
