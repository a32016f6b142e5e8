"""Replay: run a trace's requests again, at the steps they came, and compare every step's batch
and every token with the recording; the first difference is reported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noesis.telemetry.trace import Trace, TraceError, TraceWriter, check_hashes, load_trace

BLOCKED = "content_filter"  # the finish reason of a request a sidecar blocked
PRUNED = "pruned"  # ... and of a branch the binding gate stopped
ENDED_BY_DECISION = (BLOCKED, PRUNED)  # replayed where the recording had them
REPLAYED_BLOCK = "blocked by a sidecar in the recording"


@dataclass(frozen=True)
class Divergence:
    """Where the replay first differs: at `step`, `request_id`'s `what` ('batch': the step's
    composition; 'token': its output token number `index`; 'finish': how it ended)."""

    what: str
    step: int | None
    request_id: str | None
    index: int | None
    expected: Any
    got: Any
    # 'token': the replay's logit of the recorded token minus its largest logit at that
    # position (0: the recorded token was the top one; None: not measured, a verify row).
    logit_gap: float | None = None

    def describe(self) -> str:
        where = f"step {self.step}" if self.step is not None else "at the end"
        who = f", request {self.request_id}" if self.request_id is not None else ""
        at = f", output token {self.index}" if self.index is not None else ""
        gap = f"; logits delta {self.logit_gap:+.4g}" if self.logit_gap is not None else ""
        return (
            f"first divergence ({self.what}) at {where}{who}{at}: recorded "
            f"{self.expected!r}, replayed {self.got!r}{gap}"
        )


@dataclass(frozen=True)
class ReplayReport:
    requests: int
    steps: int
    tokens: int  # output tokens compared
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def replay(path: str | Path, model: str | None = None, device: str | None = None,
           request_id: str | None = None) -> ReplayReport:
    """Replay the trace at `path` (on the model and device it names, unless overridden: the
    model must hash the same); TraceError when it cannot be replayed. request_id: reproduce that
    request: alone when the trace was recorded batch_invariant (its tokens only), else in its
    recorded batches: the traffic up to its end, replayed and compared as a whole."""
    trace = load_trace(path)
    if request_id is not None and trace.header["engine"].get("batch_invariant"):
        return replay_alone(trace, request_id, model, device)
    if request_id is not None:
        trace = until_end_of(trace, request_id)
    engine = _engine_for(trace, model, device)
    try:
        got = _run(engine, trace, until=request_id)
    finally:
        engine.close()
    return compare(trace, got)


def until_end_of(trace: Trace, request_id: str) -> Trace:
    """The trace cut after `request_id` ends (finishes or is aborted): what it shared batches
    with, and nothing after. A request the trace never saw end keeps the whole trace."""
    _added(trace, request_id)
    for index, event in enumerate(trace.events):
        if event["kind"] in ("finish", "abort") and event["request_id"] == request_id:
            return Trace(trace.header, trace.events[: index + 1])
    return trace


def replay_alone(trace: Trace, request_id: str, model: str | None = None,
                 device: str | None = None) -> ReplayReport:
    """One request of a busy recording, run with nothing beside it: in batch-invariant mode its
    tokens cannot depend on the batches it was recorded in, so they must come back the same."""
    from noesis.telemetry.trace import params_from_dict

    if not trace.header["engine"].get("batch_invariant"):
        raise TraceError("replaying one request alone needs a trace recorded with "
                         "batch_invariant (--batch-invariant): otherwise its tokens depend on "
                         "the batches it shared")
    added = _added(trace, request_id)
    blocked = [e for e in trace.of_kind("finish") if e["request_id"] == request_id
               and e["reason"] in ENDED_BY_DECISION]  # fmt: skip
    engine = _engine_for(trace, model, device)
    try:
        engine.add_request(added["prompt"], params_from_dict(added["params"]), request_id,
                           stream=False)
        records = engine.observer.trace.records
        while engine.has_unfinished():
            engine.step()
            if blocked and _emitted(records) >= len(blocked[0]["token_ids"]):
                _end(engine, blocked[0])  # where the recording was
        got = records[1:]
    finally:
        engine.close()
    return _compare_alone(trace, request_id, got)


def _emitted(records: list[dict[str, Any]]) -> int:
    """Output tokens in a lone replay's records so far."""
    return sum(len(ids) for e in records if e["kind"] == "tokens" for _, ids in e["out"])


