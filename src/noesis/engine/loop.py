"""The engine's side: EngineLoop applies commands between steps and reports each round; the
child process's main runs it on the pipes (EngineProcess starts it)."""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from noesis.engine.children import become_child
from noesis.engine.engine import Engine, EngineConfig, EngineFault, format_timings
from noesis.engine.messages import Command, EngineInfo, EngineStepError, Report, pack_error
from noesis.engine.stats import EngineStats
from noesis.errors import InvalidRequest

log = logging.getLogger("noesis.engine")

COMPILE_POLL_S = 0.005  # how often an otherwise idle engine loop looks at compiling grammars
# The child's exit status after a step failed for no one request: "start a fresh engine".
EXIT_FAULT = 70


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
            elif command[0] == "branches":
                try:
                    self.engine.add_branches(*command[1:])
                except InvalidRequest as exc:  # the caller's mistake: its branches run ungated
                    log.warning("branches not gated: %s", exc)
            elif command[0] == "turn":  # the intent sidecar's view of a served turn
                self.engine.show_turn(*command[1:])
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


def run_engine_process(
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
        reports.send(("error", pack_error(exc)))
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
        report.rejected = [(i, pack_error(e)) for i, e in report.rejected]  # type: ignore[misc]
        report.embedded = [(i, pack_error(r) if isinstance(r, BaseException) else r)
                           for i, r in report.embedded]
        if report.error is not None:
            report.error = pack_error(report.error)  # type: ignore[assignment]
        self.send(report)

    def send(self, message: Any) -> bool:
        try:
            self.reports.send(message)
        except OSError:
            self.parent_gone = True
        return not self.parent_gone


def warm_up(engine: Engine) -> None:
    """Before serving: on CUDA, run one short request (first-call costs paid before the first
    client's); either way, log the start-up timing buckets and the sidecars that run."""
    if engine.device.type == "cuda":
        engine.warm_up()
    else:
        log.info("engine ready: %s", format_timings(engine.timings))
    sidecars = engine.config.sidecars
    for spec in sidecars.sidecars if sidecars is not None else ():
        log.info("sidecar %s", spec.describe())


def setup_logging(level: str) -> None:
    """Send noesis's log records to stderr at `level` (server and engine process alike)."""
    logger = logging.getLogger("noesis")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
