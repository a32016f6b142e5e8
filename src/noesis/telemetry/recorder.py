"""Telemetry: per-step and per-request records taken without an extra host sync.

A step's device time comes from two CUDA events around its work (the second is the event the
runner already records after the step's single copy back), read once `fetch` has waited for
that copy: a step late in overlapped mode, never a sync of its own. On the CPU the step runs
inside `launch`, so its host duration is its device time. Per-token signals a control plane
computes on the device (entropy, phi, ...) come through `ModelRunner.signal_hooks` and the same
copy; host-side decisions come through `Telemetry.annotate`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

STEP_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.012,
    0.016,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(slots=True)
class RequestMetrics:
    """One request's telemetry (RequestOutput.metrics when telemetry is on). Times are
    time.monotonic() seconds; gpu_ms is its share of each step's device time (by tokens)."""

    arrival_s: float
    first_token_s: float | None = None
    finished_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_steps: int = 0
    gpu_ms: float = 0.0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # Per generated token, the control plane's signals when it provides them (entropy, phi...),
    # and its host-side decisions keyed by output token index.
    signals: dict[str, list] = field(default_factory=dict)
    decisions: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time between output tokens after the first (None before the second)."""
        if self.finished_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def verify_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    def copy(self) -> RequestMetrics:
        return RequestMetrics(
            self.arrival_s,
            self.first_token_s,
            self.finished_s,
            self.prompt_tokens,
            self.output_tokens,
            self.num_steps,
            self.gpu_ms,
            self.spec_proposed,
            self.spec_accepted,
            {k: list(v) for k, v in self.signals.items()},
            dict(self.decisions),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, verify_rate=self.verify_rate)
        out["decisions"] = {str(k): v for k, v in self.decisions.items()}
        return out


@dataclass(slots=True)
class StepShape:
    """What a launched step is, taken from its plan on the host at launch."""

    step: int
    rows: int  # sequences in the step
    tokens: int  # tokens fed (prefill chunks, decodes, proposals)
    prefill_tokens: int  # fed by rows that are not one-token decodes
    graph: bool  # replayed a captured graph (else eager)
    bytes_moved: int  # weights once plus every row's KV read and written, from the shapes
    kv_pages_used: int
    kv_pages_total: int
    fed: list[tuple[str, int]]  # (request_id, tokens fed) per row, in plan order


class Histogram:
    """A cumulative histogram (Prometheus semantics): counts per upper bound, sum, count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
                return

    def snapshot(self) -> tuple[tuple[float, ...], list[int], float, int]:
        return self.bounds, list(self.counts), self.sum, self.count