def _added(trace: Trace, request_id: str) -> dict[str, Any]:
    """The trace's "add" event of `request_id`; TraceError naming some it has when none."""
    adds = [e for e in trace.requests if e["request_id"] == request_id]
    if not adds:
        shown = ", ".join(repr(e["request_id"]) for e in trace.requests[:10])
        raise TraceError(f"the trace has no request {request_id!r} (it has {shown})")
    return adds[0]


def _compare_alone(trace: Trace, request_id: str, replayed: list[dict[str, Any]]):
    """The request's recorded output tokens against the lone replay's, then how it ended."""
    want = [t for e in trace.of_kind("tokens") for rid, ids in e["out"] if rid == request_id
            for t in ids]  # fmt: skip
    got, gaps = [], []  # the replay's tokens, and each step's logit gap of its first one
    for event in (e for e in replayed if e["kind"] == "tokens"):
        for _, ids in event["out"]:  # only the request replayed
            values = event.get("signals", {}).get(RecordedLogitGap.name) or [None]
            gaps.extend([values[0]] + [None] * (len(ids) - 1))
            got.extend(ids)
    steps = len([e for e in replayed if e["kind"] == "step"])
    index = _first_difference(want, got)
    if index < len(want):
        gap = gaps[index] if index < len(gaps) and gaps[index] == gaps[index] else None
        shown = got[index] if index < len(got) else None
        divergence = Divergence("token", None, request_id, index, want[index], shown, gap)
        return ReplayReport(1, steps, index, divergence)
    ends = [e for e in trace.of_kind("finish") if e["request_id"] == request_id]
    mine = [e for e in replayed if e["kind"] == "finish"]
    if ends and (not mine or mine[0]["reason"] != ends[0]["reason"]):
        got_end = [mine[0]["reason"], mine[0]["token_ids"]] if mine else None
        divergence = Divergence("finish", None, request_id, None,
                                [ends[0]["reason"], ends[0]["token_ids"]], got_end)
        return ReplayReport(1, steps, len(want), divergence)
    return ReplayReport(1, steps, len(want), None)


def _engine_for(trace: Trace, model: str | None, device: str | None):
    from noesis.engine.engine import Engine, EngineConfig
    from noesis.errors import ConfigError
    from noesis.speculative.config import SpeculativeConfig
    from noesis.telemetry.observer import EngineObserver

    header = trace.header
    model_dir = check_hashes(header, model)
    options = dict(header["engine"])
    if options.get("speculative") is not None:
        options["speculative"] = SpeculativeConfig(**options["speculative"])
    options.update(
        device=device or header["device"],
        dtype=header["dtype"],
        progress=False,
        deterministic=False,
    )
    try:
        config = EngineConfig(**options)
    except (TypeError, ConfigError) as exc:  # ConfigError: e.g. a custom control policy's name
        raise TraceError(f"the trace's engine options are not this noesis's: {exc}") from exc
    engine = Engine(str(model_dir), config)
    engine.observer = EngineObserver(engine, None, TraceWriter(None, {}))
    engine.runner.signal_hooks.append(RecordedLogitGap(trace))
    return engine


class RecordedLogitGap:
    """A signal hook: per row, the logit of the token the recording sampled at this position
    minus the row's largest logit (NaN past the recording), for the divergence report."""

    name = "replay_recorded_logit_gap"

    def __init__(self, trace: Trace) -> None:
        self.recorded: dict[str, list[int]] = {}
        for event in trace.of_kind("tokens"):
            for request_id, ids in event["out"]:
                self.recorded.setdefault(request_id, []).extend(ids)

    def __call__(self, logits, seqs) -> dict:
        import torch

        wanted = []
        for seq in seqs:
            ids = self.recorded.get(seq.request_id, [])
            wanted.append(ids[seq.num_output] if seq.num_output < len(ids) else -1)
        index = torch.tensor(wanted, device=logits.device)  # [B]
        picked = logits.gather(1, index.clamp(min=0)[:, None])[:, 0].float()
        gap = picked - logits.amax(dim=-1).float()
        return {self.name: torch.where(index >= 0, gap, torch.nan)}


