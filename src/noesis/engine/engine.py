"""Engine: owns the model, KV pool, scheduler and runner; `step()` is schedule -> run -> finish."""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass

import torch

from noesis.engine.loading import LoadedModel, load_model
from noesis.engine.outputs import RequestOutput
from noesis.engine.request import RequestState
from noesis.engine.scheduler import Scheduler, SchedulerConfig
from noesis.engine.sequence import FinishReason, Sequence
from noesis.errors import ConfigError, InvalidRequest, PromptTooLong
from noesis.kv.allocator import PageAllocator
from noesis.kv.cache import KVPool, page_bytes
from noesis.kv.prefix_cache import PrefixCache
from noesis.models.rope import RotaryEmbedding
from noesis.runner.runner import LaunchedStep, ModelRunner
from noesis.sampling.params import SamplingParams
from noesis.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None  # bytes for the KV pool; default sized from the device
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory noesis may fill
    cuda_graphs: bool = True  # CUDA: capture decode steps at load
    max_graph_batch: int | None = None  # largest captured batch (default: min(max_num_seqs, 128))
    seed: int = 0  # seeds the per-request seeds of requests that bring none
    enable_prefix_caching: bool = False  # reuse KV pages of full-page prefixes across requests
    # Plan and launch the next step while the device still runs this one (default: on CUDA).
    # Steps whose sequences need their last token on the host (grammars, penalties) wait.
    overlap_steps: bool | None = None
    revision: str | None = None
    progress: bool = True


