"""ModelRunner: StepPlan -> ForwardInputs -> forward -> sample -> one copy back to the host.

Speculative decoding plugs in here as verify rows: a sequence scheduled with proposals feeds its
last token and the proposals (taken from the step's proposals on the device), its logits at
each of those positions go to speculative.verify instead of the sampler, and the same single
copy brings back the token after the accepted ones, the proposal count and the accepted
proposals (and the logprobs of each token a row emits, when asked). A verify row with a grammar
is masked at each position by speculative.grammar.VerifyMasks, filled while the forward runs as
plain rows' masks are. On CUDA verify steps replay the decode graphs, each verified position a
graph row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter as _perf_counter
from typing import TYPE_CHECKING, Any

import torch

from noesis.kernels import ops
from noesis.kv.cache import KVPool
from noesis.models.decoder import DecoderLM
from noesis.models.rope import RotaryEmbedding
from noesis.planner.scheduler import ScheduledSeq, StepPlan
from noesis.planner.sequence import Sequence
from noesis.runner import batch_invariant
from noesis.runner.attention import TorchPagedAttention, TritonPagedAttention
from noesis.runner.cuda_graph import CudaGraphRunner
from noesis.runner.inputs import AttentionMetadata, ForwardInputs, PrefillSpan
from noesis.sampling.metrics import NUM_METRICS, TokenMetrics
from noesis.sampling.params import SamplingParams
from noesis.sampling.sampler import (
    LogitBias,
    Penalties,
    SamplerOutput,
    SamplingTensors,
    logprobs_of,
    sample,
)
from noesis.structured.bitmask import MaskFiller, apply_token_bitmask_

if TYPE_CHECKING:
    from noesis.speculative.proposer import StepProposals


@dataclass(slots=True)
class SampledToken:
    token_id: int  # verify rows: the token after the accepted proposals (correction or bonus)
    logprobs: dict[int, float] | None  # top-k plus the sampled token, when asked
    accepted: list[int] = field(default_factory=list)  # verify rows: proposals kept, in order
    proposed: int = 0  # verify rows: proposals judged
    metrics: TokenMetrics | None = None  # when asked (plain rows; verify rows have none)
    # verify rows, when logprobs were asked: one entry per accepted proposal, as `logprobs`
    accepted_logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device and not read back yet. The next step may be launched before
    `ModelRunner.fetch` reads this one: its pending input tokens come from `token_ids`."""

    plan: StepPlan
    seqs: list[Sequence]  # the sampling sequences, in the order of the sampled rows
    row_of: dict[int, int]  # seq_id -> row of `token_ids`
    token_ids: torch.Tensor | None  # [B] sampled ids on the device
    host: torch.Tensor | None  # their copy (packed with the logprobs when asked) on the host
    ready: torch.cuda.Event | None  # recorded after the copy (CUDA)
    top_k: int  # logprob columns packed in `host`
    # Verify steps: `host` rows are [token, proposed, accepted proposals padded with -1
    # (spec_width columns), logprob columns...]; 0 when the step verified nothing. Their
    # logprob columns are spec_width + 1 groups of 1 + 2 * top_k, one per token a row emits
    # (accepted proposals, then the token); a plain row fills the first group only.
    spec_width: int = 0
    metrics: bool = False  # `host` rows end with NUM_METRICS metric columns
    graph: bool = False  # replayed a captured graph
    # Telemetry (noesis.telemetry), set only when it is on: the step's index and shape, its
    # start (a CUDA event, or perf_counter on the host), device and wait time once fetched, and
    # per-row signals the runner's signal hooks computed (host copies, then lists).
    step_index: int = -1
    shape: Any = None
    started: Any = None
    device_ms: float | None = 0.0  # None: not measured (see ModelRunner._peek_timing)
    wait_ms: float = 0.0
    signals: Any = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): the scored rows' [P, 1 + 2k] (the next
    # prompt token's logprob, top-k ids, top-k logprobs) copied with the step, and per scored
    # sequence (seq, index of its first scored prompt token, rows). fetch turns them into
    # `prompt_logprobs`: (seq, first index, one dict per scored prompt token) per sequence.
    prompt_host: torch.Tensor | None = None
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, int, list[dict[int, float]]]] | None = None


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv: KVPool,
        rope: RotaryEmbedding,
        device: torch.device,
        max_model_len: int,
        attention=None,
        max_num_seqs: int = 256,
    ) -> None:
        self.model = model
        self.kv = kv
        self.rope = rope
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs  # rows a step can sample: sizes the grammar masks
        self.attention = attention or default_attention(device, max_model_len)
        self.vocab_size = model.config.vocab_size
        self.graphs: CudaGraphRunner | None = None
        self.masks = None  # MaskFiller, made for the first step with a grammar
        self.verify_masks = None  # speculative.grammar.VerifyMasks, for verify rows' grammars
        self.step_counts = {"graph": 0, "eager": 0}  # how steps ran, for benchmarks
        self.verify_counts = {"graph": 0, "eager": 0}  # how steps with verify rows ran
        # Telemetry: time each step (events around it, read after fetch's wait), and run the
        # signal hooks: each maps (plain rows' logits [B, V], their sequences) to named device
        # tensors [B] or [B, k] (entropy, phi...) that travel back with the step's copy.
        self.timing = False
        self.signal_hooks: list = []
        self.last_graph = False  # how the latest forward ran
        # Batch-invariant mode without its kernels (noesis.runner.batch_invariant): forward and
        # sample one token at a time.
        self.row_by_row = False

    def capture_graphs(self, max_batch: int, capture: bool = True) -> float:
        """Capture decode graphs of up to `max_batch` rows (CUDA); returns the seconds it took.
        capture=False (CPU, tests): the graphs' buffers and layout, their forward run eagerly."""
        self.graphs = CudaGraphRunner(
            self.model, self.kv, self.rope, self.attention, max_batch, self.max_model_len
        )
        if capture:
            self.graphs.capture()
        return self.graphs.capture_seconds

    def run(self, plan: StepPlan) -> dict[int, SampledToken]:
        """Execute one step; returns seq_id -> sampled token for sequences that sample."""
        return self.fetch(self.launch(plan, None))

    @torch.inference_mode()
    def launch(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None,
        read_back: Callable[[], None] | None = None,
    ) -> LaunchedStep:
        """Queue one step (forward, grammar masks, sampling or verification, the copy of the
        results to the host) without waiting for it. Decodes of tokens still pending take them
        from `previous`, the step launched before this one, on the device; verify rows take
        their proposals from `plan.proposals`.

        `read_back` (the caller's: read `previous` back, which advances the grammar matchers
        its tokens feed and adds them to the sequences that penalties count) is called once the
        forward is queued; the masks are filled and the sampling tensors built after it.
        So the device runs this step's forward while the host waits for the previous step's
        tokens, and only the sampler waits for the masks. Without it the masks fill on a CPU
        thread while the forward is queued."""
        started = self._start_timing() if self.timing else None
        sampling = [item for item in plan.scheduled if item.samples]
        plain = [item.seq for item in sampling if not item.num_draft]
        verifying = [item for item in sampling if item.num_draft]
        matchers = [seq.matcher for seq in plain]
        early = read_back is None and any(m is not None for m in matchers)
        if early:
            self._mask_filler().start(matchers)
        guided = self._start_verify_masks(verifying, plan.proposals)
        try:
            logits = self._forward(plan, previous)
        finally:  # collected even when the forward fails, so the next step can start a fill
            try:
                bitmask = self.masks.result(self.device) if early else None
            finally:
                verify_bitmask = self.verify_masks.result(self.device) if guided else None
        if read_back is not None:
            read_back()
            bitmask = self._late_masks(plain)
        scored = [item for item in plan.scheduled if item.num_scored]
        if scored:  # their rows come last: [R + P, V] -> [R, V], [P, V]
            count = sum(item.num_scored for item in scored)
            logits, scored_logits = logits[:-count], logits[-count:]
        target = None
        if verifying:
            logits, target = self._split_logits(logits, sampling)  # [Bp, V], [Bv, K + 1, V]
        if bitmask is not None:
            apply_token_bitmask_(logits, bitmask)
        seqs = plain + [item.seq for item in verifying]
        launched = LaunchedStep(plan, seqs, {s.seq_id: i for i, s in enumerate(seqs)},
                                None, None, None, 0, graph=self.last_graph, started=started)
        if scored:  # copied first: the step's ready event, recorded after, covers it
            self._score_prompts(launched, scored, scored_logits)
        if self.signal_hooks and plain:
            launched.signals = self._signals(logits, plain)
        out = self._sample(logits, plain) if plain else None
        if verifying:
            verified = self._verify(target, verifying, plan.proposals, verify_bitmask)
            self._copy_out_verified(launched, out, verified)
        elif out is not None:
            self._copy_out(launched, out)
        if scored and launched.ready is None and self.device.type == "cuda":
            launched.ready = torch.cuda.Event(enable_timing=self.timing)
            launched.ready.record()
        if started is not None:
            self._end_timing(launched, started)
        return launched

    def _score_prompts(self, launched: LaunchedStep, scored: list[ScheduledSeq],
                       logits: torch.Tensor) -> None:
        """Start the copy of the scored rows' prompt logprobs: each row's logits [P, V] score
        the prompt token after it, under the model's raw distribution (as logprobs are)."""
        targets, spans = [], []
        for item in scored:
            first = item.seq.num_computed + 1  # the prompt token the first row scores
            targets += item.seq.token_ids[first : first + item.num_scored]
            spans.append((item.seq, first, item.num_scored))
        k = max(item.seq.params.prompt_logprobs for item in scored)
        chosen, top_ids, top_logprobs = logprobs_of(logits.float(), self._tensor(targets), k)
        payload = torch.cat([chosen[:, None].double(), top_ids.double(), top_logprobs.double()],
                            dim=1)  # [P, 1 + 2k]
        cuda = self.device.type == "cuda"
        launched.prompt_host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=cuda)
        launched.prompt_host.copy_(payload, non_blocking=cuda)
        launched.prompt_spans = spans

    def _sample(self, logits: torch.Tensor, plain: list[Sequence]) -> SamplerOutput:
        if self.row_by_row:
            return batch_invariant.sample_rows(self, logits, plain)
        return sample(logits, self.sampling_tensors(plain))

    def _end_timing(self, launched: LaunchedStep, started) -> None:
        if self.device.type != "cuda":  # the host ran the step
            launched.device_ms = (_perf_counter() - started) * 1e3
        elif launched.ready is None:  # no copy back (a prefill chunk sampling nothing)
            launched.ready = torch.cuda.Event(enable_timing=True)
            launched.ready.record()

    def _start_timing(self):
        if self.device.type != "cuda":
            return _perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _signals(self, logits: torch.Tensor, plain: list[Sequence]) -> dict[str, torch.Tensor]:
        """The signal hooks' tensors for the plain rows, copied to the host without waiting
        (the step's ready event, recorded after, covers the copies)."""
        cuda = self.device.type == "cuda"
        copies = {}
        for hook in self.signal_hooks:
            for name, value in hook(logits, plain).items():
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=cuda)
                copies[name] = host.copy_(value.detach(), non_blocking=cuda)
        return copies

    def _copy_out(self, launched: LaunchedStep, out: SamplerOutput,
                  ids: torch.Tensor | None = None) -> None:
        """Start the step's single device -> host copy: ids ([B], or [B, m] for a verify
        step), and logprobs packed beside them (a verify step's: [B, G] and [B, G, k], one
        group of 1 + 2k columns per token a row may emit)."""
        launched.token_ids = out.token_ids  # what the next step may feed: valid ids only
        payload = out.reported_ids if out.reported_ids is not None else out.token_ids
        payload = ids if ids is not None else payload
        if out.token_logprobs is not None:
            parts = (out.token_logprobs, out.top_ids, out.top_logprobs)
            if out.token_logprobs.dim() == 1:  # one token per row: one group
                parts = tuple(x[:, None] for x in parts)
            chosen, top_ids, top_logprobs = parts
            groups = torch.cat([chosen[..., None].double(), top_ids.double(),
                                top_logprobs.double()], dim=2)  # [B, G, 1 + 2k]
            payload = torch.cat([payload.view(payload.shape[0], -1).double(), groups.flatten(1)],
                                dim=1)  # [B, 1 + G (1 + 2k)], or [B, m + G (1 + 2k)]
            launched.top_k = top_ids.shape[-1]
        if out.metrics is not None:  # [B, ... + NUM_METRICS]
            payload = torch.cat([payload.view(payload.shape[0], -1).double(), out.metrics.double()],
                                dim=1)  # fmt: skip
            launched.metrics = True
        cuda = self.device.type == "cuda"
        launched.host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=cuda)
        launched.host.copy_(payload, non_blocking=cuda)
        if cuda:
            launched.ready = torch.cuda.Event(enable_timing=self.timing)
            launched.ready.record()

    def fetch(self, launched: LaunchedStep) -> dict[int, SampledToken]:
        """Wait for a launched step's sampled tokens: seq_id -> token for sequences that sample.
        Prompt logprobs the step scored land in `launched.prompt_logprobs`."""
        if launched.host is None and launched.prompt_host is None:
            if self.timing and launched.ready is not None:
                self._peek_timing(launched)
            return {}
        if self.timing:
            self._fetch_timing(launched)
        elif launched.ready is not None:
            launched.ready.synchronize()
        if launched.prompt_host is not None:
            launched.prompt_logprobs = _prompt_entries(launched)
        if launched.host is None:
            return {}
        if launched.signals is not None:  # per row, None for the verify rows (after the plain)
            rows = len(launched.seqs)
            launched.signals = {name: (value.tolist() + [None] * rows)[:rows]
                                for name, value in launched.signals.items()}
        seqs = launched.seqs
        if launched.host.dim() == 1:
            ids = launched.host.tolist()
            return {seq.seq_id: SampledToken(tok, None) for seq, tok in zip(seqs, ids, strict=True)}
        k, width = launched.top_k, launched.spec_width
        first = 2 + width if width else 1  # the first logprob column
        results = {}
        for seq, row in zip(seqs, launched.host.tolist(), strict=True):
            token = int(row[0])
            accepted = [int(t) for t in row[2 : 2 + width] if t >= 0] if width else []
            entries = [None]
            if seq.params.logprobs is not None:  # group g: the g-th token the row emits
                entries = [_logprob_entry(row, first + g * (1 + 2 * k), k, seq.params.logprobs,
                                          tok) for g, tok in enumerate([*accepted, token])]
            metrics = None
            if launched.metrics and (seq.params.metrics or seq.knobs is not None):
                metrics = TokenMetrics.from_row(row[-NUM_METRICS:])
            results[seq.seq_id] = SampledToken(token, entries[-1], accepted,
                                               int(row[1]) if width else 0, metrics,
                                               entries[:-1] if accepted else [])
        return results

    @staticmethod
    def _peek_timing(launched: LaunchedStep) -> None:
        """A step with nothing to fetch: its device time if it is done already (else None:
        waiting for it would be a sync of telemetry's own)."""
        done = launched.ready.query()
        launched.device_ms = launched.started.elapsed_time(launched.ready) if done else None

    @staticmethod
    def _fetch_timing(launched: LaunchedStep) -> None:
        """fetch's wait, timed; then the step's device time from its events (both done now)."""
        start = _perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
            if launched.started is not None:
                launched.device_ms = launched.started.elapsed_time(launched.ready)
        launched.wait_ms = (_perf_counter() - start) * 1e3

    def _split_logits(self, logits: torch.Tensor, sampling: list[ScheduledSeq]):
        """The forward's logit rows (one per plain sampling sequence, 1 + num_draft per verify
        row, in plan order) -> plain logits [Bp, V] and verify logits [Bv, K + 1, V], K the
        most proposals of any row; shorter rows repeat their last position (never read)."""
        plain, verify, row = [], [], 0
        width = max(item.num_draft for item in sampling)
        for item in sampling:
            if not item.num_draft:
                plain.append(row)
                row += 1
                continue
            rows = list(range(row, row + item.num_draft + 1))
            verify.append(rows + [rows[-1]] * (width - item.num_draft))
            row += item.num_draft + 1
        return logits[self._tensor(plain)], logits[self._tensor(verify)]

    def _start_verify_masks(self, verifying: list[ScheduledSeq],
                            proposals: StepProposals | None) -> bool:
        """Start filling the verify rows' per-position grammar masks, when a row has a
        grammar; whether it did."""
        matchers = [item.seq.matcher for item in verifying]
        if all(matcher is None for matcher in matchers):
            return False
        if self.verify_masks is None:
            from noesis.speculative.grammar import VerifyMasks

            self.verify_masks = VerifyMasks(self.vocab_size)
        rows = [proposals.row_of[item.seq.seq_id] for item in verifying]
        depths = [item.num_draft for item in verifying]
        self.verify_masks.start(matchers, proposals.proposals, rows, depths, max(depths) + 1)
        return True

    def _verify(self, target: torch.Tensor, verifying: list[ScheduledSeq],
                proposals: StepProposals, bitmask: torch.Tensor | None):
        """Judge the verify rows' proposals: speculative.verify's output, with next_token -1
        where a position the row used had no finite logit after its mask (NaN or inf logits,
        or a grammar state allowing nothing), as the sampler reports."""
        from noesis.speculative.verify import verify

        width = target.shape[1] - 1
        found = proposals.proposals
        rows = [proposals.row_of[item.seq.seq_id] for item in verifying]
        proposed = self._rows_of(found.proposed, rows)[:, :width]
        offered = self._rows_of(found.num_proposed, rows)
        num_proposed = torch.minimum(offered, self._tensor([i.num_draft for i in verifying]))
        draft_probs = found.draft_probs
        if draft_probs is not None:
            draft_probs = self._rows_of(draft_probs, rows)[:, :width]
        knobs = self.sampling_tensors([item.seq for item in verifying])
        out = verify(target, proposed, num_proposed, knobs, draft_probs, bitmask)  # masks target
        finite = torch.isfinite(target.amax(dim=-1))  # [n, k + 1]
        unused = torch.arange(width + 1, device=self.device)[None, :] > out.num_accepted[:, None]
        out.next_token = torch.where((finite | unused).all(dim=-1), out.next_token, -1)
        return out, num_proposed

    def _copy_out_verified(self, launched: LaunchedStep, plain: SamplerOutput | None,
                           verified) -> None:
        """The copy of a step with verify rows: ids [B, 2 + K] (the token, proposals judged,
        accepted proposals padded with -1), plain rows first (none judged), then verify rows."""
        out, num_proposed = verified
        width = out.token_ids.shape[1] - 1
        position = torch.arange(width, device=self.device)[None, :]
        accepted = torch.where(position < out.num_accepted[:, None], out.token_ids[:, :width], -1)
        ids = torch.cat([out.next_token[:, None], num_proposed[:, None], accepted], dim=1)
        feed = out.next_token.clamp(min=0)  # valid ids, as a plain step's token_ids
        launched.spec_width = width
        if plain is None:
            logprobs = _chain_logprobs(None, out.logprobs, 0, feed.shape[0], width + 1)
            return self._copy_out(launched, SamplerOutput(feed, *logprobs), ids)
        reported = plain.reported_ids if plain.reported_ids is not None else plain.token_ids
        count, extra = reported.shape[0], feed.shape[0]
        plain_ids = torch.cat([reported[:, None], reported.new_zeros((count, 1)),
                               reported.new_full((count, width), -1)], dim=1)
        one_token = None
        if plain.token_logprobs is not None:
            one_token = (plain.token_logprobs, plain.top_ids, plain.top_logprobs)
        logprobs = _chain_logprobs(one_token, out.logprobs, count, extra, width + 1)
        metrics = None if plain.metrics is None else torch.cat(  # verify rows: NaN, none
            [plain.metrics, plain.metrics.new_full((extra, NUM_METRICS), float("nan"))])
        merged = SamplerOutput(torch.cat([plain.token_ids, feed]), *logprobs, metrics=metrics)
        self._copy_out(launched, merged, torch.cat([plain_ids, ids]))

    def _forward(self, plan: StepPlan, previous: LaunchedStep | None) -> torch.Tensor | None:
        self.last_graph = self.graphs is not None and self.graphs.can_replay(plan)
        how = "graph" if self.last_graph else "eager"
        self.step_counts[how] += 1
        if plan.proposals is not None:
            self.verify_counts[how] += 1
        if self.last_graph:
            sources = pending_sources(plan, previous)
            return self.graphs.replay(plan, sources, previous.token_ids if sources else None,
                                      plan.proposals)
        return self.forward_eager(plan, previous)

    def _late_masks(self, plain: list[Sequence]) -> torch.Tensor | None:
        """The plain rows' masks filled now (their matchers took the previous step's tokens);
        None when no row has a grammar. A row that finished meanwhile samples a token that is
        dropped anyway, so it is left unconstrained (its matcher may be spent or broken)."""
        matchers = [None if seq.finished else seq.matcher for seq in plain]
        if all(m is None for m in matchers):
            return None
        return self._mask_filler().fill(matchers, self.device)

    def _mask_filler(self):
        if self.masks is None:
            with torch.inference_mode(False):  # its worker thread writes the buffers
                self.masks = MaskFiller(self.vocab_size, self.max_num_seqs)
        return self.masks

    def forward_eager(self, plan: StepPlan, previous: LaunchedStep | None = None):
        """Logits [R, V] of the sampling sequences' rows (None when none samples): one per
        sequence, 1 + num_draft per verify row; then the scored rows (ScheduledSeq.num_scored),
        in plan order."""
        if self.row_by_row:
            return batch_invariant.forward_rows(self, plan, previous)
        return self.forward_inputs(self.prepare(plan, previous))

    def forward_inputs(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """forward_eager's forward from prepared inputs (tensor-parallel ranks run it on the
        inputs rank 0 prepared)."""
        cos, sin = self.rope.cos_sin(inputs.positions, inputs.rope_lengths)
        hidden, residual = self.model(
            inputs.input_ids, cos, sin, self.kv.layers, inputs.attn, self.attention
        )
        if not inputs.sample_rows.numel():
            return None
        rows = inputs.sample_rows
        residual = residual[rows] if residual is not None else None  # None: hidden is the sum
        return self.model.compute_logits(hidden[rows], residual)  # [B, V]

    def prepare(self, plan: StepPlan, previous: LaunchedStep | None = None) -> ForwardInputs:
        if self.kv.conv is not None:  # short-convolution state slots (LFM2)
            self.kv.conv.assign(plan.scheduled)
        token_ids, positions, slots, sample_rows, rope_lengths = [], [], [], [], []
        sources = pending_sources(plan, previous)
        pending_rows: list[int] = []
        draft_rows: list[int] = []  # rows fed a proposal, and the flat index of that proposal
        draft_sources: list[int] = []
        prefills: list[PrefillSpan] = []
        decodes: list[ScheduledSeq] = []
        decode_rows: list[int] = []
        page_size = self.kv.page_size
        proposals = plan.proposals
        scored_rows: list[int] = []  # prompt logprobs: after the sampled rows
        for index, item in enumerate(plan.scheduled):
            seq, start, count = item.seq, item.seq.num_computed, item.num_tokens
            row = len(token_ids)
            scored_rows.extend(range(row, row + item.num_scored))
            token_ids.extend(seq.token_ids[start : start + count - item.num_draft])
            if sources is not None and sources[index] >= 0:  # filled in on the device below
                token_ids.append(0)
                pending_rows.append(row)
            if item.num_draft:  # proposals, filled in on the device below
                first = proposals.row_of[seq.seq_id] * proposals.proposals.proposed.shape[1]
                draft_rows.extend(range(len(token_ids), len(token_ids) + item.num_draft))
                draft_sources.extend(range(first, first + item.num_draft))
                token_ids.extend([0] * item.num_draft)
            positions.extend(range(start, start + count))
            slots.extend(
                seq.pages[p // page_size] * page_size + p % page_size
                for p in range(start, start + count)
            )
            rope_lengths.append((count, start + count, seq.prompt_len))
            if item.samples:
                sample_rows.extend(range(row + count - 1 - item.num_draft, row + count))
            if count == 1 and start > 0:
                decodes.append(item)
                decode_rows.append(row)
            else:
                pages = seq.pages[: -(-(start + count) // page_size)]
                prefills.append(PrefillSpan(row, count, start + count, self._tensor(pages)))
        attn = self._decode_metadata(decodes, decode_rows, prefills, self._tensor(slots))
        input_ids = self._tensor(token_ids)
        if pending_rows:
            picked = self._tensor([source for source in sources if source >= 0])
            input_ids[self._tensor(pending_rows)] = previous.token_ids[picked]
        if draft_rows:
            flat = proposals.proposals.proposed.reshape(-1)
            input_ids[self._tensor(draft_rows)] = self._rows_of(flat, draft_sources)
        return ForwardInputs(
            input_ids=input_ids,
            positions=self._tensor(positions),
            attn=attn,
            sample_rows=self._tensor(sample_rows + scored_rows),
            rope_lengths=rope_lengths,
        )

    def _decode_metadata(self, decodes, rows, prefills, slot_mapping) -> AttentionMetadata:
        page_size = self.kv.page_size
        ctx_lens = [item.seq.num_computed + 1 for item in decodes]
        max_ctx = max(ctx_lens, default=0)
        max_pages = -(-max_ctx // page_size)
        tables = [_padded(item.seq.pages[:max_pages], max_pages) for item in decodes]
        return AttentionMetadata(
            page_size=page_size,
            slot_mapping=slot_mapping,
            prefills=prefills,
            decode_rows=self._tensor(rows),
            decode_pages=self._tensor(tables).view(len(decodes), max_pages),
            decode_ctx_lens=self._tensor(ctx_lens),
            max_decode_ctx=max_ctx,
        )

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [seq.params for seq in seqs]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        max_logprobs = max(logprobs) if logprobs else None
        metrics = any(p.metrics for p in params) or any(s.knobs is not None for s in seqs)
        if all(p.greedy and not p.needs_penalties for p in params):
            tensors = SamplingTensors.greedy(max_logprobs, metrics)
            tensors.logit_bias = self._logit_bias(params)
            return tensors
        filtering = any(p.needs_filtering for p in params)
        # Two host -> device copies per step (one per dtype), not one per knob.
        floats = self._tensor([[*_knobs(seq), seq.params.min_p] for seq in seqs], torch.float32)
        ints = self._tensor([[seq.params.top_k, seq.seed, seq.num_output] for seq in seqs])
        return SamplingTensors(
            temperature=floats[:, 0],
            top_k=ints[:, 0] if filtering else None,
            top_p=floats[:, 1] if filtering else None,
            min_p=floats[:, 2] if filtering else None,
            seeds=ints[:, 1],
            steps=ints[:, 2],
            all_greedy=all(p.greedy for p in params),
            penalties=self._penalties(seqs) if any(p.needs_penalties for p in params) else None,
            max_logprobs=max_logprobs,
            metrics=metrics,
            logit_bias=self._logit_bias(params),
        )

    def _logit_bias(self, params: list[SamplingParams]) -> LogitBias | None:
        """The rows' logit_bias entries in one host -> device copy per dtype; None when no row
        has any (the common case costs nothing)."""
        entries = [(row, token, value) for row, p in enumerate(params)
                   for token, value in p.logit_bias or ()]  # fmt: skip
        if not entries:
            return None
        where = self._tensor([[row, token] for row, token, _ in entries])  # [N, 2]
        values = self._tensor([value for _, _, value in entries], torch.float32)
        return LogitBias(where[:, 0], where[:, 1], values)

    def _penalties(self, seqs: list[Sequence]) -> Penalties:
        """The batch's penalty tensors. Only rows that ask for penalties count their tokens
        (with repetition 1 and presence and frequency 0, apply_penalties returns a row's logits
        exactly as they are, whatever its counts), all of them in one scatter each: one
        penalized request no longer costs every row of a large batch four launches a step."""
        batch, vocab = len(seqs), self.vocab_size
        counts = torch.zeros(batch, vocab, device=self.device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=self.device)
        penalized = [(row, seq) for row, seq in enumerate(seqs) if seq.params.needs_penalties]
        out_ids = [token for _, seq in penalized for token in seq.output_ids]
        if out_ids:
            out_rows = [row for row, seq in penalized for _ in seq.output_ids]
            counts.index_put_((self._tensor(out_rows), self._tensor(out_ids)),
                              torch.ones(len(out_ids), device=self.device), accumulate=True)
        seen_ids = [token for _, seq in penalized for token in seq.token_ids]
        if seen_ids:
            seen_rows = [row for row, seq in penalized for _ in seq.token_ids]
            seen[self._tensor(seen_rows), self._tensor(seen_ids)] = True
        params = [seq.params for seq in seqs]
        return Penalties(
            repetition=self._tensor([p.repetition_penalty for p in params], torch.float32),
            presence=self._tensor([p.presence_penalty for p in params], torch.float32),
            frequency=self._tensor([p.frequency_penalty for p in params], torch.float32),
            output_counts=counts,
            seen_mask=seen,
        )

    def _rows_of(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """x[rows] on this device, indexed where x lives (a lookup's proposals are on the
        host), copied without waiting for the work queued on the device."""
        if x.device.type == self.device.type:
            return x[self._tensor(rows)]
        picked = x[torch.tensor(rows)]
        if self.device.type != "cuda":
            return picked.to(self.device)
        return picked.pin_memory().to(self.device, non_blocking=True)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        """A host list on the device. On CUDA through pinned memory without waiting: a plain
        copy would wait for the step still running on the device."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)


def pending_sources(plan: StepPlan, previous: LaunchedStep | None) -> list[int] | None:
    """Per scheduled sequence, the row of `previous`'s sampled ids that holds the token it
    feeds, or -1 when its tokens are all known; None when nothing is pending."""
    sources, pending = [], False
    for item in plan.scheduled:
        seq = item.seq
        if seq.num_computed < len(seq.token_ids):
            sources.append(-1)
            continue
        if item.num_tokens != 1 or previous is None or seq.seq_id not in previous.row_of:
            raise RuntimeError(f"sequence {seq.seq_id} feeds a token no launched step samples")
        sources.append(previous.row_of[seq.seq_id])
        pending = True
    return sources if pending else None


def _prompt_entries(launched: LaunchedStep) -> list[tuple[Sequence, int, list[dict[int, float]]]]:
    """The fetched prompt-logprob rows -> per scored sequence (seq, first scored index, one dict
    per prompt token: its top-k, and the prompt token itself)."""
    rows = launched.prompt_host.tolist()
    k = (launched.prompt_host.shape[1] - 1) // 2
    scored, row = [], 0
    for seq, first, count in launched.prompt_spans:
        n = seq.params.prompt_logprobs
        entries = []
        for token, values in zip(seq.token_ids[first : first + count], rows[row : row + count],
                                 strict=True):
            entry = {int(t): lp for t, lp in zip(values[1 : 1 + n], values[1 + k : 1 + k + n],
                                                 strict=True)}
            entry[token] = values[0]
            entries.append(entry)
        scored.append((seq, first, entries))
        row += count
    return scored


def _knobs(seq: Sequence) -> tuple[float, float]:
    """A row's temperature and top_p: the control plane's for this token, else the request's."""
    knobs = seq.knobs
    if knobs is None:
        return seq.params.temperature, seq.params.top_p
    return knobs.temperature, knobs.top_p


def _logprob_entry(row: list[float], at: int, k: int, n: int, token: int) -> dict[int, float]:
    """One emitted token's logprobs from a fetched row whose group starts at `at` (its
    logprob, k top ids, k top logprobs): the top n, and the token itself."""
    top = zip(row[at + 1 : at + 1 + n], row[at + 1 + k : at + 1 + k + n], strict=True)
    entry = {int(i): lp for i, lp in top}
    entry[token] = row[at]
    return entry


def _chain_logprobs(one_token, chain, plain_rows: int, chain_rows: int, groups: int):
    """The plain rows' logprobs (one token each: [Bp], [Bp, k], [Bp, k]) stacked over the
    verify rows' (one per position: [Bv, G], [Bv, G, k], [Bv, G, k]) as [B, G], [B, G, k] and
    [B, G, k]; zeros where a side asked for none (never read). (None,) * 3 when neither did."""
    if one_token is None and chain is None:
        return None, None, None
    if one_token is not None:
        one_token = tuple(x[:, None] for x in one_token)  # one position
    k = max(part[1].shape[-1] for part in (one_token, chain) if part is not None)
    device = (one_token or chain)[0].device
    return tuple(torch.cat(side) for side in zip(
        _padded_logprobs(one_token, plain_rows, groups, k, device),
        _padded_logprobs(chain, chain_rows, groups, k, device), strict=True))


def _padded_logprobs(part, rows: int, groups: int, k: int, device: torch.device):
    """One side's logprobs padded to `groups` positions and k top entries, or zeros for its
    `rows` rows when it asked for none."""
    if part is None:
        return (torch.zeros((rows, groups), device=device),
                torch.zeros((rows, groups, k), dtype=torch.int64, device=device),
                torch.zeros((rows, groups, k), device=device))
    chosen, top_ids, top_logprobs = part
    more, wider = groups - chosen.shape[1], k - top_ids.shape[-1]
    pad = torch.nn.functional.pad
    return (pad(chosen, (0, more)), pad(top_ids, (0, wider, 0, more)),
            pad(top_logprobs, (0, wider, 0, more)))


def _padded(pages: list[int], length: int) -> list[int]:
    return pages + [0] * (length - len(pages))


def default_attention(device: torch.device, max_model_len: int):
    """The Triton paged backend on CUDA when Triton imports; the SDPA backend elsewhere."""
    if device.type == "cuda" and ops.use_triton(torch.empty(0, device=device)):
        return TritonPagedAttention(max_model_len)
    return TorchPagedAttention()