def _run(engine, trace: Trace, until: str | None = None) -> list[dict[str, Any]]:
    """Drive the engine through the trace's adds, aborts, sidecar blocks and warm-up; its own
    records back. until: stop once that request has ended (what else runs is left unfinished)."""
    from noesis.telemetry.trace import params_from_dict

    observer = engine.observer
    inputs = [e for e in trace.events if e["kind"] in ("add", "abort", "warm_up")
              or (e["kind"] == "finish" and e["reason"] in ENDED_BY_DECISION)]  # fmt: skip
    position = 0
    ended = False  # whether `until` has ended
    while not ended and (position < len(inputs) or engine.has_unfinished()):
        # Idle engine: nothing can run before the next input, whatever step it names.
        idle = not engine.has_unfinished()
        while position < len(inputs) and (idle or inputs[position]["step"] <= observer.steps):
            event = inputs[position]
            position += 1
            if event["kind"] == "add":
                params = params_from_dict(event["params"])
                engine.add_request(event["prompt"], params, event["request_id"], stream=False)
            elif event["kind"] == "warm_up":
                engine.warm_up()
            else:
                _end(engine, event)
                ended = ended or event["request_id"] == until
            idle = False
        outputs = engine.step()
        ended = ended or any(out.finished and out.request_id == until for out in outputs)
    return observer.trace.records[1:]


def _end(engine, event: dict[str, Any]) -> None:
    """An abort, a sidecar's block (a "content_filter" finish) or the binding gate's prune,
    where the recording had it."""
    if event["kind"] == "abort":
        engine.abort(event["request_id"])
    elif event["reason"] == PRUNED:
        engine.prune_request(event["request_id"])
    else:
        engine.filter_request(event["request_id"], REPLAYED_BLOCK)


def compare(trace: Trace, replayed: list[dict[str, Any]]) -> ReplayReport:
    """The recording against a replay's records, step by step (its batch, then its tokens),
    then each request's end."""
    recorded = {
        kind: {e["step"]: e for e in trace.events if e["kind"] == kind}
        for kind in ("step", "tokens")
    }
    again = {
        kind: {e["step"]: e for e in replayed if e["kind"] == kind} for kind in ("step", "tokens")
    }
    emitted: dict[str, int] = {}  # output tokens compared so far per request
    requests, steps = len(trace.requests), len(recorded["step"])
    for step in sorted(recorded["step"]):
        want, got = recorded["step"][step]["rows"], again["step"].get(step, {}).get("rows")
        if got != want:
            return ReplayReport(
                requests, step, _sum(emitted), Divergence("batch", step, None, None, want, got)
            )
        divergence = _compare_tokens(
            step, recorded["tokens"].get(step, {"out": []}), again["tokens"].get(step), emitted
        )
        if divergence is not None:
            return ReplayReport(requests, step, _sum(emitted), divergence)
    ends = {e["request_id"]: e for e in replayed if e["kind"] == "finish"}
    for want in trace.of_kind("finish"):
        got = ends.get(want["request_id"])
        if got is None or (got["reason"], got["token_ids"]) != (want["reason"], want["token_ids"]):
            shown = None if got is None else [got["reason"], got["token_ids"]]
            divergence = Divergence(
                "finish", None, want["request_id"], None, [want["reason"], want["token_ids"]], shown
            )
            return ReplayReport(requests, steps, _sum(emitted), divergence)
    return ReplayReport(requests, steps, _sum(emitted), None)


def _compare_tokens(step: int, want: dict, got: dict | None, emitted: dict[str, int]):
    got = got or {"out": []}
    rows = [request_id for request_id, _ in got["out"]]
    mine = dict(got["out"])
    for request_id, ids in want["out"]:
        start = emitted.get(request_id, 0)
        theirs = mine.get(request_id)
        if theirs != ids:
            index = start + _first_difference(ids, theirs or [])
            gap = None
            if theirs is not None and index == start:  # the step's first token: the row's gap
                gaps = got.get("signals", {}).get(RecordedLogitGap.name)
                value = gaps[rows.index(request_id)] if gaps else None
                gap = None if value is None or value != value else value  # NaN: none
            return Divergence("token", step, request_id, index, ids, theirs, gap)
        emitted[request_id] = start + len(ids)
    return None


def _sum(emitted: dict[str, int]) -> int:
    return sum(emitted.values())


def _first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def report_dict(report: ReplayReport) -> dict[str, Any]:
    out = dataclasses.asdict(report)
    out["ok"] = report.ok
    return out
