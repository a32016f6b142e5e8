"""Where the engine loop runs, and how commands and reports travel: EngineThread (a thread of
this process, queues) or EngineProcess (a child process, pipes)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from noesis.engine.engine import Engine, EngineConfig
from noesis.engine.loop import EngineLoop, run_engine_process
from noesis.engine.messages import Command, EngineDead, EngineInfo, Report, unpack_error
from noesis.engine.stats import EngineStats

log = logging.getLogger("noesis.engine")


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
            target=run_engine_process,
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
            raise unpack_error(payload)
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
                report.rejected = [(i, unpack_error(e)) for i, e in report.rejected]
                report.embedded = [(i, unpack_error(r) if isinstance(r, tuple) else r)
                                   for i, r in report.embedded]
                if report.error is not None:
                    report.error = unpack_error(report.error)
                on_report(report)
        except (EOFError, OSError):
            self._loop.remove_reader(self._reports.fileno())
            on_lost(EngineDead(f"the engine process exited ({self._process.exitcode})"))
