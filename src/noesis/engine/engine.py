"""Engine: owns the model, KV pool, scheduler and runner; `step()` is schedule -> run -> finish.

A failure that one request explains (its grammar, its logits, a step that fails only with it in
the batch) ends that request alone with finish_reason "error"; the rest of the batch goes on. A
failure no request explains raises EngineFault: the engine's state is then unknown.
"""

from __future__ import annotations

import itertools
import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from noesis.engine.loading import LoadedModel, load_model
from noesis.engine.outputs import RequestOutput
from noesis.engine.request import RequestState
from noesis.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from noesis.engine.sequence import FinishReason, Sequence
from noesis.errors import ConfigError, InvalidRequest, NoesisError, PromptTooLong, check_count
from noesis.kv.allocator import PageAllocator
from noesis.kv.cache import KVPool, page_bytes
from noesis.kv.prefix_cache import PrefixCache
from noesis.models.rope import RotaryEmbedding
from noesis.runner.runner import LaunchedStep, ModelRunner
from noesis.sampling.params import INT64_MAX, SamplingParams
from noesis.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
# Steps in a row that failed with a single sequence (which then failed alone) before the failure
# is taken for the engine's own rather than those requests'.
MAX_LONE_FAILURES = 3


class EngineFault(NoesisError):
    """A failure that no single request explains (the device, the model, a bug): every request
    in flight is lost, and the engine should be rebuilt before it serves again."""


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

    def __post_init__(self) -> None:
        # Sizes end up in int64 tensors: whole numbers below 2^63.
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            check_count(name, getattr(self, name), 1, INT64_MAX)
        for name in ("max_model_len", "kv_cache_memory", "max_graph_batch"):
            if getattr(self, name) is not None:
                lo = 2 if name == "max_model_len" else 1
                check_count(name, getattr(self, name), lo, INT64_MAX)
        check_count("seed", self.seed, 0, INT64_MAX)
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")


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
        # Before the KV pool: on CUDA the pool takes what is free, so the tables come first.
        rope = RotaryEmbedding(
            model_config.rope, model_config.max_position_embeddings, self.max_model_len, self.device
        )
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
        # Requests waiting for their grammar to compile (off this thread): no batch slot, no
        # pages; they join the scheduler when poll_compiles() finds their compile done.
        self._compiling: dict[str, tuple[RequestState, Future]] = {}
        self._ended: list[RequestOutput] = []  # requests failed outside a step's own outputs
        self._lone_failures = 0  # consecutive failed one-sequence steps
        self.fault_counts = {"isolated_steps": 0, "request_errors": 0}
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
        wait_for_grammar: bool = True,
    ) -> str:
        """Queue a request. With stream=False, step() reports it only when it finishes and the
        text is decoded once at the end (unless stop strings need it token by token). With
        delta=True each output carries only the text, token ids and logprobs added since the
        request's previous output (what a server streams), not everything so far.

        A grammar compiles on a worker thread. With wait_for_grammar (the default) this call
        waits for it and raises its GrammarError; without, a grammar that is not cached yet
        leaves the request compiling: `poll_compiles()` later admits or rejects it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids, text = self._tokenize(prompt)
        seq = self._make_sequence(token_ids, params, request_id)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        state = RequestState(seq, text, detok, stream=stream, delta=delta)
        if params.logprobs is not None:
            state.logprobs = []
        if params.grammar is None:
            self._admit(state, None)
            return seq.request_id
        compiled = self.grammar_compiler().submit(params.grammar)  # GrammarError: 400
        if wait_for_grammar or compiled.done():
            self._admit(state, compiled.result())
        else:
            self._compiling[seq.request_id] = (state, compiled)
        return seq.request_id

    def _admit(self, state: RequestState, grammar) -> None:
        if grammar is not None:
            state.seq.matcher = grammar.new_matcher()
        self.scheduler.add(state.seq)  # OutOfKVCache
        self._requests[state.seq.request_id] = state

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    def poll_compiles(self) -> tuple[list[str], list[tuple[str, BaseException]]]:
        """Admit the compiling requests whose grammar is ready: (admitted ids, (id, error) of
        those whose grammar or admission failed)."""
        admitted, rejected = [], []
        for request_id, (state, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            try:
                self._admit(state, compiled.result())
            except Exception as exc:
                rejected.append((request_id, exc))
            else:
                admitted.append(request_id)
        return admitted, rejected

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
        if request_id in self._requests or request_id in self._compiling:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, len(token_ids) + params.max_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Sequence(
            seq_id, request_id, token_ids, len(token_ids), params, limit, seed, frozenset(stop_ids)
        )

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

    def grammar_stats(self) -> dict[str, int]:
        """The grammar compiler's cache and compile counters (empty before the first grammar)."""
        return self._grammars.stats() if self._grammars is not None else {}

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._requests.pop(request_id, None)
        if state is None:
            compiling = self._compiling.pop(request_id, None)
            if compiling is None:
                return None
            state = compiling[0]
        self.scheduler.finish(state.seq, FinishReason.ABORT)
        return state.output()

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request in flight (shutdown, or a step that failed)."""
        self._inflight = None
        self._ended = []
        ids = [*self._requests, *self._compiling]
        return [out for out in map(self.abort, ids) if out is not None]

    def has_unfinished(self) -> bool:
        """Whether step() has work: sequences to run, a step to read back, failures to report
        (not the compiling requests: poll_compiles() admits those)."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._ended)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of the requests that advanced or finished.

        With overlapped steps the step planned here is launched before the previous one is read
        back, so the host's work (planning, input preparation, detokenizing, outputs) runs
        while the device computes; the outputs returned are the previous step's. A sequence
        that turns out to have stopped was planned one token too far: that token is dropped.

        Raises EngineFault (or what the device raised) when the step fails for no one request."""
        outputs = self._take_ended()
        previous = self._inflight
        if previous is not None and not self._can_overlap(previous):
            self._inflight = None
            return outputs + self._complete(previous)
        plan = self.scheduler.schedule()
        launched = None
        if plan:
            try:
                launched = self.runner.launch(plan, previous)
            except Exception as exc:
                return outputs + self._isolate(plan, previous, exc)
            self._lone_failures = 0
            self.scheduler.advance(plan)
        # Held before the previous step is completed: should that fail, this one is not lost.
        self._inflight = launched if self.overlap else None
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None and not self.overlap:
            outputs += self._complete(launched)
        return outputs + self._take_ended()

    def _isolate(
        self, plan: StepPlan, previous: LaunchedStep | None, error: Exception
    ) -> list[RequestOutput]:
        """A step failed: run each of its sequences alone. Those that fail alone end with an
        error; the others go on with what their own run sampled. When all fail alone, no
        request explains it: EngineFault."""
        logger.warning("engine step of %d sequences failed (%r); running them one at a time",
                       len(plan.scheduled), error)
        self.fault_counts["isolated_steps"] += 1
        self._inflight = None
        launched, culprits = [], []
        for item in plan.scheduled:
            try:
                launched.append(self.runner.launch(StepPlan([item]), previous))
            except Exception as exc:
                culprits.append((item.seq, exc))
        lone = len(plan.scheduled) == 1
        self._lone_failures = self._lone_failures + 1 if lone and culprits else 0
        if (not launched and not lone) or self._lone_failures >= MAX_LONE_FAILURES:
            message = f"an engine step failed for every request in it: {error!r}"
            raise EngineFault(message) from error
        for one in launched:
            self.scheduler.advance(one.plan)
        outputs = self._complete(previous) if previous is not None else []
        for seq, exc in culprits:  # after `previous`: their outputs keep its tokens
            self.fail_request(seq.request_id, f"the engine step failed on this request: {exc!r}")
        for one in launched:
            outputs += self._complete(one)
        return outputs + self._take_ended()

    def fail_request(self, request_id: str, message: str) -> None:
        """End one request with finish_reason "error" and `message`; the others go on. Its
        output comes with the next step's."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        logger.warning("request %s failed: %s", request_id, message)
        self.fault_counts["request_errors"] += 1
        self.scheduler.finish(state.seq, FinishReason.ERROR)
        state.error = message
        try:
            state.append_text(state.detokenizer.flush(state.seq.token_ids))
        except Exception:  # the text so far is a courtesy; the error is what matters
            pass
        self._ended.append(state.output())

    def _take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

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
        self._drop_unusable_rows(launched, sampled)
        took = self.scheduler.resolve(plan, {sid: tok.token_id for sid, tok in sampled.items()})
        self._advance_grammars(plan, sampled)
        requests = self._requests
        advanced = [requests[seq.request_id] for seq in took if seq.request_id in requests]
        for state in advanced:
            if state.logprobs is not None:
                state.logprobs.append(sampled[state.seq.seq_id].logprobs)
        self._detokenize([s for s in advanced if s.incremental or s.seq.finished])
        outputs = []
        for state in advanced:
            seq = state.seq
            if state.error is not None:
                continue  # failed while this step was read: its output is in self._ended
            if state.stream or seq.finished:
                outputs.append(state.output())
            if seq.finished:
                del self._requests[seq.request_id]
        return outputs

    def _drop_unusable_rows(self, launched: LaunchedStep, sampled: dict) -> None:
        """Rows the sampler marked -1 (NaN or inf logits, or a mask that allowed nothing) end
        their request with an error; their token never joins the sequence."""
        for seq in launched.seqs:
            token = sampled.get(seq.seq_id)
            if token is None or token.token_id >= 0 or seq.finished:
                continue
            del sampled[seq.seq_id]
            why = "its logits were not finite (NaN or inf)"
            if seq.matcher is not None:
                why += f", or its grammar allowed no token{_grammar_detail(seq.matcher)}"
            self.fail_request(seq.request_id, why)

    def _advance_grammars(self, plan, sampled) -> None:
        """Feed each constrained sequence its sampled token; a completed grammar ends the
        request. The mask allowed only tokens the grammar accepts, so a rejection (or a matcher
        that raises) is a bug, but that request's alone: it ends with an error, the step goes
        on."""
        for item in plan.scheduled:
            seq = item.seq
            if seq.matcher is None or seq.seq_id not in sampled or seq.finished:
                continue  # finished: by a stop token (which may close the match) or the length
            token = sampled[seq.seq_id].token_id
            try:
                accepted = seq.matcher.accept_token(token)
                terminated = accepted and seq.matcher.is_terminated()
            except Exception as exc:
                self.fail_request(seq.request_id, f"its grammar matcher failed: {exc!r}")
                continue
            if not accepted:
                detail = _grammar_detail(seq.matcher)
                self.fail_request(seq.request_id,
                                  f"its grammar rejected the sampled token {token}{detail}")
            elif terminated:
                self.scheduler.finish(seq, FinishReason.STOP)

    def _detokenize(self, states: list[RequestState]) -> None:
        """Decode what is new for each (everything, for a non-incremental request at its end);
        a stop string found here finishes its request. (One batched `decode_batch` call for all
        streams measured 9% slower at 128 streams on the H200 host: its thread pool costs more
        than 256 short decodes.)"""
        for state in states:
            seq = state.seq
            try:
                if state.append_text(state.detokenizer.step(seq.token_ids)):
                    self.scheduler.finish(seq, FinishReason.STOP)
                elif seq.finished:
                    state.append_text(state.detokenizer.flush(seq.token_ids))
            except Exception as exc:
                self.fail_request(seq.request_id, f"decoding its tokens failed: {exc!r}")


def _grammar_detail(matcher) -> str:
    """The matcher's own account of its error state, as a suffix (empty when it has none)."""
    error = matcher.error()
    return f" ({error})" if error else ""


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    return config.max_model_len  # >= 2: EngineConfig checked it
