"""SidecarRuntime: small models beside the decode loop, never in its way.

After each engine step the runtime cuts windows of each request's new text at the sidecar's
cadence (per request, per clause, every N tokens) and offers them to the sidecar's bounded queue
without waiting: a full queue drops the window and counts it. Each sidecar has its own worker
threads (on CUDA they run under a low-priority stream), so a sidecar that sleeps or raises holds
up only itself. Results land in a done list that the next step's `after_step` collects: they are
visible one step later at the earliest, and a failure (or a dropped window) becomes a decision by
the sidecar's policy (fail open: nothing happens; fail closed: "block"). The engine ends a request
its sidecars "block" with finish_reason "content_filter".
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from noesis.engine.outputs import RequestOutput
from noesis.errors import ConfigError

log = logging.getLogger(__name__)

CADENCES = ("request", "clause", "tokens", "turn")
POLICIES = ("open", "closed")
CLAUSE_END = re.compile(r"[.!?;:\n]")
# Upper bounds (seconds) of the per-sidecar latency histogram's buckets, as /metrics shows them.
LATENCY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Placement:
    device: str = "cpu"  # "cpu": worker threads; "cuda": the same, under a low-priority stream
    workers: int = 1
    queue_size: int = 8  # windows waiting; one more is dropped
    # windows a worker takes from the queue at once, for a sidecar with `run_batch` (one
    # model call over all of them); 1: one window a call
    batch: int = 8

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"sidecar device must be cpu or cuda, got {self.device!r}")
        if self.workers < 1 or self.queue_size < 1 or self.batch < 1:
            raise ConfigError("sidecar workers, queue_size and batch must be at least 1")


@dataclass(frozen=True)
class Cadence:
    kind: str = "request"  # request: the whole text once finished; clause; tokens
    # turn: a turn's last user message and tools as it is admitted (offer_turn), then its whole
    # text once finished
    every: int = 16  # tokens per window (kind "tokens")

    def __post_init__(self) -> None:
        if self.kind not in CADENCES:
            raise ConfigError(f"sidecar cadence must be one of {CADENCES}, got {self.kind!r}")
        if self.every < 1:
            raise ConfigError(f"sidecar cadence every must be at least 1, got {self.every}")


@dataclass(frozen=True, slots=True)
class Window:
    """What a sidecar reads: the new span of a request's text, and all of it so far."""

    request_id: str
    text: str
    context: str
    final: bool  # the request finished with this window
    start: int = 0  # where `text` begins in `context`
    tools: tuple[dict[str, Any], ...] = ()  # a turn window's declared tools (OpenAI format)
    # a turn window's caller, told the tool its turn is expected to call (ToolExecutor.warm)
    on_intent: Callable[[str], Any] | None = None


@dataclass(frozen=True, slots=True)
class Result:
    sidecar: str
    request_id: str
    value: Any  # the sidecar's output (None when it failed)
    decision: str | None  # what the runtime's caller should do ("block"), or nothing
    error: str | None = None
    latency_s: float = 0.0

    @property
    def reason(self) -> str:
        """Why: the sidecar's output as it reads, or the failure its policy turned into this."""
        if self.error is not None:
            return f"the {self.sidecar} sidecar fails closed: {self.error}"
        return f"{self.sidecar}: {self.value}"


class Sidecar(Protocol):
    """A small model with a typed input (Window) and output; `decide` maps its output to a
    decision for the request (None: nothing to do)."""

    name: str
    cadence: Cadence
    placement: Placement
    policy: str  # "open" | "closed": what a failure or a dropped window means

    def run(self, window: Window) -> Any: ...

    def decide(self, value: Any) -> str | None: ...

    # Optional: `run_batch(windows) -> list` (one value per window, as `run` would give it), which
    # the worker calls with every window queued, up to the placement's `batch`.


