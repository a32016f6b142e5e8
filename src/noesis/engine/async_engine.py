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
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from noesis.engine.children import become_child
from noesis.engine.engine import Engine, EngineConfig, EngineFault, format_timings
from noesis.engine.outputs import RequestOutput, merge_deltas
from noesis.errors import NoesisError
from noesis.sampling.defaults import generation_defaults
from noesis.sampling.params import SamplingParams
from noesis.tokenizer import Tokenizer

log = logging.getLogger("noesis.engine")

Item = RequestOutput | BaseException  # what an Outbox holds for a request: a delta, or its end
# ("add", request_id, token_ids, params) | ("abort", request_id) | ("stop",)
# | ("embed", embed_id, prompts, pooling)
Command = tuple[Any, ...]
COMPILE_POLL_S = 0.005  # how often an otherwise idle engine loop looks at compiling grammars
# The child's exit status after a step failed for no one request: "start a fresh engine".
EXIT_FAULT = 70
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


class EngineDead(NoesisError):
    """The engine stopped (shutdown or a failure) before the request finished."""


class EngineStepError(NoesisError):
    """An engine step failed; the requests it carried were aborted."""


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


# ---- the engine's side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about the engine it drives."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int
    # generation_config.json's temperature, top_p, top_k, repetition_penalty, where it sets them:
    # what a request that leaves them unset samples with (noesis.sampling.defaults)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(engine.tokenizer, engine.max_model_len, engine.config.max_num_seqs,
                   generation_defaults(engine.loaded.model_dir))