class Engine:
    def __init__(self, model: str, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded: LoadedModel = load_model(
            model, config.device, config.dtype, config.revision, config.progress
        )
        model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.device = self.loaded.device
        self.max_model_len = _max_model_len(config, model_config.max_position_embeddings)
        num_pages = self._num_pages()
        self.kv = KVPool(model_config, num_pages, config.page_size, self.loaded.dtype, self.device)
        self.allocator = PageAllocator(num_pages, config.page_size)
        # A length-dependent rope (dynamic NTK, longrope) rotates a prefix differently for
        # prompts of different lengths, so its pages cannot be shared between requests.
        length_dependent = model_config.rope.length_dependent
        self.prefix_caching = config.enable_prefix_caching and not length_dependent
        if config.enable_prefix_caching and not self.prefix_caching:
            logger.warning("prefix caching is off: %s rope depends on the sequence length",
                           model_config.rope.rope_type)
        self.prefix_cache = PrefixCache(self.allocator) if self.prefix_caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self.allocator,
            self.prefix_cache,
        )
        rope = RotaryEmbedding(
            model_config.rope, model_config.max_position_embeddings, self.max_model_len, self.device
        )
        self.runner = ModelRunner(
            self.loaded.model, self.kv, rope, self.device, self.max_model_len,
            max_num_seqs=config.max_num_seqs,
        )
        self.timings = {"load_s": self.loaded.load_seconds, "capture_s": 0.0}
        if self.device.type == "cuda" and config.cuda_graphs:
            max_batch = config.max_graph_batch or min(config.max_num_seqs, 128)
            self.timings["capture_s"] = self.runner.capture_graphs(max_batch)
        self.overlap = config.overlap_steps if config.overlap_steps is not None else (
            self.device.type == "cuda"
        )
        self._inflight: LaunchedStep | None = None  # launched, not read back (overlap mode)
        self._grammars = None  # GrammarCompiler, built on the first constrained request
        self._requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

    def _num_pages(self) -> int:
        cfg = self.config
        per_page = page_bytes(self.loaded.config, cfg.page_size, self.loaded.dtype)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.page_size)
        budget = cfg.kv_cache_memory
        if budget is None:
            budget = self._default_kv_budget()
            budget = min(budget, wanted * per_page)
        num_pages = budget // per_page
        if num_pages < 1:
            raise ConfigError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds no KV page "
                f"({per_page} bytes each); lower max_num_batched_tokens or the model size, or "
                "raise gpu_memory_utilization / kv_cache_memory"
            )
        return num_pages

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        if not 0.0 < self.config.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return int(total * self.config.gpu_memory_utilization) - used - self._activation_reserve()

    def _activation_reserve(self) -> int:
        """Peak activation bytes of the largest step, estimated generously, plus slack."""
        cfg, mc = self.config, self.loaded.config
        elem = torch.empty((), dtype=self.loaded.dtype).element_size()
        per_token = (mc.q_size + 2 * mc.kv_size + 3 * mc.intermediate_size + 4 * mc.hidden_size)
        logits = max(cfg.max_num_seqs, 128) * mc.vocab_size * 4 * 4  # logits + sampler temporaries
        return 2 * cfg.max_num_batched_tokens * per_token * elem + logits + (512 << 20)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stream: bool = True,
        delta: bool = False,
    ) -> str:
        """Queue a request. With stream=False, step() reports it only when it finishes and the
        text is decoded once at the end (unless stop strings need it token by token). With
        delta=True each output carries only the text, token ids and logprobs added since the
        request's previous output (what a server streams), not everything so far."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids, text = self._tokenize(prompt)
        seq = self._make_sequence(token_ids, params, request_id)
        self.scheduler.add(seq)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        state = RequestState(seq, text, detok, stream=stream, delta=delta)
        if params.logprobs is not None:
            state.logprobs = []
        self._requests[seq.request_id] = state
        return seq.request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids, text = list(prompt), None
        else:
            raise InvalidRequest("a prompt must be a string or a list of token ids")
        if not token_ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {vocab}): {bad[:10]}")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLong(len(token_ids), self.max_model_len)
        return token_ids, text

    def _make_sequence(
        self, token_ids: list[int], params: SamplingParams, request_id: str | None
    ) -> Sequence:
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else f"req-{seq_id}"
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, len(token_ids) + params.max_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(
            seq_id, request_id, token_ids, len(token_ids), params, limit, seed, frozenset(stop_ids)
        )
        if params.grammar is not None:
            seq.matcher = self.grammar_compiler().matcher(params.grammar)  # GrammarError: 400
        return seq

    def grammar_compiler(self):
        """The tokenizer's grammar compiler (llguidance), built once; its cache is shared."""
        if self._grammars is None:
            from noesis.structured.llguidance_backend import GrammarCompiler

            # Ends are the tokenizer's EOS ids, less Harmony's <|return|>/<|call|>: in a
            # Harmony turn grammar those are symbols of the grammar itself.
            self._grammars = GrammarCompiler.from_tokenizer(
                self.tokenizer, self.loaded.config.vocab_size
            )
        return self._grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, FinishReason.ABORT)
        return state.output()

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request in flight (shutdown, or a step that failed)."""
        return [out for out in map(self.abort, list(self._requests)) if out is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of the requests that advanced or finished.

        With overlapped steps the step planned here is launched before the previous one is read
        back, so the host's work (planning, input preparation, detokenizing, outputs) runs
        while the device computes; the outputs returned are the previous step's. A sequence
        that turns out to have stopped was planned one token too far: that token is dropped."""
        previous = self._inflight
        if previous is not None and not self._can_overlap(previous):
            self._inflight = None
            return self._complete(previous)
        plan = self.scheduler.schedule()
        launched = None
        if plan:
            launched = self.runner.launch(plan, previous)
            self.scheduler.advance(plan)
        # Held before the previous step is completed: should that fail, this one is not lost.
        self._inflight = launched if self.overlap else None
        outputs = self._complete(previous) if previous is not None else []
        if launched is not None and not self.overlap:
            outputs = self._complete(launched)
        return outputs

    @staticmethod
    def _can_overlap(previous: LaunchedStep) -> bool:
        """Whether the next step can be planned before `previous` is read back: not when one of
        its sequences needs the sampled token on the host to go on (its grammar state, its
        penalty counts)."""
        return not any(seq.matcher is not None or seq.params.needs_penalties
                       for seq in previous.seqs if not seq.finished)

    def _complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step back and turn it into request outputs."""
        plan = launched.plan
        sampled = self.runner.fetch(launched)
        took = self.scheduler.resolve(plan, {sid: tok.token_id for sid, tok in sampled.items()})
        self._advance_grammars(plan, sampled)
        advanced = [self._requests[seq.request_id] for seq in took]
        for state in advanced:
            if state.logprobs is not None:
                state.logprobs.append(sampled[state.seq.seq_id].logprobs)
        self._detokenize([s for s in advanced if s.incremental or s.seq.finished])
        outputs = []
        for state in advanced:
            seq = state.seq
            if state.stream or seq.finished:
                outputs.append(state.output())
            if seq.finished:
                del self._requests[seq.request_id]
        return outputs

    def _advance_grammars(self, plan, sampled) -> None:
        """Feed each constrained sequence its sampled token; a completed grammar ends the
        request. The mask allowed only tokens the grammar accepts, so a rejection is a bug: it
        ends that request and is logged, the step goes on."""
        for item in plan.scheduled:
            seq = item.seq
            if seq.matcher is None or seq.seq_id not in sampled or seq.finished:
                continue  # finished: by a stop token (which may close the match) or the length
            token = sampled[seq.seq_id].token_id
            if not seq.matcher.accept_token(token):  # a bug, but one request's, not the step's
                logger.error("grammar rejected sampled token %d of %s; request aborted",
                             token, seq.request_id)
                self.scheduler.finish(seq, FinishReason.ABORT)
            elif seq.matcher.is_terminated():
                self.scheduler.finish(seq, FinishReason.STOP)

    def _detokenize(self, states: list[RequestState]) -> None:
        """Decode what is new for each (everything, for a non-incremental request at its end);
        a stop string found here finishes its request. (One batched `decode_batch` call for all
        streams measured 9% slower at 128 streams on the H200 host: its thread pool costs more
        than 256 short decodes.)"""
        for state in states:
            seq = state.seq
            if state.append_text(state.detokenizer.step(seq.token_ids)):
                self.scheduler.finish(seq, FinishReason.STOP)
            elif seq.finished:
                state.append_text(state.detokenizer.flush(seq.token_ids))


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    if config.max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {config.max_model_len}")
    return config.max_model_len