@dataclass(slots=True)
class SidecarStats:
    windows: int = 0
    drops: int = 0
    errors: int = 0
    latency_s: float = 0.0  # summed over completed windows (each its call's seconds)
    completed: int = 0  # windows
    calls: int = 0  # the sidecar's calls (run, or run_batch over several windows)
    decisions: Counter = field(default_factory=Counter)
    # completed calls per LATENCY_BOUNDS bucket (a last one for slower calls)
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))

    def observe(self, latency_s: float) -> None:
        self.completed += 1
        self.latency_s += latency_s
        self.latency_counts[bisect.bisect_left(LATENCY_BOUNDS, latency_s)] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "drops": self.drops, "errors": self.errors,
                "completed": self.completed, "calls": self.calls, "latency_s": self.latency_s,
                "latency_bounds": LATENCY_BOUNDS, "latency_counts": list(self.latency_counts),
                "decisions": dict(self.decisions)}


class _Lane:
    """One sidecar's bounded queue and worker threads."""

    def __init__(self, sidecar: Sidecar, done: list[Result], lock: threading.Lock) -> None:
        self.sidecar = sidecar
        self.stats = SidecarStats()
        # Bounded by `offer` (the engine's thread alone puts windows), so that `close` can
        # always queue the workers' stop marks.
        self.queue: queue.SimpleQueue[Window | None] = queue.SimpleQueue()
        self._done, self._lock = done, lock
        self.threads = [threading.Thread(target=self._work, name=f"sidecar-{sidecar.name}-{i}",
                                         daemon=True)
                        for i in range(sidecar.placement.workers)]
        for thread in self.threads:
            thread.start()

    def offer(self, window: Window) -> bool:
        """Queue the window, or drop it when the queue is full: counted, and under a policy
        that fails closed a "block" (what it held went unread)."""
        self.stats.windows += 1
        if self.queue.qsize() < self.sidecar.placement.queue_size:
            self.queue.put(window)
            return True
        with self._lock:
            self.stats.drops += 1
            if self.sidecar.policy == "closed":
                self.stats.decisions["block"] += 1
                self._done.append(Result(self.sidecar.name, window.request_id, None, "block",
                                         "its window was dropped: the sidecar's queue was full"))
        return False

    def _work(self) -> None:
        batched = hasattr(self.sidecar, "run_batch")
        most = self.sidecar.placement.batch if batched else 1
        with _placed(self.sidecar.placement):
            while (window := self.queue.get()) is not None:
                windows = [window]
                while len(windows) < most:  # what else is waiting, without waiting for more
                    try:
                        more = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self.queue.put(None)  # the stop mark, for after this batch
                        break
                    windows.append(more)
                values, error, latency = self._call(windows, batched)
                with self._lock:
                    self.stats.calls += 1
                for window, value in zip(windows, values, strict=True):
                    self._finish(window, value, error, latency)

    def _call(self, windows: list[Window], batched: bool
              ) -> tuple[list[Any], str | None, float]:  # fmt: skip
        """The sidecar's values for `windows` (its run_batch, else run on the one window), the
        error that stopped it, and the call's seconds (each window waited that long)."""
        start = time.perf_counter()
        try:
            if batched:
                values = list(self.sidecar.run_batch(windows))
                if len(values) != len(windows):
                    raise ValueError(f"run_batch gave {len(values)} values for "
                                     f"{len(windows)} windows")
            else:
                values = [self.sidecar.run(windows[0])]
        except Exception as exc:  # a failing sidecar is counted, never raised into the engine
            log.warning("sidecar %s failed: %r", self.sidecar.name, exc)
            return ([None] * len(windows), f"{type(exc).__name__}: {exc}",
                    time.perf_counter() - start)
        return values, None, time.perf_counter() - start

    def _finish(self, window: Window, value: Any, error: str | None, latency: float) -> None:
        sidecar = self.sidecar
        if error is None:
            decision = sidecar.decide(value)
        else:
            decision = "block" if sidecar.policy == "closed" else None
        with self._lock:
            self.stats.observe(latency)
            self.stats.errors += error is not None
            if decision is not None:
                self.stats.decisions[decision] += 1
            self._done.append(Result(sidecar.name, window.request_id, value, decision, error,
                                     latency))