@dataclass(slots=True)
class EngineStats:
    """Engine state for /metrics, as of the end of the engine loop's latest round."""

    waiting: int = 0
    running: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    kv_pages_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens computed so far (the scheduler's count)
    generation_tokens: int = 0  # tokens generated so far
    compiling: int = 0  # requests waiting for their grammar
    isolated_steps: int = 0  # steps that failed and were re-run one sequence at a time
    request_errors: int = 0  # requests ended by a failure of their own
    grammar: dict[str, int] = field(default_factory=dict)  # the grammar compiler's stats()
    speculative: dict[str, int] = field(default_factory=dict)  # Engine.spec_counts ({}: off)
    telemetry: dict[str, tuple] = field(default_factory=dict)  # its histograms ({}: off)
    sidecars: dict[str, dict] = field(default_factory=dict)  # SidecarRuntime.stats() ({}: none)

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        scheduler, allocator, cache = engine.scheduler, engine.allocator, engine.prefix_cache
        return cls(
            grammar=engine.grammar_stats(),
            speculative=engine.spec_counts,
            telemetry=engine.observer.telemetry.snapshot()
            if engine.observer is not None and engine.observer.telemetry is not None else {},
            compiling=engine.num_compiling,
            sidecars=engine.sidecars.stats() if engine.sidecars is not None else {},
            isolated_steps=engine.fault_counts["isolated_steps"],
            request_errors=engine.fault_counts["request_errors"],
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
            kv_pages_total=allocator.num_pages,
            kv_pages_used=allocator.num_used,
            kv_pages_free=allocator.num_free,
            kv_pages_cached=allocator.num_parked,
            prefix_query_tokens=cache.query_tokens if cache else 0,
            prefix_hit_tokens=cache.hit_tokens if cache else 0,
            prompt_tokens=scheduler.num_prompt_tokens,
            generation_tokens=scheduler.num_generated_tokens,
        )


@dataclass(slots=True)
class Report:
    """One round of the engine loop: the adds it took or refused, the step's outputs, the
    requests a failed step took down (and why), and the engine state after it all."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: BaseException | None = None  # why `failed` failed
    stats: EngineStats | None = None
    # (embed_id, pooled embeddings [N, D] as a float32 numpy array, or why not) per "embed"
    embedded: list[tuple[str, Any]] = field(default_factory=list)


class EngineLoop:
    """The engine's side: apply the commands that came (waiting for one only while idle), admit
    compiled requests, step, report the round. With `exit_on_fault`, a step that fails for no
    one request ends the loop (raising EngineFault) once its round is reported."""

    def __init__(
        self,
        engine: Engine,
        receive: Callable[[float | None], list[Command]],
        report: Callable[[Report], None],
        stats: Callable[[Engine], EngineStats] = EngineStats.of,
        exit_on_fault: bool = False,
    ) -> None:
        self.engine = engine
        self.receive = receive  # receive(timeout) -> commands; None: wait for one, 0: don't wait
        self.report = report
        self.stats = stats
        self.exit_on_fault = exit_on_fault

    def run(self) -> None:
        while True:
            report = Report()
            if not self._apply(self.receive(self._wait_s()), report):
                break
            if self.engine.num_compiling:
                admitted, rejected = self.engine.poll_compiles()
                report.accepted += admitted
                report.rejected += rejected
            if report.accepted or report.rejected or report.embedded:
                self.report(report)  # answers now: their responses get ready during the step
                report = Report()
            fault = self._step(report) if self.engine.has_unfinished() else None
            report.stats = self.stats(self.engine)
            self.report(report)
            if fault is not None and self.exit_on_fault:
                raise EngineFault("the engine state is unknown after a failed step") from fault
        self.engine.abort_all()

    def _wait_s(self) -> float | None:
        if self.engine.has_unfinished():
            return 0
        return COMPILE_POLL_S if self.engine.num_compiling else None

    def _apply(self, commands: list[Command], report: Report) -> bool:
        """Adds and aborts, in order; False at a stop. An add whose grammar is still compiling
        is answered when poll_compiles() admits or rejects it."""
        for command in commands:
            if command[0] == "add":
                _, request_id, token_ids, params = command
                try:
                    self.engine.add_request(
                        token_ids, params, request_id, delta=True, wait_for_grammar=False
                    )
                except Exception as exc:
                    report.rejected.append((request_id, exc))
                else:
                    if not self.engine.is_compiling(request_id):
                        report.accepted.append(request_id)
            elif command[0] == "abort":
                self.engine.abort(command[1])
            elif command[0] == "embed":
                report.embedded.append(self._embed(*command[1:]))
            else:
                return False
        return True

    def _embed(self, embed_id: str, prompts: list[list[int]], pooling: str) -> tuple[str, Any]:
        """Pooled embeddings of `prompts`, run here between two steps (never during one)."""
        try:
            return embed_id, self.engine.embed(prompts, pooling).numpy()
        except Exception as exc:
            return embed_id, exc

    def _step(self, report: Report) -> BaseException | None:
        """One engine step into `report`; returns what it raised (the requests in flight then
        fail), or None."""
        try:
            report.outputs = self.engine.step()
        except Exception as exc:  # keep serving: fail only the requests in flight
            log.exception("engine step failed")
            report.failed = [out.request_id for out in self.engine.abort_all()]
            report.error = EngineStepError(f"the engine step failed: {exc!r}")
            return exc
        return None


OnReport = Callable[[Report], None]
OnLost = Callable[[BaseException], None]


class EngineThread:
    """The EngineLoop on a thread of this process: it shares the GIL with the event loop. It is
    not restarted after a fault: its loop aborts the requests in flight and goes on."""

    restartable = False

    def __init__(self, engine: Engine, stats: Callable[[Engine], EngineStats] = EngineStats.of):
        self.engine = engine
        self._stats = stats
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, on_report: OnReport, on_lost: OnLost) -> None:
        loop = asyncio.get_running_loop()

        def report(r: Report) -> None:
            loop.call_soon_threadsafe(on_report, r)

        def run() -> None:
            try:
                EngineLoop(self.engine, self._receive, report, self._stats).run()
            except BaseException as exc:
                log.exception("the engine loop died")
                loop.call_soon_threadsafe(on_lost, EngineDead(f"the engine loop died: {exc!r}"))

        self._thread = threading.Thread(target=run, name="noesis-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    async def stop(self) -> None:
        self.send(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def close(self) -> None:
        pass

    def _receive(self, timeout: float | None) -> list[Command]:
        commands = []
        if timeout != 0:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands


class EngineProcess:
    """The Engine and its EngineLoop in a child process, so that HTTP work and engine steps never
    queue for one GIL. Commands go down a pipe from a sender thread (the event loop never blocks
    on a full pipe); reports come up another, read by the event loop as they arrive. After a
    fault the child exits; `respawn()` loads a fresh one with the same arguments."""

    restartable = True

    def __init__(
        self,
        process: BaseProcess,
        commands: Connection,
        reports: Connection,
        info: EngineInfo,
        spawn_args: tuple[str, EngineConfig, str],
    ) -> None:
        self._spawn_args = spawn_args
        self._process = process
        self._commands = commands  # Connection, parent -> child
        self._reports = reports  # Connection, child -> parent
        self.info = info
        self._outgoing: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def spawn(cls, model: str, config: EngineConfig, log_level: str = "info") -> EngineProcess:
        """Start the child and wait while it loads the model; raises what loading raised."""
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        child_commands, commands = context.Pipe(duplex=False)
        reports, child_reports = context.Pipe(duplex=False)
        process = context.Process(
            target=_engine_process_main,
            args=(model, config, log_level, child_commands, child_reports),
            name="noesis-engine",
            daemon=True,
        )
        process.start()
        child_commands.close()
        child_reports.close()
        try:
            kind, payload = reports.recv()
        except EOFError:
            process.join()
            exitcode = process.exitcode
            raise EngineDead(f"the engine process exited ({exitcode}) while loading") from None
        if kind == "error":
            process.join()
            raise _unpack_error(payload)
        backend = cls(process, commands, reports, payload, (model, config, log_level))
        atexit.register(backend.close)  # before multiprocessing's own exit hook joins the child
        return backend

    def respawn(self) -> EngineProcess:
        """A fresh child with this one's arguments (blocks while it loads: call it off the event
        loop, once this one is closed)."""
        return EngineProcess.spawn(*self._spawn_args)

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def start(self, on_report: OnReport, on_lost: OnLost) -> None:
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self._reports.fileno(), self._read, on_report, on_lost)
        self._sender = threading.Thread(target=self._send_all, name="noesis-commands", daemon=True)
        self._sender.start()

    def send(self, command: Command) -> None:
        self._outgoing.put(command)

    async def stop(self) -> None:
        self.send(("stop",))
        self._outgoing.put(None)
        await asyncio.to_thread(self._process.join, 30)
        self.close()

    def close(self) -> None:
        """Make sure the child is gone (idempotent). After stop() it has exited; otherwise there
        is nothing to drain, and it ignores SIGTERM (its parent drains first), so: SIGKILL."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._reports.fileno())
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._outgoing.put(None)

    def _send_all(self) -> None:
        while (command := self._outgoing.get()) is not None:
            try:
                self._commands.send(command)
            except (OSError, ValueError):  # the child is gone; its reader reports that
                return

    def _read(self, on_report: OnReport, on_lost: OnLost) -> None:
        try:
            while self._reports.poll():
                report = self._reports.recv()
                report.rejected = [(i, _unpack_error(e)) for i, e in report.rejected]
                report.embedded = [(i, _unpack_error(r) if isinstance(r, tuple) else r)
                                   for i, r in report.embedded]
                if report.error is not None:
                    report.error = _unpack_error(report.error)
                on_report(report)
        except (EOFError, OSError):
            self._loop.remove_reader(self._reports.fileno())
            on_lost(EngineDead(f"the engine process exited ({self._process.exitcode})"))