class Telemetry:
    """Collects step records and request metrics; writes JSON lines when given a path."""

    def __init__(self, path: str | Path | None, weight_bytes: int, kv_bytes_per_token: int):
        self.weight_bytes = weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        # Written on the engine thread: a writer thread measured worse (it holds the GIL the
        # engine thread wants back after each wait for the device).
        self._file: IO[str] | None = open(path, "a", buffering=1 << 16) if path else None  # noqa: SIM115
        self._dumps = json.JSONEncoder(separators=(",", ":")).encode
        self.requests: dict[str, RequestMetrics] = {}
        self.totals = {
            "steps": 0,
            "graph_steps": 0,
            "eager_steps": 0,
            "tokens_fed": 0,
            "tokens_out": 0,
            "gpu_ms": 0.0,
            "prefill_gpu_ms": 0.0,
            "decode_gpu_ms": 0.0,
            "host_ms": 0.0,
            "wait_ms": 0.0,
            "spec_proposed": 0,
            "spec_accepted": 0,
            "bytes_moved": 0,
        }
        self.histograms = {
            "step_gpu_seconds": Histogram(STEP_SECONDS_BUCKETS),
            "step_host_seconds": Histogram(STEP_SECONDS_BUCKETS),
            "batch_rows": Histogram(BATCH_ROW_BUCKETS),
            "spec_verify_rate": Histogram(RATE_BUCKETS),
        }
        self._pending: list[dict[str, Any]] = []  # completed this Engine.step, host time to add
        self._notes: dict[str, dict[str, Any]] = {}  # request_id -> decisions for its next token
        self.sidecar_stats: dict[str, dict[str, Any]] = {}  # the last "sidecars" record's

    # ---- requests ---------------------------------------------------------------------------

    def admit(self, request_id: str, prompt_tokens: int) -> RequestMetrics:
        metrics = RequestMetrics(time.monotonic(), prompt_tokens=prompt_tokens)
        self.requests[request_id] = metrics
        return metrics

    def annotate(self, request_id: str, **values: Any) -> None:
        """Host-side values (a controller's decision) recorded with this request's next token."""
        self._notes.setdefault(request_id, {}).update(values)

    def finish(self, request_id: str) -> None:
        metrics = self.requests.pop(request_id, None)
        self._notes.pop(request_id, None)
        if metrics is None:
            return
        metrics.finished_s = time.monotonic()
        self.write({"kind": "request", "request_id": request_id, **metrics.to_dict()})

    # ---- steps --------------------------------------------------------------------------------

    def step_bytes(self, context_lens: list[int], tokens: int) -> int:
        """Bytes a step moves: the weights once, each row's KV context read, new KV written."""
        return self.weight_bytes + (sum(context_lens) + tokens) * self.kv_bytes_per_token

    def completed(
        self,
        shape: StepShape,
        gpu_ms: float | None,
        wait_ms: float,
        rows: list[tuple[str, list[int], int, int]],
        signals: dict[str, list] | None,
    ) -> None:
        """A step read back. rows: (request_id, new token ids, proposed, accepted) in sampled
        order; signals: per-row values the hooks computed (aligned with rows); gpu_ms None: not
        measured (booked as 0). Runs once per step on the engine thread: plain loops."""
        record_ms, gpu_ms = gpu_ms, gpu_ms or 0.0
        totals = self.totals
        totals["steps"] += 1
        totals["graph_steps" if shape.graph else "eager_steps"] += 1
        totals["tokens_fed"] += shape.tokens
        totals["gpu_ms"] += gpu_ms
        totals["prefill_gpu_ms" if shape.prefill_tokens else "decode_gpu_ms"] += gpu_ms
        totals["wait_ms"] += wait_ms
        totals["bytes_moved"] += shape.bytes_moved
        if record_ms is not None:
            self.histograms["step_gpu_seconds"].observe(gpu_ms / 1e3)
        self.histograms["batch_rows"].observe(shape.rows)
        requests = self.requests
        share = gpu_ms / shape.tokens if shape.tokens else 0.0
        for request_id, fed in shape.fed:
            metrics = requests.get(request_id)
            if metrics is not None:
                metrics.gpu_ms += share * fed
                metrics.num_steps += 1
        now = time.monotonic()
        notes, verify_rate = self._notes, self.histograms["spec_verify_rate"]
        out_tokens = proposed = accepted = 0
        for request_id, new_ids, row_proposed, row_accepted in rows:
            count = len(new_ids)
            out_tokens += count
            metrics = requests.get(request_id)
            if metrics is not None:
                if metrics.first_token_s is None and count:
                    metrics.first_token_s = now
                if notes and request_id in notes:
                    metrics.decisions[metrics.output_tokens] = notes.pop(request_id)
                metrics.output_tokens += count
            if row_proposed:
                proposed += row_proposed
                accepted += row_accepted
                verify_rate.observe(row_accepted / row_proposed)
                if metrics is not None:
                    metrics.spec_proposed += row_proposed
                    metrics.spec_accepted += row_accepted
        if signals:
            self._book_signals(rows, signals)
        totals["tokens_out"] += out_tokens
        totals["spec_proposed"] += proposed
        totals["spec_accepted"] += accepted
        record = {
            "kind": "step",
            "step": shape.step,
            "t": now,
            "gpu_ms": record_ms,
            "wait_ms": wait_ms,
            "graph": shape.graph,
            "rows": shape.rows,
            "tokens": shape.tokens,
            "prefill_tokens": shape.prefill_tokens,
            "kv_pages_used": shape.kv_pages_used,
            "kv_pages_total": shape.kv_pages_total,
            "bytes_moved": shape.bytes_moved,
            "bytes_per_token": shape.bytes_moved // max(out_tokens, 1),
            "spec_proposed": proposed,
            "spec_accepted": accepted,
            "out": [[row[0], row[1]] for row in rows],
        }
        if signals:
            record["signals"] = signals
        self._pending.append(record)

    def _book_signals(self, rows: list, signals: dict[str, list]) -> None:
        """Each row's signal values onto its request's metrics."""
        for index, row in enumerate(rows):
            metrics = self.requests.get(row[0])
            if metrics is None:
                continue
            for name, values in signals.items():
                metrics.signals.setdefault(name, []).append(values[index])

    def sidecars(self, stats: dict[str, dict[str, Any]]) -> None:
        """The sidecars' counters (SidecarRuntime.stats: windows, drops, errors, calls,
        latency, decisions per sidecar) as a "sidecars" record, when they changed since the
        last one: at most one a step, none while the sidecars are idle."""
        if stats == self.sidecar_stats:
            return
        self.sidecar_stats = stats
        self.write({"kind": "sidecars", "t": time.monotonic(), "steps": self.totals["steps"],
                    "sidecars": stats})

    def end_engine_step(self, host_ms: float) -> None:
        """The Engine.step call that completed the pending records took host_ms (waits out)."""
        self.totals["host_ms"] += host_ms
        self.histograms["step_host_seconds"].observe(host_ms / 1e3)
        pending, self._pending = self._pending, []
        for record in pending:
            record["host_ms"] = host_ms / len(pending)
            self.write(record)

    # ---- sinks --------------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(self._dumps(record) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def snapshot(self) -> dict[str, tuple]:
        """The histograms, for a Prometheus collector in another process."""
        return {name: hist.snapshot() for name, hist in self.histograms.items()}


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """A telemetry file's records, in order."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
