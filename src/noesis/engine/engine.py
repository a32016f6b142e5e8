"""Engine: owns the model, KV pool, scheduler and runner; `step()` is schedule -> run -> finish.

A failure that one request explains (its grammar, its logits, a step that fails only with it in
the batch) ends that request alone with finish_reason "error"; the rest of the batch goes on. A
failure no request explains raises EngineFault: the engine's state is then unknown.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from noesis.speculative.config import SpeculativeConfig
    from noesis.speculative.proposer import StepProposals
    from noesis.telemetry.observer import EngineObserver

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
    # Speculative decoding (noesis.speculative): a draft model or prompt lookup proposes tokens
    # that one target forward verifies; greedy output is unchanged, sampled output keeps the
    # target's distribution. None: off.
    speculative: SpeculativeConfig | None = None
    # Telemetry (noesis.telemetry): True collects per-step and per-request records in memory
    # (RequestOutput.metrics, the server's histograms); a path also writes them as JSON lines.
    telemetry: bool | str = False
    # Deterministic replay: record a trace at `trace` (model hashes, seeds, every step's batch
    # and tokens) that `noesis replay` reproduces token for token. A trace implies it.
    deterministic: bool = False
    trace: str | None = None

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
        if not isinstance(self.telemetry, (bool, str)) or self.telemetry == "":
            raise ConfigError(f"telemetry must be True, False or a file path, got "
                              f"{self.telemetry!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ConfigError(f"trace must be a file path, got {self.trace!r}")
        if self.deterministic and self.trace is None:
            raise ConfigError("deterministic mode records a trace: give its path (trace=PATH, "
                              "--trace PATH)")
        if self.speculative is not None:
            from noesis.speculative.config import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise ConfigError("speculative must be a noesis.SpeculativeConfig, got "
                                  f"{type(self.speculative).__name__}")


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
        if model_config.conv_layers and config.speculative is not None:
            raise ConfigError("speculative decoding is not supported for models with short-"
                              "convolution state (LFM2): it cannot step back over rejected "
                              "proposals")
        # Before the target's pool too: a draft model and its pool take their share first.
        self.speculator = self._speculator() if config.speculative is not None else None
        num_pages = self._num_pages()
        self.kv = KVPool(model_config, num_pages, config.page_size, self.loaded.dtype, self.device,
                         max_num_seqs=config.max_num_seqs)
        self.allocator = PageAllocator(num_pages, config.page_size)
        # A length-dependent rope (dynamic NTK, longrope) rotates a prefix differently for
        # prompts of different lengths, so its pages cannot be shared between requests.
        length_dependent = model_config.rope.length_dependent
        # A short-convolution layer's state (LFM2) is one per sequence, not per page: a
        # sequence starting from cached pages would have none for them.
        conv_state = bool(model_config.conv_layers)
        self.prefix_caching = (config.enable_prefix_caching and not length_dependent
                               and not conv_state)
        if config.enable_prefix_caching and not self.prefix_caching:
            reason = (f"{model_config.rope.rope_type} rope depends on the sequence length"
                      if length_dependent else "the short-convolution layers keep one state per "
                      "sequence, which cached pages do not carry")
            logger.warning("prefix caching is off: %s", reason)
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
        self.timings = {"load_s": self.loaded.load_seconds, **self.loaded.load_phases,
                        "capture_s": 0.0, "warmup_s": 0.0}
        if self.device.type == "cuda" and config.cuda_graphs:
            # A graph row is one query token: a verify row takes 1 + k of them.
            rows = 1 + (config.speculative.k if config.speculative is not None else 0)
            max_batch = config.max_graph_batch or min(config.max_num_seqs * rows, 128)
            self.timings["capture_s"] = self.runner.capture_graphs(max_batch)
            if self.speculator is not None:
                self.timings["capture_s"] += self.speculator.capture_graphs(max_batch)
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
        self.observer: EngineObserver | None = None
        if config.telemetry or config.trace:
            from noesis.telemetry.observer import EngineObserver

            self.observer = EngineObserver.build(self)

    def warm_up(self, new_tokens: int = 4) -> float:
        """Run one short greedy request through prefill and decode before serving (first-call
        costs paid, the allocator touched); books and returns its seconds. It is neither traced
        nor in the telemetry."""
        observer, self.observer = self.observer, None
        if observer is not None and observer.trace is not None:  # a replay warms up here too
            observer.trace.write({"kind": "warm_up", "step": observer.steps})
        prompt_len = max(1, min(16, self.max_model_len // 2))
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=max(1, min(new_tokens, self.max_model_len - prompt_len)))
        start = time.perf_counter()
        try:
            vocab = self.loaded.config.vocab_size
            prompt = [(7 * index + 1) % vocab for index in range(prompt_len)]
            self.add_request(prompt, params, request_id="noesis-warm-up", stream=False)
            while self.has_unfinished():
                self.step()
        finally:
            self.observer = observer
        self.timings["warmup_s"] = time.perf_counter() - start
        logger.info("engine warmed up: %s", format_timings(self.timings))
        return self.timings["warmup_s"]

    def timing_buckets(self) -> dict[str, float]:
        """Start-up seconds (load: prepare and weights, graph capture, warm-up) and, with telemetry
        on, the device seconds of prefill and decode steps and the host seconds of steps."""
        buckets = dict(self.timings)
        telemetry = self.observer.telemetry if self.observer is not None else None
        if telemetry is not None:
            totals = telemetry.totals
            buckets.update(prefill_s=totals["prefill_gpu_ms"] / 1e3,
                           decode_s=totals["decode_gpu_ms"] / 1e3,
                           host_s=totals["host_ms"] / 1e3, steps=totals["steps"])
        return buckets

    def close(self) -> None:
        """Flush and close the telemetry and trace files (the engine still works, unrecorded)."""
        if self.observer is not None:
            self.observer.close()
            self.observer = None
            self.runner.timing = False

    def _speculator(self):
        from noesis.speculative.speculator import Speculator

        budget = self.config.kv_cache_memory or self._default_kv_budget()
        return Speculator.build(self.config, self.loaded, self.max_model_len, budget)

    @property
    def spec_counts(self) -> dict[str, int]:
        """Speculative decoding's counters (verify rows, proposed and accepted tokens, requests
        excluded by reason); empty when it is off."""
        return dict(self.speculator.counts) if self.speculator is not None else {}

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
        if params.metrics:
            state.token_metrics = []
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
        if self.observer is not None:
            self.observer.admitted(state)

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
        self._release_speculation(state.seq)
        if self.observer is not None:
            self.observer.aborted(request_id)
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
        (With telemetry on, the step's host time, less the device's, is booked.)"""
        observer = self.observer
        if observer is None:
            return self._step()
        start, blocked = time.perf_counter(), observer.blocked_ms
        outputs = self._step()
        host_ms = (time.perf_counter() - start) * 1e3 - (observer.blocked_ms - blocked)
        observer.end_step(host_ms, idle=not self.has_unfinished())
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One engine step.

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
        proposals, num_drafts = self._propose()
        plan = self.scheduler.schedule(num_drafts)
        if proposals is not None and any(item.num_draft for item in plan.scheduled):
            plan.proposals = proposals
        launched = None
        if plan:
            try:
                launched = self._launch(plan, previous)
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

    def _launch(self, plan: StepPlan, previous: LaunchedStep | None) -> LaunchedStep:
        launched = self.runner.launch(plan, previous)
        if self.observer is not None:
            self.observer.launched(launched)
        return launched

    def _propose(self) -> tuple[StepProposals | None, dict[int, int]]:
        """This step's proposals (speculative decoding) and seq_id -> how many each may verify."""
        if self.speculator is None:
            return None, {}
        return self.speculator.propose(self.scheduler.running, self.runner.sampling_tensors)

    def _release_speculation(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)

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
                alone = StepPlan([item], proposals=plan.proposals)
                launched.append(self._launch(alone, previous))
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
        self._release_speculation(state.seq)
        state.error = message
        try:
            state.append_text(state.detokenizer.flush(state.seq.token_ids))
        except Exception:  # the text so far is a courtesy; the error is what matters
            pass
        if self.observer is not None:
            self.observer.finished(state)
        self._ended.append(state.output())

    def _take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

    def _can_overlap(self, previous: LaunchedStep) -> bool:
        """Whether the next step can be planned before `previous` is read back: not when one of
        its sequences needs the sampled token on the host to go on (its grammar state, its
        penalty counts, its next proposals) or the step verified proposals."""
        if previous.spec_width:
            return False
        spec = self.speculator
        return not any(seq.matcher is not None or seq.params.needs_penalties
                       or (spec is not None and spec.wants(seq))
                       for seq in previous.seqs if not seq.finished)

    def _complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step back and turn it into request outputs."""
        plan = launched.plan
        sampled = self.runner.fetch(launched)
        observer = self.observer
        if observer is not None:
            lengths = {seq.seq_id: len(seq.token_ids) for seq in launched.seqs}
        self._drop_unusable_rows(launched, sampled)
        accepted = {sid: tok.accepted for sid, tok in sampled.items() if tok.accepted}
        took = self.scheduler.resolve(
            plan, {sid: tok.token_id for sid, tok in sampled.items()}, accepted
        )
        self._book_speculation(launched, sampled)
        self._advance_grammars(plan, sampled)
        requests = self._requests
        advanced = [requests[seq.request_id] for seq in took if seq.request_id in requests]
        for state in advanced:
            if state.logprobs is not None:
                state.logprobs.append(sampled[state.seq.seq_id].logprobs)
            if state.token_metrics is not None:  # one per token: none for accepted proposals
                token = sampled[state.seq.seq_id]
                state.token_metrics += [None] * len(token.accepted) + [token.metrics]
                del state.token_metrics[len(state.seq.token_ids) - state.seq.prompt_len :]
        self._detokenize([s for s in advanced if s.incremental or s.seq.finished])
        if observer is not None:
            observer.completed(launched, lengths, sampled)
        outputs = []
        for state in advanced:
            seq = state.seq
            if state.error is not None:
                continue  # failed while this step was read: its output is in self._ended
            if seq.finished and observer is not None:
                observer.finished(state)
            if state.stream or seq.finished:
                outputs.append(state.output())
            if seq.finished:
                del self._requests[seq.request_id]
                self._release_speculation(seq)
        return outputs

    def _book_speculation(self, launched: LaunchedStep, sampled: dict) -> None:
        """Each sampled row's outcome to its depth controller and the counters."""
        if self.speculator is None:
            return
        for seq in launched.seqs:
            token = sampled.get(seq.seq_id)
            if token is not None:
                self.speculator.record(seq, token.proposed, len(token.accepted))

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
                if self._append_new_text(state):
                    self.scheduler.finish(seq, FinishReason.STOP)
                elif seq.finished:
                    state.append_text(state.detokenizer.flush(seq.token_ids))
            except Exception as exc:
                self.fail_request(seq.request_id, f"decoding its tokens failed: {exc!r}")

    @staticmethod
    def _append_new_text(state: RequestState) -> bool:
        """Decode the new tokens; True when a stop string ended the request. Several new tokens
        (accepted proposals) with stop strings are decoded one at a time, as plain steps would
        be: the tokens after the one that completed a stop string are dropped."""
        ids, detokenizer = state.seq.token_ids, state.detokenizer
        if not state.seq.params.stop or len(ids) - detokenizer.read_offset <= 1:
            return state.append_text(detokenizer.step(ids))
        for end in range(detokenizer.read_offset + 1, len(ids) + 1):
            if state.append_text(detokenizer.step(ids[:end])):
                del ids[end:]
                return True
        return False


def format_timings(timings: dict[str, float]) -> str:
    """Start-up buckets on one line: 'load 1.20 s (prepare 0.10 s, weights 1.10 s), ...'."""
    parts = [f"load {timings['load_s']:.2f} s"]
    if "prepare_s" in timings:
        parts[0] += f" (prepare {timings['prepare_s']:.2f} s, weights {timings['weights_s']:.2f} s)"
    parts.append(f"graph capture {timings['capture_s']:.2f} s")
    parts.append(f"warm-up {timings['warmup_s']:.2f} s")
    return ", ".join(parts)


def _grammar_detail(matcher) -> str:
    """The matcher's own account of its error state, as a suffix (empty when it has none)."""
    error = matcher.error()
    return f" ({error})" if error else ""


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    return config.max_model_len  # >= 2: EngineConfig checked it
