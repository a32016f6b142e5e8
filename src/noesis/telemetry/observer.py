"""EngineObserver: the engine's one seam for telemetry and traces. The engine calls it at
admission, launch, read-back, finish and the end of each step; with neither on, the engine holds
None and pays one `is None` test per call site."""

from __future__ import annotations

import dataclasses
import platform
from typing import TYPE_CHECKING, Any

import torch

from noesis.kv.cache import page_bytes
from noesis.telemetry.recorder import StepShape, Telemetry
from noesis.telemetry.trace import (
    IGNORED_OPTIONS,
    TraceWriter,
    checkpoint_path,
    model_hashes,
    params_to_dict,
)

if TYPE_CHECKING:
    from noesis.engine.engine import Engine
    from noesis.engine.request import RequestState
    from noesis.runner.runner import LaunchedStep


class EngineObserver:
    def __init__(self, engine: Engine, telemetry: Telemetry | None, trace: TraceWriter | None):
        self.engine = engine
        self.telemetry = telemetry
        self.trace = trace
        self.steps = 0  # steps launched: a trace keys adds and aborts by it
        # ms the engine thread spent on the device's work: waits in fetch, and on the CPU the
        # steps themselves (Engine.step books the rest as host overhead)
        self.blocked_ms = 0.0

    @classmethod
    def build(cls, engine: Engine) -> EngineObserver | None:
        config = engine.config
        telemetry = trace = None
        if config.telemetry:
            path = config.telemetry if isinstance(config.telemetry, str) else None
            loaded = engine.loaded
            telemetry = Telemetry(
                path, weight_bytes(loaded.model), page_bytes(loaded.config, 1, loaded.dtype)
            )
            engine.runner.timing = True
        if config.trace:
            trace = TraceWriter(config.trace, trace_header(engine))
        return cls(engine, telemetry, trace) if telemetry or trace else None

    # ---- requests ---------------------------------------------------------------------------

    def admitted(self, state: RequestState) -> None:
        seq = state.seq
        if self.telemetry is not None:
            state.metrics = self.telemetry.admit(seq.request_id, seq.prompt_len)
        if self.trace is not None:
            self.trace.write(
                {
                    "kind": "add",
                    "step": self.steps,
                    "request_id": seq.request_id,
                    "prompt": seq.token_ids[: seq.prompt_len],
                    "params": params_to_dict(seq.params, seq.seed),
                }
            )
        state_of_control = getattr(seq.params.control, "state", None)  # a conversation's
        if state_of_control is not None and state_of_control.decisions:
            # its emit-vs-tool decision for this generation, with the generation's first token
            self.annotate(seq.request_id, decision=state_of_control.decisions[-1])

    def aborted(self, request_id: str) -> None:
        if self.trace is not None:
            self.trace.write({"kind": "abort", "step": self.steps, "request_id": request_id})
        if self.telemetry is not None:
            self.telemetry.finish(request_id)

    def annotate(self, request_id: str, **values: Any) -> None:
        """A control plane's host-side decision for this request's next token: in its
        telemetry metrics and, as a "decision" line, in the trace."""
        if self.telemetry is not None:
            self.telemetry.annotate(request_id, **values)
        if self.trace is not None:
            self.trace.write(
                {"kind": "decision", "step": self.steps, "request_id": request_id, "values": values}
            )

    def finished(self, state: RequestState) -> None:
        seq = state.seq
        if self.telemetry is not None:
            self.telemetry.finish(seq.request_id)
        if self.trace is not None:
            reason = seq.finish_reason.value if seq.finish_reason else None
            self.trace.write(
                {
                    "kind": "finish",
                    "step": self.steps,  # a sidecar's block is replayed before this step
                    "request_id": seq.request_id,
                    "reason": reason,
                    "token_ids": seq.output_ids,
                }
            )

    # ---- steps --------------------------------------------------------------------------------

    def launched(self, launched: LaunchedStep) -> None:
        """Right after launch (the plan still says what each row fed)."""
        step, self.steps = self.steps, self.steps + 1
        launched.step_index = step
        if self.telemetry is not None and self.engine.device.type != "cuda":  # host ran it
            self.blocked_ms += launched.device_ms
        scheduled = launched.plan.scheduled
        if self.trace is not None:
            rows = [[item.seq.request_id, item.num_tokens, item.num_draft] for item in scheduled]
            record = {"kind": "step", "step": step, "rows": rows}
            if launched.plan.preempted:
                record["preempted"] = [seq.request_id for seq in launched.plan.preempted]
            self.trace.write(record)
        if self.telemetry is None:
            return
        tokens = prefill = 0
        contexts = []
        for item in scheduled:
            tokens += item.num_tokens
            contexts.append(item.seq.num_computed)
            known = item.num_tokens - item.num_draft
            if known > 1 or item.seq.num_computed == 0:
                prefill += known
        allocator = self.engine.allocator
        launched.shape = StepShape(
            step,
            len(scheduled),
            tokens,
            prefill,
            launched.graph,
            self.telemetry.step_bytes(contexts, tokens),
            allocator.num_used,
            allocator.num_pages,
            [(item.seq.request_id, item.num_tokens) for item in scheduled],
        )

    def completed(self, launched: LaunchedStep, lengths: dict[int, int], sampled: dict) -> None:
        """After read-back; lengths: each sampling sequence's token count before it. Signals:
        the runner's signal hooks', the sampler's per-token metrics (entropy, varentropy,
        top-k mass, margin) for rows that asked (SamplingParams.metrics) or are controlled, and
        the control plane's Φ for controlled rows."""
        self.blocked_ms += launched.wait_ms
        rows, token_metrics = [], []
        for seq in launched.seqs:
            new_ids = seq.token_ids[lengths[seq.seq_id] :]
            token = sampled.get(seq.seq_id)
            proposed, accepted = (token.proposed, len(token.accepted)) if token else (0, 0)
            rows.append((seq.request_id, new_ids, proposed, accepted))
            token_metrics.append(token.metrics if token is not None else None)
        signals = launched.signals
        if any(m is not None for m in token_metrics):
            signals = {**(signals or {}), **_metric_columns(token_metrics)}
        phis = [_phi(seq) for seq in launched.seqs]
        if any(phi is not None for phi in phis):
            signals = {**(signals or {}), "phi": phis}
        if self.trace is not None:
            out = [[request_id, new_ids] for request_id, new_ids, _, _ in rows]
            record = {"kind": "tokens", "step": launched.step_index, "out": out}
            if signals:
                record["signals"] = signals
            self.trace.write(record)
        if self.telemetry is not None and launched.shape is not None:
            self.telemetry.completed(
                launched.shape, launched.device_ms, launched.wait_ms, rows, signals
            )

    def end_step(self, host_ms: float, idle: bool) -> None:
        if self.telemetry is not None:
            self.telemetry.end_engine_step(host_ms)
            if idle:
                self.telemetry.flush()

    def close(self) -> None:
        for sink in (self.telemetry, self.trace):
            if sink is not None:
                sink.close()