class SidecarRuntime:
    """The engine's sidecars: windows in after each step (never blocking), results out at the
    next one."""

    def __init__(self, sidecars: list[Sidecar]) -> None:
        names = [s.name for s in sidecars]
        if len(set(names)) != len(names):
            raise ConfigError(f"sidecar names must differ: {names}")
        self._done: list[Result] = []
        self._lock = threading.Lock()
        self.lanes = {s.name: _Lane(s, self._done, self._lock) for s in sidecars}
        self._texts: dict[str, str] = {}  # request id -> its text so far
        # (sidecar, request id) -> chars and tokens of the text its windows covered
        self._cut: dict[tuple[str, str], tuple[int, int]] = {}
        self._tokens: dict[str, int] = {}
        self._turns: set[str] = set()  # requests shown by offer_turn, not finished yet

    def after_step(self, outputs: list[RequestOutput]) -> list[Result]:
        """Collect the results that arrived since the last step, then offer the windows this
        step's outputs complete. Never waits for a sidecar."""
        with self._lock:
            results, self._done[:] = list(self._done), []
        for out in outputs:
            self._observe(out)
        return results

    def offer_turn(self, request_id: str, user_text: str, tools: list[dict[str, Any]],
                   on_intent: Callable[[str], Any] | None = None) -> None:
        """Offer a turn's last user message and declared tools to the "turn" sidecars as the
        request is admitted (they also get its whole text once it finishes); `on_intent` is
        called with the tool an intent sidecar predicts. Never waits."""
        lanes = [lane for lane in self.lanes.values() if lane.sidecar.cadence.kind == "turn"]
        if lanes:
            self._turns.add(request_id)
        for lane in lanes:
            lane.offer(Window(request_id, user_text, user_text, False, tools=tuple(tools),
                              on_intent=on_intent))

    def _observe(self, out: RequestOutput) -> None:
        rid = out.request_id
        text = self._texts.get(rid, "") + out.text if out.delta else out.text
        tokens = self._tokens.get(rid, 0) + len(out.token_ids) if out.delta else len(out.token_ids)
        self._texts[rid], self._tokens[rid] = text, tokens
        for lane in self.lanes.values():
            if lane.sidecar.cadence.kind == "turn" and rid not in self._turns:
                continue
            chars, counted = self._cut.get((lane.sidecar.name, rid), (0, 0))
            end = _window_end(lane.sidecar.cadence, text, chars, tokens - counted, out.finished)
            if end > chars or (out.finished and lane.sidecar.cadence.kind in ("request", "turn")):
                lane.offer(Window(rid, text[chars:end], text, out.finished, chars))
                self._cut[(lane.sidecar.name, rid)] = (end, tokens)
        if out.finished:
            self._forget(rid)

    def _forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._turns.discard(request_id)
        for name in self.lanes:
            self._cut.pop((name, request_id), None)

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: lane.stats.as_dict() for name, lane in self.lanes.items()}

    def close(self) -> None:
        """Stop the workers once their queued windows are done (they are daemon threads: one
        stuck in a call does not keep the process alive)."""
        for lane in self.lanes.values():
            for _ in lane.threads:
                lane.queue.put(None)


def _window_end(cadence: Cadence, text: str, start: int, new_tokens: int, finished: bool) -> int:
    """Where the next window of `text` (from `start`) ends; `start` when none is due."""
    if cadence.kind in ("request", "turn"):
        return len(text) if finished else start
    if finished or (cadence.kind == "tokens" and new_tokens >= cadence.every):
        return len(text)
    if cadence.kind == "clause":
        ends = [m.end() for m in CLAUSE_END.finditer(text, start)]
        return ends[-1] if ends else start
    return start


@contextlib.contextmanager
def _placed(placement: Placement):
    """The worker's placement: on CUDA its calls queue on a stream of their own at the lowest
    priority (CUDA's default, 0), never on the stream the decode steps use."""
    if placement.device != "cuda":
        yield
        return
    import torch

    with torch.cuda.stream(torch.cuda.Stream(priority=0)):
        yield
