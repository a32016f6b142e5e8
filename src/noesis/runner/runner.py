"""ModelRunner: StepPlan -> ForwardInputs -> forward -> sample -> one copy back to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.engine.scheduler import ScheduledSeq, StepPlan
from noesis.engine.sequence import Sequence
from noesis.kernels import ops
from noesis.kv.cache import KVPool
from noesis.models.decoder import DecoderLM
from noesis.models.rope import RotaryEmbedding
from noesis.runner.attention import TorchPagedAttention, TritonPagedAttention
from noesis.runner.cuda_graph import CudaGraphRunner
from noesis.runner.inputs import AttentionMetadata, ForwardInputs, PrefillSpan
from noesis.sampling.sampler import Penalties, SamplerOutput, SamplingTensors, sample
from noesis.structured.bitmask import MaskFiller, apply_token_bitmask_


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None  # top-k plus the sampled token, when asked


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
        self.step_counts = {"graph": 0, "eager": 0}  # how steps ran, for benchmarks

    def capture_graphs(self, max_batch: int) -> float:
        """Capture decode graphs (CUDA only); returns the seconds it took."""
        self.graphs = CudaGraphRunner(
            self.model, self.kv, self.rope, self.attention, max_batch, self.max_model_len
        )
        self.graphs.capture()
        return self.graphs.capture_seconds

    def run(self, plan: StepPlan) -> dict[int, SampledToken]:
        """Execute one step; returns seq_id -> sampled token for sequences that sample."""
        return self.fetch(self.launch(plan, None))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue one step (forward, grammar masks, sampling, the copy of the sampled ids to the
        host) without waiting for it. Decodes of tokens still pending take them from
        `previous`, the step launched before this one, on the device."""
        sampling = [item.seq for item in plan.scheduled if item.samples]
        matchers = [seq.matcher for seq in sampling]
        constrained = any(m is not None for m in matchers)
        if constrained:  # the masks fill on a CPU thread while the forward runs
            self._mask_filler().start(matchers)
        try:
            logits = self._forward(plan, previous)
        finally:  # collected even when the forward fails, so the next step can start a fill
            bitmask = self.masks.result(self.device) if constrained else None
        if bitmask is not None:
            apply_token_bitmask_(logits, bitmask)
        launched = LaunchedStep(plan, sampling, {s.seq_id: i for i, s in enumerate(sampling)},
                                None, None, None, 0)
        if sampling:
            self._copy_out(launched, sample(logits, self.sampling_tensors(sampling)))
        return launched

    def _copy_out(self, launched: LaunchedStep, out: SamplerOutput) -> None:
        """Start the step's single device -> host copy: ids, and logprobs packed beside them."""
        launched.token_ids = out.token_ids  # what the next step may feed: valid ids only
        payload = out.reported_ids if out.reported_ids is not None else out.token_ids
        if out.token_logprobs is not None:
            payload = torch.cat(
                [
                    payload[:, None].double(),
                    out.token_logprobs[:, None].double(),
                    out.top_ids.double(),
                    out.top_logprobs.double(),
                ],
                dim=1,
            )  # [B, 2 + 2k]
            launched.top_k = out.top_ids.shape[1]
        cuda = self.device.type == "cuda"
        launched.host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=cuda)
        launched.host.copy_(payload, non_blocking=cuda)
        if cuda:
            launched.ready = torch.cuda.Event()
            launched.ready.record()

    def fetch(self, launched: LaunchedStep) -> dict[int, SampledToken]:
        """Wait for a launched step's sampled tokens: seq_id -> token for sequences that sample."""
        if launched.host is None:
            return {}
        if launched.ready is not None:
            launched.ready.synchronize()
        seqs = launched.seqs
        if launched.host.dtype == torch.int64:
            ids = launched.host.tolist()
            return {seq.seq_id: SampledToken(tok, None) for seq, tok in zip(seqs, ids, strict=True)}
        k = launched.top_k
        results = {}
        for seq, row in zip(seqs, launched.host.tolist(), strict=True):
            token = int(row[0])
            logprobs = None
            if seq.params.logprobs is not None:
                n = seq.params.logprobs
                top = zip(row[2 : 2 + n], row[2 + k : 2 + k + n], strict=True)
                logprobs = {int(i): lp for i, lp in top}
                logprobs[token] = row[1]
            results[seq.seq_id] = SampledToken(token, logprobs)
        return results

    def _forward(self, plan: StepPlan, previous: LaunchedStep | None) -> torch.Tensor | None:
        if self.graphs is not None and self.graphs.can_replay(plan):
            self.step_counts["graph"] += 1
            sources = pending_sources(plan, previous)
            return self.graphs.replay(plan, sources, previous.token_ids if sources else None)
        self.step_counts["eager"] += 1
        return self.forward_eager(plan, previous)

    def _mask_filler(self):
        if self.masks is None:
            with torch.inference_mode(False):  # its worker thread writes the buffers
                self.masks = MaskFiller(self.vocab_size, self.max_num_seqs)
        return self.masks

    def forward_eager(self, plan: StepPlan, previous: LaunchedStep | None = None):
        """Logits [B, V] of the sampling sequences (None when none samples)."""
        inputs = self.prepare(plan, previous)
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
        token_ids, positions, slots, sample_rows, rope_lengths = [], [], [], [], []
        sources = pending_sources(plan, previous)
        pending_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        decodes: list[ScheduledSeq] = []
        decode_rows: list[int] = []
        page_size = self.kv.page_size
        for index, item in enumerate(plan.scheduled):
            seq, start, count = item.seq, item.seq.num_computed, item.num_tokens
            row = len(token_ids)
            token_ids.extend(seq.token_ids[start : start + count])
            if sources is not None and sources[index] >= 0:  # filled in on the device below
                token_ids.append(0)
                pending_rows.append(row)
            positions.extend(range(start, start + count))
            slots.extend(
                seq.pages[p // page_size] * page_size + p % page_size
                for p in range(start, start + count)
            )
            rope_lengths.append((count, start + count, seq.prompt_len))
            if item.samples:
                sample_rows.append(row + count - 1)
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
        return ForwardInputs(
            input_ids=input_ids,
            positions=self._tensor(positions),
            attn=attn,
            sample_rows=self._tensor(sample_rows),
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
        if all(p.greedy and not p.needs_penalties for p in params):
            return SamplingTensors.greedy(max_logprobs)
        filtering = any(p.needs_filtering for p in params)
        # Two host -> device copies per step (one per dtype), not one per knob.
        floats = self._tensor([[p.temperature, p.top_p, p.min_p] for p in params], torch.float32)
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
        )

    def _penalties(self, seqs: list[Sequence]) -> Penalties:
        batch, vocab = len(seqs), self.vocab_size
        counts = torch.zeros(batch, vocab, device=self.device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=self.device)
        for row, seq in enumerate(seqs):
            outputs = self._tensor(seq.output_ids)
            counts[row].index_add_(0, outputs, torch.ones(len(outputs), device=self.device))
            seen[row, self._tensor(seq.token_ids)] = True
        params = [seq.params for seq in seqs]
        return Penalties(
            repetition=self._tensor([p.repetition_penalty for p in params], torch.float32),
            presence=self._tensor([p.presence_penalty for p in params], torch.float32),
            frequency=self._tensor([p.frequency_penalty for p in params], torch.float32),
            output_counts=counts,
            seen_mask=seen,
        )

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


def _padded(pages: list[int], length: int) -> list[int]:
    return pages + [0] * (length - len(pages))


def default_attention(device: torch.device, max_model_len: int):
    """The Triton paged backend on CUDA when Triton imports; the SDPA backend elsewhere."""
    if device.type == "cuda" and ops.use_triton(torch.empty(0, device=device)):
        return TritonPagedAttention(max_model_len)
    return TorchPagedAttention()
