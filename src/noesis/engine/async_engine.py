"""AsyncEngine: Engine steps run off the event loop, and their outputs reach asyncio tasks.

An EngineLoop owns the Engine: it applies commands (add, abort, stop) between steps, so the
engine needs no locks, steps, and sends each round back as one Report. It runs in a child
process (EngineProcess, what `noesis serve` uses, so that a step never waits for the GIL behind
HTTP work, nor the reverse) or on a thread (EngineThread). Requests ask for delta outputs (only
what a step added), so no step copies a request's history; the event loop files each output in
its consumer's Outbox, and a consumer that fell behind takes all that is pending in one wake-up,
merged per request. Requests join and leave the running batch at any step (continuous
batching). A request whose grammar is compiling waits outside the batch and is accepted once
it compiled. A failure one request explains ends that request alone (the engine isolates it); a
step that fails for no one request fails the requests in flight, and in a child process the
engine then exits and AsyncEngine starts a fresh one while the server stays up.

This module is the client; the engine loop and the child's main are in engine/loop.py, the two
ways of running it (thread, process) in engine/transport.py, what travels between them in
engine/messages.py, and EngineStats in engine/stats.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from noesis.engine.messages import EngineDead, Report
from noesis.engine.outputs import RequestOutput, merge_deltas
from noesis.engine.stats import EngineStats
from noesis.engine.transport import EngineProcess, EngineThread
from noesis.errors import NoesisError
from noesis.sampling.params import SamplingParams

log = logging.getLogger("noesis.engine")

Item = RequestOutput | BaseException  # what an Outbox holds for a request: a delta, or its end
# A fresh engine process after each fault, but not more than this many within RESTART_WINDOW_S:
# an engine that keeps failing is left down (503s, /health unavailable) instead of looping.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0


class QueueFull(NoesisError):
    """Admission control: too many requests in flight; retry after `retry_after` seconds."""

    def __init__(self, in_flight: int, limit: int, retry_after: int = 1) -> None:
        super().__init__(
            f"the server is at capacity ({in_flight} requests in flight, limit {limit}); "
            f"retry after {retry_after} s"
        )
        self.retry_after = retry_after


class RequestFailed(NoesisError):
    """One request failed on its own (its logits, its grammar, a step that failed only with it);
    the engine and the other requests went on."""


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_token: float | None = None
    finished: float | None = None


class Outbox:
    """Outputs bound for one consumer task: one request's, or those of all choices of an API call.

    A list and at most one waiting future, cheaper than an asyncio.Queue; a consumer that fell
    behind takes everything pending in one wake-up, merged per request.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[tuple[int, Item]] = []
        self._waiter: asyncio.Future | None = None

    def put(self, index: int, item: Item) -> None:
        self._items.append((index, item))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[int, Item]]:
        """Wait for news; each request (by index) appears once, in the order it first advanced."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items if len(items) == 1 else _merge_by_index(items)


def _merge_by_index(items: list[tuple[int, Item]]) -> list[tuple[int, Item]]:
    grouped: dict[int, list[Item]] = {}
    for index, item in items:
        grouped.setdefault(index, []).append(item)
    merged: list[tuple[int, Item]] = []
    for index, group in grouped.items():
        errors = [item for item in group if isinstance(item, BaseException)]
        outputs = [item for item in group if isinstance(item, RequestOutput)]
        merged.append((index, errors[0] if errors else merge_deltas(outputs)))
    return merged


@dataclass(slots=True, eq=False)
class _Request:
    """Event-loop side of one request: where its outputs go, and its timings."""

    request_id: str
    prompt_token_ids: list[int]
    outbox: Outbox
    index: int  # its consumer's number for it (a choice index)
    added: asyncio.Future
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.perf_counter()))


class RequestStream:
    """One request: its id, timings, admission, and (when it has its own Outbox) its outputs."""

    def __init__(self, engine: AsyncEngine, request: _Request, own_outbox: bool) -> None:
        self._engine = engine
        self._request = request
        self._own_outbox = own_outbox

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def index(self) -> int:
        return self._request.index

    @property
    def times(self) -> RequestTimes:
        return self._request.times

    async def started(self) -> None:
        """Wait until the engine accepted the request (raises the engine's validation error)."""
        await self._request.added

    def close(self) -> None:
        """Abort the request unless it already ended."""
        self._engine._close(self._request)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Delta outputs until the finished one; several pending ones come merged as one."""
        assert self._own_outbox, "this request shares its Outbox: read that instead"
        request = self._request
        try:
            await request.added
            while True:
                for _, item in await request.outbox.take():
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finished:
                        return
        finally:
            self.close()

    async def result(self) -> RequestOutput:
        """Wait for the end; returns the whole output (all deltas merged)."""
        deltas = [out async for out in self]
        assert deltas and deltas[-1].finished
        return merge_deltas(deltas)


class AsyncEngine:
    """The event loop's handle on the engine: admission, request outboxes, and reports."""

    def __init__(self, backend: EngineThread | EngineProcess, max_in_flight: int) -> None:
        self.backend = backend
        self.max_in_flight = max_in_flight
        self._requests: dict[str, _Request] = {}
        self._stopping = False
        self._lost = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._stats = EngineStats()
        self.num_step_failures = 0
        self.num_restarts = 0
        self._restarting = False
        self._restart_times: list[float] = []
        self._restart_task: asyncio.Future | None = None
        self._embeddings: dict[str, asyncio.Future] = {}  # embed_id -> its result, once reported
        # fault counters of engine processes that were replaced (a fresh one counts from 0)
        self._past_faults = {"isolated_steps": 0, "request_errors": 0}

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self.backend.start(self._on_report, self._on_lost)

    @property
    def alive(self) -> bool:
        return self.backend.alive and not (self._stopping or self._lost or self._restarting)

    def fault_counts(self) -> dict[str, int]:
        """Steps isolated and requests failed alone, over every engine process so far."""
        stats = self._stats
        now = {"isolated_steps": stats.isolated_steps, "request_errors": stats.request_errors}
        return {key: self._past_faults[key] + now[key] for key in now}

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def stats(self) -> EngineStats:
        return self._stats

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the engine loop."""
        self._stopping = True
        self.fail_all(EngineDead("the server is shutting down"))
        await self.backend.stop()

    # ---- requests ----------------------------------------------------------------------------

    def add(
        self,
        token_ids: list[int],
        params: list[SamplingParams],
        outbox: Outbox | None = None,
        first_index: int = 0,
    ) -> list[RequestStream]:
        """Queue one request per params (all or none). Without `outbox` each request gets its
        own and its stream yields its outputs; with one, they all go there, numbered from
        `first_index` in params order, and the caller reads the outbox."""
        if self._stopping or self._lost:
            raise EngineDead("the engine is not running")
        if self._restarting:
            raise EngineDead("the engine is restarting after a failure; retry in a few seconds")
        if len(self._requests) + len(params) > self.max_in_flight:
            raise QueueFull(len(self._requests), self.max_in_flight)
        streams = []
        for index, one in enumerate(params, first_index):
            request = _Request(
                f"req-{next(self._ids)}",
                token_ids,
                outbox if outbox is not None else Outbox(),
                index,
                self._loop.create_future(),
            )
            self._requests[request.request_id] = request
            self.backend.send(("add", request.request_id, token_ids, one))
            streams.append(RequestStream(self, request, own_outbox=outbox is None))
        return streams

    async def embed(self, prompts: list[list[int]], pooling: str):
        """Pooled embeddings [N, D] (a float32 numpy array) of whole prompts, which the engine
        loop computes between two steps; raises what the engine raised (InvalidRequest, ...)."""
        if self._stopping or self._lost or self._restarting:
            raise EngineDead("the engine is not running")
        embed_id = f"emb-{next(self._ids)}"
        future = self._embeddings[embed_id] = self._loop.create_future()
        self.backend.send(("embed", embed_id, prompts, pooling))
        try:
            return await future
        finally:
            self._embeddings.pop(embed_id, None)

    def branches(self, request_ids: list[str], keep: int, tools: list[dict] | None = None,
                 context: str | None = None) -> None:
        """Declare requests this engine was given as branches of one request, `keep` of which
        must finish (Engine.add_branches): the binding gate may prune the others. Sent after
        their adds, so the engine has them when it reads this."""
        self.backend.send(("branches", list(request_ids), keep, tools, context))

    def show_turn(self, request_id: str, messages: list[dict], tools: list[dict]) -> None:
        """Show the engine's turn sidecars (intent) a request's conversation and declared tools
        (Engine.show_turn); sent after its add."""
        self.backend.send(("turn", request_id, messages, tools))

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._close(request)

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (their consumers then abort them)."""
        for request in list(self._requests.values()):
            self._fail(request, error)
        for future in self._embeddings.values():
            if not future.done():
                future.set_exception(error)

    def _close(self, request: _Request) -> None:
        """Forget a request; abort it in the engine unless it already ended there.

        Requests that finished, were rejected or failed with their step are unregistered
        before their consumer closes them; anything still registered may be in the engine.
        """
        if self._requests.pop(request.request_id, None) is None:
            return
        self.backend.send(("abort", request.request_id))

    def _fail(self, request: _Request, error: BaseException) -> None:
        if not request.added.done():
            request.added.set_exception(error)
            request.added.exception()  # mark retrieved: a stream never iterated is no error
        request.outbox.put(request.index, error)

    # ---- reports from the engine loop --------------------------------------------------------

    def _on_report(self, report: Report) -> None:
        for request_id in report.accepted:
            request = self._requests.get(request_id)
            if request is not None and not request.added.done():
                request.added.set_result(None)
        for request_id, exc in report.rejected:
            request = self._requests.pop(request_id, None)
            if request is not None and not request.added.done():
                request.added.set_exception(exc)
                request.added.exception()
        if report.outputs:
            self._dispatch(report.outputs)
        for embed_id, result in report.embedded:
            future = self._embeddings.get(embed_id)
            if future is not None and not future.done():
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
        if report.error is not None:
            self.num_step_failures += 1
            for request_id in report.failed:
                request = self._requests.pop(request_id, None)
                if request is not None:
                    self._fail(request, report.error)
        if report.stats is not None:
            self._stats = report.stats

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """One engine step's outputs: file each with its consumer (O(1) per output)."""
        now = time.perf_counter()
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # closed by its consumer; the abort is on its way to the engine
            out.prompt_token_ids = request.prompt_token_ids
            times = request.times
            if times.first_token is None and out.token_ids:
                times.first_token = now
            if out.finished:
                times.finished = now
                del self._requests[out.request_id]
            item: Item = out if out.error is None else RequestFailed(out.error)
            request.outbox.put(request.index, item)

    def _on_lost(self, error: BaseException) -> None:
        """The engine loop ended on its own (a fault, a crash): fail what was in flight, then
        start a fresh engine process where the backend can, within the restart budget."""
        self.fail_all(error)
        self._past_faults = self.fault_counts()
        self._stats = EngineStats()
        if self._stopping or not self._may_restart():
            self._lost = True
            return
        log.warning("the engine stopped (%s); starting a fresh engine process", error)
        self._restarting = True
        self._restart_task = asyncio.ensure_future(self._restart())

    def _may_restart(self) -> bool:
        if not self.backend.restartable:
            return False
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S]
        if len(self._restart_times) >= MAX_RESTARTS:
            log.error("the engine failed %d times in %g s: it stays down", MAX_RESTARTS,
                      RESTART_WINDOW_S)
            return False
        self._restart_times.append(now)
        return True

    async def _restart(self) -> None:
        old = self.backend
        old.close()  # here, on the loop: it removes the loop's reader of the old pipe
        try:
            fresh = await asyncio.to_thread(old.respawn)
        except Exception:
            log.exception("the engine could not be restarted: it stays down")
            self._lost = True
            return
        finally:
            self._restarting = False
        if self._stopping:
            fresh.close()
            return
        self.backend = fresh
        self.num_restarts += 1
        fresh.start(self._on_report, self._on_lost)
        log.warning("a fresh engine process serves (restart %d)", self.num_restarts)