def _engine_process_main(
    model: str, config: EngineConfig, log_level: str, commands: Connection, reports: Connection
) -> None:
    """The child: load the Engine, say ready (or why not), then run the EngineLoop on the pipes.
    Once loaded, the parent alone decides when it ends (it drains first): SIGINT and SIGTERM
    are ignored, and a closed pipe means stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent's
    become_child("noesis-engine")  # it never outlives the server, even while loading
    setup_logging(log_level)
    try:
        engine = Engine(model, config)
        warm_up(engine)
        info = EngineInfo.of(engine)
    except BaseException as exc:
        reports.send(("error", _pack_error(exc)))
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipes = _ChildPipes(commands, reports)
    if pipes.send(("ready", info)):
        gc.collect()
        gc.freeze()  # the model and libraries stay: collections scan only what steps allocate
        try:
            EngineLoop(engine, pipes.receive, pipes.report, exit_on_fault=True).run()
            engine.close()  # telemetry and trace files flushed
        except EngineFault:
            log.exception("engine fault: this engine process exits, the server starts another")
            logging.shutdown()
            os._exit(EXIT_FAULT)  # no teardown of a device in an unknown state


class _ChildPipes:
    """The child's ends of the pipes: commands in, reports out. A parent gone reads as a stop."""

    def __init__(self, commands: Connection, reports: Connection) -> None:
        self.commands = commands
        self.reports = reports
        self.parent_gone = False

    def receive(self, timeout: float | None) -> list[Command]:
        received: list[Command] = []
        try:
            if not self.parent_gone and self.commands.poll(timeout):
                received.append(self.commands.recv())
            while not self.parent_gone and self.commands.poll():
                received.append(self.commands.recv())
        except (EOFError, OSError):
            self.parent_gone = True
        return received + [("stop",)] if self.parent_gone else received

    def report(self, report: Report) -> None:
        for out in report.outputs:
            out.prompt_token_ids = []  # the parent has them: never resend a prompt per step
        report.rejected = [(i, _pack_error(e)) for i, e in report.rejected]  # type: ignore[misc]
        report.embedded = [(i, _pack_error(r) if isinstance(r, BaseException) else r)
                           for i, r in report.embedded]
        if report.error is not None:
            report.error = _pack_error(report.error)  # type: ignore[assignment]
        self.send(report)

    def send(self, message: Any) -> bool:
        try:
            self.reports.send(message)
        except OSError:
            self.parent_gone = True
        return not self.parent_gone


def warm_up(engine: Engine) -> None:
    """Before serving: on CUDA, run one short request (first-call costs paid before the first
    client's); either way, log the start-up timing buckets."""
    if engine.device.type == "cuda":
        engine.warm_up()
    else:
        log.info("engine ready: %s", format_timings(engine.timings))


def setup_logging(level: str) -> None:
    """Send noesis's log records to stderr at `level` (server and engine process alike)."""
    logger = logging.getLogger("noesis")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def _pack_error(exc: BaseException) -> tuple:
    """An exception as (class, args, attributes): our errors' __init__ signatures differ from
    their args, so plain pickling cannot rebuild them."""
    packed = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.dumps(packed)
    except Exception:
        return (NoesisError, (f"{type(exc).__name__}: {exc}",), {})
    return packed


def _unpack_error(packed: tuple) -> BaseException:
    cls, args, attributes = packed
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc


# ---- the event loop's side -----------------------------------------------------------------------


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
