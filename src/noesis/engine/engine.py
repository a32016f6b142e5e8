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
from typing import TYPE_CHECKING, Any

import torch

from noesis.control.knobs import TokenControl, start_phi
from noesis.control.policy import make_policy
from noesis.engine.config import EngineConfig
from noesis.engine.loading import LoadedModel, load_model
from noesis.engine.outputs import RequestOutput
from noesis.engine.request import RequestState
from noesis.errors import (
    ConfigError,
    InvalidRequest,
    InvalidSamplingParams,
    NoesisError,
    PromptTooLong,
)
from noesis.kv.allocator import PageAllocator
from noesis.kv.cache import KVPool, page_bytes
from noesis.kv.fp8 import cache_dtype
from noesis.kv.prefix_cache import PrefixCache
from noesis.models.rope import RotaryEmbedding
from noesis.planner.scheduler import Scheduler, SchedulerConfig, StepPlan
from noesis.planner.sequence import FinishReason, Sequence
from noesis.runner.runner import LaunchedStep, ModelRunner
from noesis.sampling.params import SamplingParams
from noesis.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from collections.abc import Callable

    from noesis.control.policy import ControlPolicy
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


class Engine:
    def __init__(self, model: str, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.parallel = None  # TensorParallel: this engine is rank 0 of several
        if config.tensor_parallel_size > 1:
            from noesis.distributed.launch import TensorParallel

            self.parallel = TensorParallel(model, config)
            self.loaded: LoadedModel = self.parallel.load(model, config)
        else:
            self.loaded = load_model(
                model, config.device, config.dtype, config.revision, config.progress,
                gguf_weights=config.gguf_weights, capabilities=config.capabilities,
            )
        model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.device = self.loaded.device
        # The batch and step sizes left to the device are settled now that it is known.
        self.config = config = config.for_device(self.device.type)
        if self.device.type == "cuda":
            from noesis.kernels import ops

            ops.configure(config.triton_kernels, config.one_row_fusion, config.pdl)
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
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.loaded.dtype)
        num_pages = self._num_pages()
        self.kv = KVPool(model_config, num_pages, config.page_size, self.kv_dtype, self.device,
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
        make_runner = ModelRunner if self.parallel is None else self.parallel.runner
        self.runner = make_runner(
            self.loaded.model, self.kv, rope, self.device, self.max_model_len,
            max_num_seqs=config.max_num_seqs,
        )
        if config.batch_invariant:  # before graph capture: the graphs record its kernels
            self._batch_invariant()
        if config.kv_cache_dtype == "fp8":  # before graph capture too
            from noesis.runner import fp8_attention

            fp8_attention.enable(self.runner, self.tokenizer, self.loaded.dtype)
        self.timings = {"load_s": self.loaded.load_seconds, **self.loaded.load_phases,
                        "capture_s": 0.0, "warmup_s": 0.0}
        if self.device.type == "cuda" and config.cuda_graphs and self.parallel is None:
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
        # Side models (noesis.sidecars.SidecarRuntime): handed each step's outputs without
        # waiting; the results that arrived since the step before are in `sidecar_results`.
        self.sidecars = config.sidecars.build() if config.sidecars is not None else None
        self.sidecar_results: list = []
        self.branches = None  # noesis.control.branches.BranchGate, from the first add_branches
        self._unreported: list[RequestOutput] = []  # unstreamed requests' progress, for sidecars
        # The control plane's per-token knobs (noesis.control.knobs): the engine's policy for
        # requests that allow it, or a conversation's own (SamplingParams.control).
        self.control = TokenControl(None if config.control in (None, "none")
                                    else make_policy(config.control))  # fmt: skip
        if config.telemetry or config.trace:
            from noesis.telemetry.observer import EngineObserver

            self.observer = EngineObserver.build(self)

    def warm_up(self, new_tokens: int = 4) -> float:
        """Run one short greedy request through prefill and decode before serving (first-call
        costs paid, the allocator touched); books and returns its seconds. It is neither traced
        nor in the telemetry, nor shown to the sidecars."""
        observer, self.observer = self.observer, None
        sidecars, self.sidecars = self.sidecars, None
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
            self.observer, self.sidecars = observer, sidecars
        self.timings["warmup_s"] = time.perf_counter() - start
        logger.info("engine warmed up: %s", format_timings(self.timings))
        return self.timings["warmup_s"]

    def timing_buckets(self) -> dict[str, float]:
        """Start-up seconds (load: read and place, graph capture, warm-up) and, with telemetry
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

    def _batch_invariant(self) -> None:
        from noesis.runner import batch_invariant

        if self.parallel is not None or self.speculator is not None:
            raise ConfigError("batch_invariant covers one device without speculative decoding: "
                              "drop tensor_parallel_size or the speculative options")
        batch_invariant.enable(self.runner)

    def _speculator(self):
        from noesis.speculative.speculator import Speculator

        budget = self.config.kv_cache_memory or self._default_kv_budget()
        return Speculator.build(self.config, self.loaded, self.max_model_len, budget)

    @property
    def spec_counts(self) -> dict[str, int]:
        """Speculative decoding's counters (verify rows, proposed and accepted tokens, rows
        that sampled and the tokens they added: speculative.speculator); empty when off."""
        return dict(self.speculator.counts) if self.speculator is not None else {}

    @property
    def spec_channels(self) -> dict[str, dict[str, int]]:
        """The same counters per output channel (speculative.channels); empty when off."""
        spec = self.speculator
        return {k: dict(v) for k, v in spec.channels.items()} if spec is not None else {}

    def _num_pages(self) -> int:
        cfg = self.config
        per_page = page_bytes(self.loaded.config, cfg.page_size, self.kv_dtype)
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
        self._check_logit_bias(params)
        seq = self._make_sequence(token_ids, params, request_id)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        state = RequestState(seq, text, detok, stream=stream, delta=delta)
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it
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

    def _tokenize(self, prompt: str | list[int], room: int = 1) -> tuple[list[int], str | None]:
        """Token ids (and the text) of a prompt that leaves `room` tokens of the context free."""
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
        if len(token_ids) + room > self.max_model_len:
            raise PromptTooLong(len(token_ids), self.max_model_len)
        return token_ids, text

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.loaded.config.vocab_size
        bad = [token for token, _ in params.logit_bias or () if token >= vocab]
        if bad:
            message = f"token ids out of the vocabulary [0, {vocab}): {bad[:10]}"
            raise InvalidSamplingParams("logit_bias", message)

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
        seq = Sequence(
            seq_id, request_id, token_ids, len(token_ids), params, limit, seed, frozenset(stop_ids)
        )
        seq.knobs = self.control.knobs(params)
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

    def embed(self, prompts: list[str | list[int]], pooling: str = "last") -> torch.Tensor:
        """Normalized pooled final hidden states [N, D] (float32, host) of whole prompts: the
        last token's ("last") or the mean over tokens ("mean"). Runs the loaded model now, on
        the caller's thread, so call it between steps (noesis.runner.pooling)."""
        from noesis.runner.pooling import pooled_hidden

        if not prompts:
            raise InvalidRequest("nothing to embed: give at least one prompt")
        if self.parallel is not None:
            raise ConfigError("embeddings are not supported with tensor parallelism yet")
        # A prompt to embed may fill the context: nothing is generated after it.
        token_ids = [self._tokenize(prompt, room=0)[0] for prompt in prompts]
        budget = self.config.max_num_batched_tokens
        return pooled_hidden(self.runner, token_ids, pooling, budget)

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of the requests that advanced or finished.
        (With telemetry on, the step's host time, less the device's, is booked.)"""
        observer = self.observer
        if observer is None:
            return self._check_branches(self._to_sidecars(self._step()))
        start, blocked = time.perf_counter(), observer.blocked_ms
        outputs = self._check_branches(self._to_sidecars(self._step()))
        host_ms = (time.perf_counter() - start) * 1e3 - (observer.blocked_ms - blocked)
        observer.end_step(host_ms, idle=not self.has_unfinished())
        return outputs

    def _to_sidecars(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand the step's outputs (and the unstreamed requests' progress, which only sidecars
        see) to the sidecars; end the requests their results block."""
        if self.sidecars is None:
            return outputs
        unreported, self._unreported = self._unreported, []
        self.sidecar_results = self.sidecars.after_step(outputs + unreported)
        for result in self.sidecar_results:
            if result.decision == "block":
                self.filter_request(result.request_id, result.reason)
        if self.observer is not None and self.observer.telemetry is not None:
            self.observer.telemetry.sidecars(self.sidecars.stats())
        return outputs

    def add_branches(self, request_ids: list[str], keep: int,
                     tools: list[dict] | None = None, context: str | None = None,
                     policy: ControlPolicy | None = None) -> bool:
        """Declare requests already added (each with SamplingParams(metrics=True)) as branches
        of one request of which `keep` must finish: the control policy's binding gate
        (noesis.control.branches) may stop the others early, finish_reason "pruned". `tools`
        (OpenAI format) lets it check the branches' tool arguments; `context` (the last user
        message) is what the contradiction sidecar compares their answers with; `policy` (a
        conversation's) gates them instead of the engine's. False when there is nothing to
        gate: no control policy, or too few branches still running."""
        policy = policy or self.control.policy
        if policy is None:
            return False
        if len(set(request_ids)) != len(request_ids):
            raise InvalidRequest("branch request ids must differ")
        running = {**self._requests, **{rid: c[0] for rid, c in self._compiling.items()}}
        ids = [rid for rid in request_ids if rid in running]
        if len(ids) <= keep:
            return False
        if any(running[rid].token_metrics is None for rid in ids):
            raise InvalidRequest("branches need SamplingParams(metrics=True): the gate scores "
                                 "their entropy")
        if self.branches is None:
            from noesis.control.branches import BranchGate
            from noesis.turns import harmony_encoding

            self.branches = BranchGate(harmony_encoding(self.tokenizer))
        params = running[ids[0]].seq.params
        states = {rid: running[rid] for rid in ids}
        self.branches.add(states, keep, policy, policy.begin(start_phi(params)), tools)
        lane = self.sidecars.lanes.get("contradiction") if self.sidecars is not None else None
        if lane is not None:
            lane.sidecar.show(ids, context)
        return True

    def _check_branches(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The branch groups' gate after a step: the branches it prunes end now (their outputs
        come with the next step's, like a sidecar's block)."""
        gate = self.branches
        if gate is None or not gate.groups:
            return outputs
        scores = {}
        if self.sidecar_results:
            from noesis.sidecars.contradiction import latest_scores

            scores = latest_scores(self.sidecar_results)
        for rid in gate.observe(scores, self._compiling):
            self.prune_request(rid)
        return outputs

    def prune_request(self, request_id: str) -> None:
        """End one branch with finish_reason "pruned" (the binding gate stopped it)."""
        if self._end_early(request_id, FinishReason.PRUNED):
            logger.debug("branch %s pruned", request_id)

    def show_turn(self, request_id: str, messages: list[dict], tools: list[dict] | None,
                  on_intent: Callable[[str], Any] | None = None) -> None:
        """Show the sidecars an admitted turn's last user message and declared tools (the
        intent sidecar guesses the tool it will call, and tells `on_intent`: the turn loop's
        ToolExecutor.warm); never waits. Nothing for a request that is not running (one the
        server's add rejected)."""
        if self.sidecars is None or not tools:
            return
        if request_id not in self._requests and request_id not in self._compiling:
            return
        from noesis.structured.grounding import user_texts

        texts = user_texts(messages)  # latest first
        if texts:
            self.sidecars.offer_turn(request_id, texts[0], tools, on_intent)

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
        launched, read_back = None, _ReadBack(self, previous, plan)
        if plan:
            try:
                launched = self._launch(plan, previous, read_back.hook)
            except EngineFault:  # no request explains it (a tensor-parallel rank died)
                raise
            except Exception as exc:
                if read_back.failed:  # the previous step's read-back raised, not this step
                    raise
                if read_back.outputs is None:
                    return outputs + self._isolate(plan, previous, exc)
                return outputs + read_back.outputs + self._isolate(plan, None, exc)
            self._lone_failures = 0
            self.scheduler.advance(plan)
        # Held before the previous step is completed: should that fail, this one is not lost.
        self._inflight = launched if self.overlap else None
        if read_back.outputs is not None:
            outputs += read_back.outputs
        elif previous is not None:
            outputs += self._complete(previous)
        if launched is not None and not self.overlap:
            outputs += self._complete(launched)
        return outputs + self._take_ended()

    def _launch(
        self, plan: StepPlan, previous: LaunchedStep | None, read_back=None
    ) -> LaunchedStep:
        if read_back is None:
            launched = self.runner.launch(plan, previous)
        else:
            launched = self.runner.launch(plan, previous, read_back=read_back)
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
        read = []
        if previous is not None and _ReadBack(self, previous, plan).hook is not None:
            read, previous = self._complete(previous), None  # the grammars need its tokens
        launched, culprits = [], []
        for item in plan.scheduled:
            if item.seq.finished:  # by the step just read back: nothing left to run
                continue
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
        outputs = read + (self._complete(previous) if previous is not None else [])
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

    def filter_request(self, request_id: str, reason: str) -> None:
        """End one request with finish_reason "content_filter" and `reason` (a sidecar blocked
        it); the text it already streamed stays streamed. Its output comes with the next step's."""
        if self._end_early(request_id, FinishReason.CONTENT_FILTER, reason):
            logger.info("request %s blocked: %s", request_id, reason)

    def _end_early(self, request_id: str, why: FinishReason, reason: str | None = None) -> bool:
        """End a running request by a decision outside its own decoding (a sidecar's block, the
        gate's prune); its output comes with the next step's. False when it had already ended."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False  # finished or ended before the decision came
        self.scheduler.finish(state.seq, why)
        self._release_speculation(state.seq)
        state.filter_reason = reason
        if self.observer is not None:
            self.observer.finished(state)
        self._ended.append(state.output())
        return True

    def _take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

    def _can_overlap(self, previous: LaunchedStep) -> bool:
        """Whether the next step can be planned before `previous` is read back: not when one of
        its sequences needs the sampled token on the host to go on (its next proposals) or the
        step verified proposals."""
        if previous.spec_width:
            return False
        spec = self.speculator
        # A grammar's next mask and a penalized row's counts need the token too, but only the
        # sampler waits for them: the runner reads `previous` back after queueing the forward
        # (see _ReadBack).
        return spec is None or not any(spec.wants(seq) for seq in previous.seqs
                                       if not seq.finished)

    def _complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step back and turn it into request outputs."""
        plan = launched.plan
        sampled = self.runner.fetch(launched)
        if launched.prompt_logprobs:
            self._add_prompt_logprobs(launched.prompt_logprobs)
        observer = self.observer
        if observer is not None:
            lengths = {seq.seq_id: len(seq.token_ids) for seq in launched.seqs}
        self._drop_unusable_rows(launched, sampled)
        chained = self._advance_grammar_chains(launched, sampled)
        accepted = {sid: tok.accepted for sid, tok in sampled.items() if tok.accepted}
        took = self.scheduler.resolve(
            plan, {sid: tok.token_id for sid, tok in sampled.items()}, accepted
        )
        self._book_speculation(launched, sampled)
        self._advance_grammars(plan, sampled, chained)
        _steer(launched, sampled)
        requests = self._requests
        advanced = [requests[seq.request_id] for seq in took if seq.request_id in requests]
        for state in advanced:
            if state.logprobs is not None:  # one per token, cut where the chain stopped
                token = sampled[state.seq.seq_id]
                state.logprobs += [*token.accepted_logprobs, token.logprobs]
                del state.logprobs[len(state.seq.token_ids) - state.seq.prompt_len :]
            if state.token_metrics is not None:  # one per token: none for accepted proposals
                token = sampled[state.seq.seq_id]
                state.token_metrics += [None] * len(token.accepted) + [token.metrics]
                del state.token_metrics[len(state.seq.token_ids) - state.seq.prompt_len :]
        watched = self.sidecars is not None  # sidecars read every request's text as it grows
        self._detokenize([s for s in advanced if s.incremental or s.seq.finished or watched])
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
            elif watched and not state.delta:
                self._unreported.append(state.output())
            if seq.finished:
                del self._requests[seq.request_id]
                self._release_speculation(seq)
        return outputs

    def _add_prompt_logprobs(self, scored: list) -> None:
        """Each scored chunk's prompt logprobs to its request, in prompt order; a prompt
        computed again after a preemption adds nothing it has already."""
        for seq, first, entries in scored:
            state = self._requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            have = len(state.prompt_logprobs)
            if first <= have:
                state.prompt_logprobs += entries[have - first :]

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

    def _advance_grammar_chains(self, launched: LaunchedStep, sampled: dict) -> dict[int, bool]:
        """Verify rows with a grammar, before their tokens join the sequence: feed the matcher
        the accepted proposals and the token after them, and cut the chain after a token that
        completes the match (the request ends there, as plain steps would end it). Returns
        seq_id -> whether the match completed, for `_advance_grammars` to finish those."""
        chained = {}
        for seq in launched.seqs:
            token = sampled.get(seq.seq_id)
            if seq.matcher is None or token is None or not token.proposed or seq.finished:
                continue
            chain = [*token.accepted, token.token_id]
            taken = self._feed_grammar(seq, chain)
            if taken is None:
                continue  # the request failed
            if taken < len(chain):
                _cut_chain(token, taken)
            chained[seq.seq_id] = seq.matcher.is_terminated()
        return chained

    def _feed_grammar(self, seq: Sequence, tokens: list[int]) -> int | None:
        """Feed tokens until one completes the match; how many it took (None: the matcher
        refused one or raised, and the request ended with an error, as in _advance_grammars)."""
        for taken, token in enumerate(tokens, start=1):
            try:
                accepted = seq.matcher.accept_token(token)
            except Exception as exc:
                self.fail_request(seq.request_id, f"its grammar matcher failed: {exc!r}")
                return None
            if not accepted:
                self.fail_request(seq.request_id, f"its grammar rejected the verified token "
                                                  f"{token}{_grammar_detail(seq.matcher)}")
                return None
            if seq.matcher.is_terminated():
                return taken
        return len(tokens)

    def _advance_grammars(self, plan, sampled, chained: dict[int, bool]) -> None:
        """Feed each constrained sequence its sampled token; a completed grammar ends the
        request. The mask allowed only tokens the grammar accepts, so a rejection (or a matcher
        that raises) is a bug, but that request's alone: it ends with an error, the step goes
        on. `chained`: verify rows, fed already (seq_id -> whether the match completed)."""
        for item in plan.scheduled:
            seq = item.seq
            if seq.matcher is None or seq.seq_id not in sampled or seq.finished:
                continue  # finished: by a stop token (which may close the match) or the length
            if seq.seq_id in chained:
                if chained[seq.seq_id]:
                    self.scheduler.finish(seq, FinishReason.STOP)
                continue
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
    """Start-up buckets on one line: 'load 1.20 s (read 0.90 s, place 0.30 s), ...'."""
    parts = [f"load {timings['load_s']:.2f} s"]
    if "read_s" in timings:
        parts[0] += f" (read {timings['read_s']:.2f} s, place {timings['place_s']:.2f} s)"
    parts.append(f"graph capture {timings['capture_s']:.2f} s")
    parts.append(f"warm-up {timings['warmup_s']:.2f} s")
    return ", ".join(parts)


def _steer(launched: LaunchedStep, sampled: dict) -> None:
    """Each controlled row's metrics to its knobs, read by the next step planned (with
    overlapped steps, the one after the step already in flight). Verify rows have no metrics.
    A Python loop over rows: a numpy version over all rows of a step (tried 2026-11-25) cost
    more on the H100's host (4.1 us per row at batch 64 against 3.2)."""
    for seq in launched.seqs:
        token = sampled.get(seq.seq_id)
        if seq.knobs is not None and token is not None and not token.proposed:
            seq.knobs.observe(token.metrics)


class _ReadBack:
    """Reading the previous step back from inside the next step's launch, when the next step's
    grammar masks or penalty counts need its tokens: the runner calls `hook` once the forward
    is queued, so the device computes while the host waits, advances the matchers and fills the
    masks, and the sampler counts the tokens with the one just read. `hook` is None when no
    constrained or penalized row of `plan` waits on `previous` (the masks fill during the
    forward, and `previous` is read back after the launch, as without either)."""

    def __init__(self, engine: Engine, previous: LaunchedStep | None, plan: StepPlan) -> None:
        self.outputs: list[RequestOutput] | None = None  # set once `previous` was read back
        self.failed = False
        self._engine, self._previous = engine, previous
        waits = previous is not None and any(
            (item.seq.matcher is not None or item.seq.params.needs_penalties)
            and item.seq.seq_id in previous.row_of
            for item in plan.scheduled
        )
        self.hook = self._read if waits else None

    def _read(self) -> None:
        try:
            self.outputs = self._engine._complete(self._previous)
        except BaseException:
            self.failed = True
            raise


def _cut_chain(token, taken: int) -> None:
    """Keep a verify row's first `taken` tokens (accepted proposals, then the token after
    them): the last kept becomes the row's token."""
    chain = [*token.accepted, token.token_id]
    token.token_id, token.accepted = chain[taken - 1], chain[: taken - 1]
    if token.logprobs is not None:
        entries = [*token.accepted_logprobs, token.logprobs]
        token.logprobs, token.accepted_logprobs = entries[taken - 1], entries[: taken - 1]


def _grammar_detail(matcher) -> str:
    """The matcher's own account of its error state, as a suffix (empty when it has none)."""
    error = matcher.error()
    return f" ({error})" if error else ""


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    return config.max_model_len  # >= 2: EngineConfig checked it
