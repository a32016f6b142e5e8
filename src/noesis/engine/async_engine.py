"""AsyncEngine: runs Engine.step() on one background thread and streams outputs to asyncio tasks.

The thread owns the Engine: adds and aborts reach it as commands it drains between steps, so the
engine needs no locks. Each request gets an asyncio queue; after every step the thread hands all
outputs to the event loop in one call. Requests join and leave the running batch at any step
(continuous batching); a step failure fails the requests in flight, never the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from noesis.engine.engine import Engine
from noesis.engine.outputs import RequestOutput
from noesis.errors import NoesisError
from noesis.sampling.params import SamplingParams

log = logging.getLogger("noesis.engine")


class QueueFull(NoesisError):
    """Admission control: too many requests in flight; retry after `retry_after` seconds."""

    def __init__(self, in_flight: int, limit: int, retry_after: int = 1) -> None:
        super().__init__(
            f"the server is at capacity ({in_flight} requests in flight, limit {limit}); "
            f"retry after {retry_after} s"
        )
        self.retry_after = retry_after


class EngineDead(NoesisError):
    """The engine stopped (shutdown or a failure) before the request finished."""


class EngineStepError(NoesisError):
    """An engine step failed; the requests it carried were aborted."""


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class _Request:
    """Event-loop side of one request: its queue of outputs and its timings."""

    request_id: str
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    added: asyncio.Future | None = None
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.perf_counter()))
    done: bool = False


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request: _Request) -> None:
        self._engine = engine
        self._request = request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def times(self) -> RequestTimes:
        return self._request.times

    async def started(self) -> None:
        """Wait until the engine accepted the request (raises the engine's validation error)."""
        await self._request.added

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        request = self._request
        try:
            await request.added
            while not request.done:
                yield self._latest(await request.outputs.get())
        finally:
            self._engine._close(request)

    def _latest(self, item) -> RequestOutput:
        """Outputs are cumulative: when several are queued, only the newest one matters."""
        request = self._request
        while isinstance(item, RequestOutput) and not item.finished:
            try:
                item = request.outputs.get_nowait()
            except asyncio.QueueEmpty:
                break
        if isinstance(item, BaseException):
            request.done = True
            raise item
        now = time.perf_counter()
        if request.times.first_token is None and item.token_ids:
            request.times.first_token = now
        if item.finished:
            request.times.finished = now
            request.done = True
        return item

    async def result(self) -> RequestOutput:
        """Wait for the final output."""
        last = None
        async for out in self:
            last = out
        assert last is not None and last.finished
        return last


class AsyncEngine:
    def __init__(self, engine: Engine, max_in_flight: int) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._requests: dict[str, _Request] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.num_step_failures = 0

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="noesis-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the thread."""
        self._stopping = True
        self.fail_all(EngineDead("the server is shutting down"))
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- requests (event loop side) ----------------------------------------------------------

    def add(self, token_ids: list[int], params: list[SamplingParams]) -> list[RequestStream]:
        """Queue one request per params (all or none); each stream yields its outputs."""
        if self._stopping:
            raise EngineDead("the server is shutting down")
        if len(self._requests) + len(params) > self.max_in_flight:
            raise QueueFull(len(self._requests), self.max_in_flight)
        streams = []
        for one in params:
            request = _Request(f"req-{next(self._ids)}")
            request.added = self._loop.create_future()
            self._requests[request.request_id] = request
            self._commands.put(("add", request, token_ids, one))
            streams.append(RequestStream(self, request))
        self._wake.set()
        return streams

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._close(request)

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (their consumers then abort them)."""
        for request in list(self._requests.values()):
            self._fail(request, error)

    def _close(self, request: _Request) -> None:
        """Forget a request; abort it in the engine unless it already ended there.

        Requests that finished, were rejected or failed with their step are unregistered
        before their consumer closes them; anything still registered may be in the engine.
        """
        if self._requests.pop(request.request_id, None) is None:
            return
        request.done = True
        self._commands.put(("abort", request.request_id))
        self._wake.set()

    def _fail(self, request: _Request, error: BaseException) -> None:
        if request.added is not None and not request.added.done():
            request.added.set_exception(error)
            request.added.exception()  # mark retrieved: a stream never iterated is no error
        request.outputs.put_nowait(error)

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail only the requests in flight
                log.exception("engine step failed")
                self._fail_running(exc)
                continue
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        self._drain_commands()
        self.engine.abort_all()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._engine_add(*command[1:])
            else:
                self.engine.abort(command[1])

    def _engine_add(self, request: _Request, token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(token_ids, params, request.request_id)
        except Exception as exc:
            self._loop.call_soon_threadsafe(self._reject, request, exc)
            return
        self._loop.call_soon_threadsafe(self._accept, request)

    def _fail_running(self, exc: Exception) -> None:
        self.num_step_failures += 1
        error = EngineStepError(f"the engine step failed: {exc!r}")
        ids = [out.request_id for out in self.engine.abort_all()]
        self._loop.call_soon_threadsafe(self._fail_ids, ids, error)

    # ---- event loop callbacks ----------------------------------------------------------------

    def _accept(self, request: _Request) -> None:
        if not request.added.done():
            request.added.set_result(None)

    def _reject(self, request: _Request, exc: Exception) -> None:
        self._requests.pop(request.request_id, None)
        request.done = True
        if not request.added.done():
            request.added.set_exception(exc)
            request.added.exception()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue  # closed by its consumer; the abort is on its way to the engine
            if out.finished:
                del self._requests[out.request_id]
            request.outputs.put_nowait(out)

    def _fail_ids(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._fail(request, error)
