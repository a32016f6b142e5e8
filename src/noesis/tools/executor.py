"""Tool executor: runs one turn's tool calls concurrently (bounded), with per-call timeouts and
retries, and maps every failure to an `error: ...` result for the model. Never raises for a tool.
Sync tools run in threads, async ones on the loop, isolated ones in worker processes
(noesis.tools.isolation), the only place a call that overruns its timeout can be stopped."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from noesis.errors import ConfigError, InvalidRequest
from noesis.tools.isolation import Job, Outcome, WorkerPool, describe, shared_pool
from noesis.tools.registry import (
    InvalidToolArguments,
    Tool,
    ToolError,
    ToolRegistry,
    as_content,
)

ERROR_PREFIX = "error: "  # the prefix noesis-tiny was trained to read in failed tool results
CANCEL_POLL_S = 0.01


class CallLike(Protocol):
    """What the executor needs of a call; noesis.session.ToolCall is one."""

    id: str
    name: str
    arguments: str | Mapping[str, Any]


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to wait before trying a failed call again.

    The wait before retry n (1-based) is min(max_s, initial_s * multiplier ** (n - 1)), less a
    random fraction of up to `jitter` of it (jitter=1.0 is "full jitter", 0 none). Only exceptions
    of the `retry_on` types, and the executor's own timeouts if `retry_timeouts`, are retried; bad
    arguments, unknown tools and ToolError never are (trying again cannot change them).
    """

    max_attempts: int = 3
    initial_s: float = 0.2
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    retry_on: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
    retry_timeouts: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_s < 0 or self.max_s < 0:
            raise ConfigError("RetryPolicy.initial_s and max_s must be >= 0")
        if self.multiplier < 1:
            raise ConfigError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry` (1 for the second attempt)."""
        delay = min(self.max_s, self.initial_s * self.multiplier ** (retry - 1))
        return delay * (1.0 - self.jitter * rng.random())

    def retries(self, exc: BaseException | None, timed_out: bool) -> bool:
        if timed_out:
            return self.retry_timeouts
        return isinstance(exc, self.retry_on) and not isinstance(exc, ToolError)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One call's outcome. `error` is None on success, else its kind: unknown_tool,
    invalid_arguments, tool_error, exception, timeout or cancelled."""

    call_id: str
    name: str
    content: str  # what goes back to the model; "error: ..." when not ok
    ok: bool
    error: str | None
    attempts: int
    seconds: float

    def message(self) -> dict[str, Any]:
        """The OpenAI `tool` message carrying this result."""
        return {
            "role": "tool",
            "tool_call_id": self.call_id,
            "name": self.name,
            "content": self.content,
        }


@dataclass(frozen=True, slots=True)
class _Call:
    id: str
    name: str
    arguments: str | Mapping[str, Any] | None


@dataclass(slots=True)
class _Progress:
    """Mutable per-call record, so a call cancelled mid-way still reports its attempts and time."""

    call: _Call
    attempts: int = 0
    started: float | None = None


@dataclass(frozen=True, slots=True)
class _Failure:
    kind: str
    message: str
    exc: BaseException | None = None


@dataclass(slots=True)
class _Attempt:
    """One attempt's handle for stopping it: kills an isolated tool's worker process. `stopped`
    tells our own cancellation apart from a CancelledError the tool raised itself."""

    job: Job | None = None
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True
        if self.job is not None:
            self.job.stop()


class ToolExecutor:
    """Runs the tool calls of one turn against a registry.

    All calls start together, at most `max_concurrency` at a time; sync tools run in a thread pool,
    async ones on the loop, isolated ones (`Tool.isolated`) in `workers`' processes (default: the
    process-wide pool). Each attempt is bounded by `timeout_s` (None: unbounded). An isolated tool
    that times out is stopped: its worker process is killed. A sync tool cannot be (Python has no
    thread kill): it is abandoned, its thread runs to completion in the background and its result
    is dropped; the pool grows so it blocks nobody. Whatever a tool raises (any BaseException but
    KeyboardInterrupt and SystemExit from an async tool, which belong to the caller's loop)
    becomes an `error: ...` result. `sleep`, `clock` and `rng` are injectable for tests.
    """

    def __init__(
        self,
        registry: ToolRegistry | None = None,
        max_concurrency: int = 4,
        timeout_s: float | None = 30.0,
        retry: RetryPolicy | None = None,
        *,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        clock: Callable[[], float] = time.perf_counter,
        rng: random.Random | None = None,
        workers: WorkerPool | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.registry = registry if registry is not None else ToolRegistry()
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.retry = retry if retry is not None else RetryPolicy()
        self.sleep, self.clock = sleep, clock
        self.rng = rng if rng is not None else random.Random()
        self.workers = workers  # None: shared_pool(), looked up only when an isolated tool runs

    def with_registry(self, registry: ToolRegistry) -> ToolExecutor:
        """The same settings over another registry."""
        other = copy.copy(self)
        other.registry = registry
        return other

    def isolates(self) -> bool:
        """Whether any tool of the registry runs isolated (so that `warm` has work)."""
        return any(t.isolated for t in self.registry)

    def warm(self, name: str) -> bool:
        """Get a worker process ready for the isolated tool `name` (noesis.tools.isolation:
        WorkerPool.warm) on a background thread, so that its first call does not wait for a
        process to start and import its module; never blocks. What the intent sidecar calls
        when it predicts the tool. False (nothing done) for a tool that is not isolated or not
        in the registry."""
        tool = self.registry.find(name)
        if tool is None or not tool.isolated:
            return False
        pool = self.workers or shared_pool()
        threading.Thread(target=pool.warm, args=([tool.function],), daemon=True,
                         name=f"noesis-warm-{name}").start()  # fmt: skip
        return True

    def run(
        self, calls: Sequence[CallLike | Mapping[str, Any]], cancel: threading.Event | None = None
    ) -> list[ToolResult]:
        """Blocking entry point. Inside a thread that runs an event loop it runs the calls on a
        helper thread with its own loop (the calling thread blocks, as any sync call would)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(calls, cancel))
        with ThreadPoolExecutor(1, thread_name_prefix="noesis-tools-loop") as helper:
            return helper.submit(asyncio.run, self.arun(calls, cancel)).result()

    async def arun(
        self, calls: Sequence[CallLike | Mapping[str, Any]], cancel: threading.Event | None = None
    ) -> list[ToolResult]:
        """Run all calls; results in call order. Setting `cancel` stops waiting: calls not done
        come back as `cancelled` errors."""
        progress = [_Progress(as_call(call)) for call in calls]
        if not progress:
            return []
        semaphore = asyncio.Semaphore(self.max_concurrency)
        # One worker per possible attempt: an abandoned (timed-out) thread never delays another.
        workers = len(progress) * self.retry.max_attempts
        pool = ThreadPoolExecutor(workers, thread_name_prefix="noesis-tool")
        try:
            tasks = [asyncio.ensure_future(self._run_call(p, semaphore, pool)) for p in progress]
            await _wait_or_cancel(tasks, cancel)
        finally:
            pool.shutdown(wait=False)
        return [
            task.result() if not task.cancelled() else self._cancelled(p)
            for task, p in zip(tasks, progress, strict=True)
        ]

    # ------------------------------------------------------------ one call

    async def _run_call(
        self, progress: _Progress, semaphore: asyncio.Semaphore, pool: ThreadPoolExecutor
    ) -> ToolResult:
        call = progress.call
        tool = self.registry.find(call.name) if isinstance(call.name, str) else None
        if tool is None:  # worded as noesis-tiny was trained to read it
            message = f"tool {call.name!r} is not declared"
            return self._failed(progress, _Failure("unknown_tool", message))
        try:
            kwargs = tool.parse_arguments(call.arguments)
        except InvalidToolArguments as exc:
            return self._failed(progress, _Failure("invalid_arguments", str(exc), exc))
        except Exception as exc:  # a parser's own failure (RecursionError, ...) is still a result
            message = f"arguments could not be read ({describe(exc)})"
            return self._failed(progress, _Failure("invalid_arguments", message, exc))
        while True:
            async with semaphore:
                outcome = await self._attempt(progress, tool, kwargs, pool)
            if not isinstance(outcome, _Failure) or not self._retry(progress, outcome):
                break
            await self.sleep(self.retry.delay_s(progress.attempts, self.rng))
        if isinstance(outcome, _Failure):
            return self._failed(progress, outcome)
        return self._result(progress, outcome, ok=True, error=None)

    def _retry(self, progress: _Progress, failure: _Failure) -> bool:
        if progress.attempts >= self.retry.max_attempts:
            return False
        return self.retry.retries(failure.exc, timed_out=failure.kind == "timeout")

    async def _attempt(
        self, progress: _Progress, tool: Tool, kwargs: dict[str, Any], pool: ThreadPoolExecutor
    ) -> str | _Failure:
        progress.attempts += 1
        if progress.started is None:
            progress.started = self.clock()
        attempt = _Attempt()
        task = asyncio.ensure_future(self._invoke(tool, kwargs, pool, attempt))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        except asyncio.CancelledError:  # the whole run was cancelled: stop the tool as well
            _abandon(task, attempt)
            raise
        if not done:
            _abandon(task, attempt)
            return _Failure("timeout", f"tool {tool.name!r} timed out after {self.timeout_s:g}s")
        outcome = task.result()
        if outcome.exc is None:
            return outcome.content
        if isinstance(outcome.exc, ToolError):
            return _Failure("tool_error", str(outcome.exc), outcome.exc)
        return _Failure("exception", describe(outcome.exc), outcome.exc)

    async def _invoke(
        self, tool: Tool, kwargs: dict[str, Any], pool: ThreadPoolExecutor, attempt: _Attempt
    ) -> Outcome:
        """Run one attempt where the tool's kind runs; what it raises comes back in the Outcome
        (a thread's exception never travels through asyncio, which refuses StopIteration)."""
        loop = asyncio.get_running_loop()
        if tool.is_async:
            return await _awaited(functools.partial(tool.function, **kwargs), attempt)
        if tool.isolated:
            attempt.job = (self.workers or shared_pool()).job(tool.function, kwargs)
            return await loop.run_in_executor(pool, attempt.job.run)
        context = contextvars.copy_context()  # the thread sees the caller's context variables
        call = functools.partial(context.run, _capture, tool.function, kwargs)
        outcome = await loop.run_in_executor(pool, call)
        if inspect.isawaitable(outcome):  # a sync callable that returned a coroutine
            return await _awaited(lambda: outcome, attempt)
        return outcome

    # ------------------------------------------------------------ results

    def _failed(self, progress: _Progress, failure: _Failure) -> ToolResult:
        content = ERROR_PREFIX + failure.message
        if failure.kind == "timeout" and progress.attempts > 1:
            content += f" ({progress.attempts} attempts)"
        return self._result(progress, content, ok=False, error=failure.kind)

    def _cancelled(self, progress: _Progress) -> ToolResult:
        content = f"{ERROR_PREFIX}cancelled before tool {progress.call.name!r} finished"
        return self._result(progress, content, ok=False, error="cancelled")

    def _result(self, progress: _Progress, content: str, ok: bool, error: str | None) -> ToolResult:
        seconds = 0.0 if progress.started is None else self.clock() - progress.started
        call = progress.call
        return ToolResult(call.id, call.name, content, ok, error, progress.attempts, seconds)


def _capture(function: Callable[..., Any], kwargs: dict[str, Any]) -> Outcome | Awaitable[Any]:
    """On a pool thread: the call's Outcome, or the awaitable a sync callable returned. Catches
    every BaseException: in a thread even SystemExit only ends the thread, never the process."""
    try:
        value = function(**kwargs)
        return value if inspect.isawaitable(value) else Outcome(content=as_content(value))
    except BaseException as exc:
        return Outcome(exc=exc)


async def _awaited(start: Callable[[], Awaitable[Any]], attempt: _Attempt) -> Outcome:
    """Await a tool's awaitable on the loop; its exceptions become the Outcome, except our own
    cancellation and the caller's KeyboardInterrupt/SystemExit, which propagate."""
    try:
        value = await start()
        return Outcome(content=as_content(value))
    except asyncio.CancelledError as exc:
        if attempt.stopped:
            raise
        return Outcome(exc=exc)  # the tool raised CancelledError itself
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return Outcome(exc=exc)


def _abandon(task: asyncio.Future, attempt: _Attempt) -> None:
    """Stop a timed-out or cancelled attempt: an isolated tool's worker is killed now, an async
    tool is cancelled, a thread is left to finish unobserved."""
    attempt.stop()
    task.cancel()
    task.add_done_callback(_discard)


async def _wait_or_cancel(tasks: list[asyncio.Future], cancel: threading.Event | None) -> None:
    everything = asyncio.gather(*tasks)
    if cancel is None:
        await everything
        return
    watcher = asyncio.ensure_future(_wait_event(cancel))
    await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not everything.done():
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_event(event: threading.Event) -> None:
    # threading.Event has no awaitable form; a short poll keeps the loop free of extra threads.
    while not event.is_set():
        await asyncio.sleep(CANCEL_POLL_S)


def _discard(task: asyncio.Future) -> None:
    """Retrieve an abandoned attempt's outcome so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def as_call(call: CallLike | Mapping[str, Any]) -> _Call:
    """A call object (id, name, arguments) or an OpenAI tool-call dict, normalized."""
    if isinstance(call, Mapping):
        function = call.get("function", call)
        if "name" not in function:
            raise InvalidRequest(f"tool call {dict(call)!r} has no function name")
        return _Call(str(call.get("id", "")), function["name"], function.get("arguments"))
    return _Call(call.id, call.name, call.arguments)
