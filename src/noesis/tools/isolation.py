"""Worker processes for isolated tools: a small pool, started on first use and reused, whose worker
is killed (and later replaced) when its call times out or is cancelled, which a thread cannot be.

A worker is a fresh interpreter (`python -c`, not multiprocessing): it imports only this module
and what unpickling the call needs, never the caller's `__main__`, so a script without an
`if __name__ == "__main__":` guard is not run again. Calls and replies are pickles, framed by
length, over two pipes.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from noesis.engine.children import become_child
from noesis.errors import ConfigError
from noesis.tools.registry import as_content

log = logging.getLogger(__name__)

DEFAULT_MAX_WORKERS = 4  # the executor's default concurrency: one turn's calls never queue
REAP_TIMEOUT_S = 5.0  # a SIGKILLed worker is reaped in milliseconds; this only bounds a stuck wait
_FRAME = struct.Struct("!Q")  # the byte length before each pickle
_BOOT = "import sys; from noesis.tools.isolation import serve; serve(*map(int, sys.argv[1:]))"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One call's end: the content for the model, or the exception the tool raised."""

    content: str | None = None
    exc: BaseException | None = None


class RemoteError(Exception):
    """An exception from a worker process that could not travel back as itself (its class does
    not pickle); `type_name` keeps what it was."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return RemoteError, (self.type_name, str(self))


class WorkerError(Exception):
    """The worker process, not the tool, failed: it died, could not start, or the call's function
    or arguments cannot be sent to it."""


_shared: WorkerPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> WorkerPool:
    """The process-wide pool that executors use unless given their own; no process starts
    until an isolated tool is called."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WorkerPool()
        return _shared


def _imported(functions: list[Callable[..., Any]]) -> None:
    """Run in a worker by WorkerPool.warm: unpickling `functions` imported their modules."""
    return None


def describe(exc: BaseException) -> str:
    """`TypeName: message` of an exception, a RemoteError by the type it stands for."""
    type_name = exc.type_name if isinstance(exc, RemoteError) else type(exc).__name__
    return f"{type_name}: {_text(exc)}"


class WorkerPool:
    """Up to `max_workers` worker processes, each running one call at a time. Workers start when
    a call finds none idle and stay for later calls; a stopped call's worker is killed. Workers
    are killed when this process exits, and leave by themselves if it dies."""

    def __init__(self, max_workers: int = DEFAULT_MAX_WORKERS) -> None:
        if max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._changed = threading.Condition()
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()  # started and not discarded, idle or busy
        self._live = 0  # the same, plus workers being started
        atexit.register(self.close)

    def job(self, function: Callable[..., Any], kwargs: dict[str, Any]) -> Job:
        """A call of `function(**kwargs)` to `run` on a helper thread and `stop` from any other."""
        return Job(self, function, kwargs)

    def warm(self, functions: Iterable[Callable[..., Any]]) -> None:
        """Start a worker now (unless one is idle) and import the modules of `functions` in it,
        so that the first real call does not wait for a process and its imports (0.37 s for
        the calculator on a 2-core machine). Blocks until done; a failure only logs."""
        outcome = self.job(_imported, {"functions": list(functions)}).run()
        if outcome.exc is not None:
            log.warning("tool worker warm-up failed: %s", describe(outcome.exc))

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers, idle or busy (not one a stopped call killed and
        whose Job thread has yet to discard it)."""
        with self._changed:
            return sorted(worker.pid for worker in self._workers if worker.alive())

    def close(self) -> None:
        """Kill every worker; calls running in them end with a WorkerError outcome. The pool
        stays usable: a later call starts new workers."""
        with self._changed:
            workers, idle = list(self._workers), self._idle
            self._idle = []
        for worker in workers:
            worker.kill()
        for worker in idle:
            self._discard(worker)

    # ------------------------------------------------------------ used by Job

    def _acquire(self, job: Job) -> _Worker | None:
        """An idle worker, else a new one while under max_workers, else wait; None once `job`
        is stopped while waiting."""
        with self._changed:
            while True:
                if job.stopped:
                    return None
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    self._live -= 1  # died while idle (killed from outside)
                if self._live < self.max_workers:
                    self._live += 1
                    break
                self._changed.wait()
        try:
            return self._start()
        except BaseException:
            self._discard(None)
            raise

    def _start(self) -> _Worker:
        calls_in, calls_out = os.pipe()
        replies_in, replies_out = os.pipe()
        # The worker imports what this process can: its sys.path (which tests and scripts may
        # have extended) goes along as PYTHONPATH.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        fds = (calls_in, replies_out, os.getpid())
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, *map(str, fds)],
                pass_fds=fds[:2], stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        except BaseException:
            for fd in (calls_in, calls_out, replies_in, replies_out):
                os.close(fd)
            raise
        os.close(calls_in)
        os.close(replies_out)
        worker = _Worker(process, os.fdopen(calls_out, "wb"), os.fdopen(replies_in, "rb"))
        with self._changed:
            self._workers.add(worker)
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._changed:
            self._idle.append(worker)
            self._changed.notify()

    def _discard(self, worker: _Worker | None) -> None:
        """Kill and forget a worker (None: one that failed to start)."""
        if worker is not None:
            worker.kill()
            worker.close()
        with self._changed:
            self._workers.discard(worker)  # type: ignore[arg-type]
            self._live -= 1
            self._changed.notify()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class Job:
    """One isolated call. `run` blocks (on a helper thread) until the worker answers; `stop`
    kills the worker mid-call, or makes a `run` still waiting for a worker give up."""

    def __init__(self, pool: WorkerPool, function: Callable[..., Any], kwargs: dict[str, Any]):
        self._pool = pool
        self._function, self._kwargs = function, kwargs
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._answered = False
        self.stopped = False

    def run(self) -> Outcome:
        """The tool's Outcome; a WorkerError outcome when the worker failed or was stopped."""
        try:
            request = pickle.dumps((self._function, self._kwargs))
        except Exception as exc:
            message = f"cannot send the call to a worker process: {_text(exc)}"
            return Outcome(exc=WorkerError(message))
        try:
            worker = self._pool._acquire(self)
        except Exception as exc:
            return Outcome(exc=WorkerError(f"cannot start a worker process: {_text(exc)}"))
        if worker is None or not self._claim(worker):
            return Outcome(exc=WorkerError("stopped before a worker process was free"))
        try:
            _send(worker.calls, request)
            reply = _receive(worker.replies)
        except (EOFError, OSError):  # killed by stop(), or died: os._exit, a crash, the OOM killer
            self._pool._discard(worker)
            return Outcome(exc=WorkerError(_death_note(worker, self.stopped)))
        with self._lock:
            self._answered = True  # from here stop() leaves the worker alone
            killed = self.stopped
        if killed:  # stop() came between the reply and the lock: it kills the worker
            self._pool._discard(worker)
        else:
            self._pool._release(worker)
        return _decode(reply)

    def stop(self) -> None:
        """From any thread: kill the worker if the call is running, or give up waiting for one."""
        with self._lock:
            self.stopped = True
            worker = None if self._answered else self._worker
        if worker is not None:
            worker.kill()
        self._pool._wake()

    def _claim(self, worker: _Worker) -> bool:
        with self._lock:
            if not self.stopped:
                self._worker = worker
                return True
        self._pool._release(worker)  # stopped while it was being handed over: unused, still good
        return False