def _metric_columns(rows: list) -> dict[str, list]:
    """Per-row TokenMetrics (or None) -> one list per metric, None where a row has none."""
    names = ("entropy", "varentropy", "top_k_mass", "margin")
    return {name: [None if m is None else getattr(m, name) for m in rows] for name in names}


def _phi(seq) -> list | None:
    """A controlled row's Φ once this step's token was folded in: [temperature, top_p,
    verify_width, think_budget], the first two as its next token is sampled with (the
    request's own, scaled by Φ); None for a row without control."""
    knobs = seq.knobs
    if knobs is None:
        return None
    phi = knobs.state.phi.phi
    return [knobs.temperature, knobs.top_p, phi.verify_width, phi.think_budget]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads (all of them: MoE experts are over-counted)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def trace_header(engine: Engine) -> dict[str, Any]:
    loaded = engine.loaded
    model_hash, tokenizer_hash = model_hashes(loaded.model_dir)
    options = {
        field.name: getattr(engine.config, field.name)
        for field in dataclasses.fields(engine.config)
        if field.name not in IGNORED_OPTIONS
    }
    hashes = {}
    if options.get("speculative") is not None:
        speculative = options["speculative"]
        options["speculative"] = dataclasses.asdict(speculative)
        if speculative.method == "draft":  # sampled rows' tokens depend on its proposals
            hashes["draft_hash"] = model_hashes(checkpoint_path(speculative.draft))[0]
    if not isinstance(options.get("control"), (str, type(None))):  # a ControlPolicy object
        options["control"] = options["control"].name
    return {
        "model": str(loaded.model_dir),
        "model_hash": model_hash,
        "tokenizer_hash": tokenizer_hash,
        **hashes,
        "engine": options,
        "device": str(engine.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