class _Worker:
    def __init__(self, process: subprocess.Popen, calls: IO[bytes], replies: IO[bytes]) -> None:
        self.process, self.calls, self.replies = process, calls, replies
        self.pid = process.pid
        self._lock = threading.Lock()  # kill() may come from the loop and a run() thread at once

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap it (no zombie left behind); a no-op once it has exited."""
        with self._lock:
            if self.process.poll() is None:
                self.process.kill()
                try:
                    self.process.wait(REAP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass  # the kernel owes us the exit status; poll() collects it later

    def close(self) -> None:
        for pipe in (self.calls, self.replies):
            try:
                pipe.close()
            except OSError:
                pass  # a broken pipe to a dead worker: nothing left to flush


def _death_note(worker: _Worker, stopped: bool) -> str:
    if stopped:
        return "the call was stopped and its worker process killed"
    return f"the worker process died (exit code {worker.process.returncode})"


def _send(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(_FRAME.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> bytes:
    """One framed message; EOFError when the other end is gone."""
    header = pipe.read(_FRAME.size)
    if len(header) < _FRAME.size:
        raise EOFError("the pipe closed")
    (size,) = _FRAME.unpack(header)
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed mid-message")
    return data


def _decode(reply: bytes) -> Outcome:
    try:
        outcome = pickle.loads(reply)
    except Exception as exc:
        return Outcome(exc=WorkerError(f"cannot read the worker's reply: {_text(exc)}"))
    return outcome


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not break the error report
        return f"<{type(exc).__name__} without a readable message>"


# ---------------------------------------------------------------- inside the worker process


def serve(calls_fd: int, replies_fd: int, parent_pid: int) -> None:
    """A worker's loop: receive a pickled (function, kwargs), run it, send back a pickled Outcome;
    until the pool's end of the pipe closes."""
    # Ctrl-C reaches the whole process group; the parent decides what it stops, not each worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A worker busy with a long call would otherwise outlive a parent that was killed.
    become_child("noesis-tool", parent_pid)
    with os.fdopen(calls_fd, "rb") as calls, os.fdopen(replies_fd, "wb") as replies:
        while True:
            try:
                request = _receive(calls)
                _send(replies, _encode(_call(request)))
            except (EOFError, OSError):  # the pool closed its end, or its process is gone
                return


def _call(request: bytes) -> Outcome:
    try:
        function, kwargs = pickle.loads(request)
        return Outcome(content=as_content(function(**kwargs)))
    except BaseException as exc:  # SystemExit too: a tool's sys.exit() ends its call, not us
        return Outcome(exc=exc)


def _encode(outcome: Outcome) -> bytes:
    """The pickled outcome; an exception that would not unpickle in the parent (custom __init__
    arguments, a class the parent cannot import) travels as a RemoteError naming its type."""
    try:
        data = pickle.dumps(outcome)
        pickle.loads(data)
        return data
    except Exception:
        exc = outcome.exc if outcome.exc is not None else ValueError("unpicklable result")
        return pickle.dumps(Outcome(exc=RemoteError(type(exc).__name__, _text(exc))))
