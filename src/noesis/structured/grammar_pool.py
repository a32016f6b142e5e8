"""Grammar compilation off the engine loop: a few worker threads, one compile per distinct spec at
a time, a wall-clock deadline per compile, and an LRU of the results keyed by content under a
byte budget. No llguidance here: the pool is handed a `build` function."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

from noesis.structured.matcher import GrammarError, GrammarSpec, GrammarTooComplex


class HasSize(Protocol):
    nbytes: int  # what holding the value costs, as estimated by whoever built it


G = TypeVar("G", bound=HasSize)
_STAT_NAMES = ("hits", "misses", "compiles", "failures", "timeouts")


def spec_key(spec: GrammarSpec) -> str:
    """The cache key of a spec: sha256 over its kind, compact flag and source text."""
    digest = hashlib.sha256()
    for part in (spec.kind, "compact" if spec.compact_json else "spaced", spec.source):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


class GrammarCache(Generic[G]):
    """Compiled grammars by key, least recently used evicted first, holding at most
    `budget_bytes` (by each grammar's `nbytes`); plus the last `max_failures` failed keys, so a
    spec that failed is refused again without another compile. Not locked: its owner locks."""

    def __init__(self, budget_bytes: int, max_failures: int = 1024) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._grammars: OrderedDict[str, G] = OrderedDict()
        self._failures: OrderedDict[str, GrammarError] = OrderedDict()
        self._max_failures = max_failures

    def __len__(self) -> int:
        return len(self._grammars)

    def get(self, key: str) -> G | None:
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
        return grammar

    def put(self, key: str, grammar: G) -> bool:
        """Keep `grammar`, evicting the least recently used ones to stay within the budget;
        False (nothing evicted, nothing kept) when it alone is over the budget."""
        if grammar.nbytes > self.budget_bytes:
            return False
        self._drop(key)
        while self._grammars and self.nbytes + grammar.nbytes > self.budget_bytes:
            self._drop(next(iter(self._grammars)))
        self._grammars[key] = grammar
        self.nbytes += grammar.nbytes
        return True

    def failure(self, key: str) -> GrammarError | None:
        error = self._failures.get(key)
        if error is None:
            return None
        self._failures.move_to_end(key)
        return error.with_traceback(None)  # raised again and again: keep its traceback short

    def put_failure(self, key: str, error: GrammarError) -> None:
        self._failures[key] = error
        self._failures.move_to_end(key)
        while len(self._failures) > self._max_failures:
            self._failures.popitem(last=False)

    def _drop(self, key: str) -> None:
        grammar = self._grammars.pop(key, None)
        if grammar is not None:
            self.nbytes -= grammar.nbytes


class CompilePool(Generic[G]):
    """Runs `build(spec)` on up to `workers` threads (started on the first compile) and answers
    with futures.

    Concurrent submits of one spec share one compile and one future. A compile still running
    `timeout_s` after it started fails its future with GrammarTooComplex; the thread cannot be
    stopped and runs on (llguidance's fuel limits bound for how long), its late result is
    dropped. Outcomes are remembered: grammars in the byte-budget LRU, failures (timeouts too)
    in the cache's failure list. Futures are never cancellable, since several requests may
    share one.
    """

    def __init__(
        self,
        build: Callable[[GrammarSpec], G],
        cache: GrammarCache[G],
        workers: int,
        timeout_s: float,
    ) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self._build = build
        self._workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[G]] = {}
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def cached(self, spec: GrammarSpec) -> G | None:
        """The compiled grammar if it is cached (refreshing its place in the LRU); never
        compiles, never waits on a compile."""
        key = spec_key(spec)
        with self._lock:
            return self.cache.get(key)

    def submit(self, spec: GrammarSpec) -> Future[G]:
        """A future of the compiled grammar: done already when the outcome is cached, else the
        future of the compile running (or queued) for this spec, started here if none is."""
        key = spec_key(spec)
        with self._lock:
            grammar = self.cache.get(key)
            if grammar is not None:
                self._counts["hits"] += 1
                return _resolved(grammar)
            self._counts["misses"] += 1
            error = self.cache.failure(key)
            if error is not None:
                return _resolved(error=error)
            future = self._inflight.get(key)
            if future is None:
                future = self._start(key, spec)
            return future

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self.cache),
                "bytes": self.cache.nbytes,
                "budget": self.cache.budget_bytes,
                **{name: self._counts[name] for name in _STAT_NAMES},
                "compiling": len(self._inflight),
            }

    def close(self) -> None:
        """Stop taking compiles; queued and running ones fail their futures now (a running
        thread still ends on its own). A later submit starts a fresh pool."""
        with self._lock:
            pending, self._inflight = self._inflight, {}
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for future in pending.values():
            future.set_exception(GrammarError("the grammar compiler was closed"))

    def _start(self, key: str, spec: GrammarSpec) -> Future[G]:
        """Queue a compile (the lock is held)."""
        future: Future[G] = Future()
        future.set_running_or_notify_cancel()  # from now on cancel() is refused
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="noesis-grammar")
        self._inflight[key] = future
        self._counts["compiles"] += 1
        self._executor.submit(self._run, key, spec, future)
        return future

    def _run(self, key: str, spec: GrammarSpec, future: Future[G]) -> None:
        """On a worker: build, then settle the future unless its deadline came first."""
        deadline = threading.Timer(self.timeout_s, self._expire, (key, future))
        deadline.daemon = True  # a pending deadline never holds the interpreter's exit
        deadline.start()
        try:
            grammar = self._build(spec)
        except GrammarError as exc:
            # Without its traceback: the build's frames (and the grammar in them) would live
            # as long as the remembered failure.
            self._settle(key, future, "failures", error=exc.with_traceback(None))
        except Exception as exc:  # a bug, not the spec's: fail this compile (unremembered)
            self._settle(key, future, "failures", error=exc)
        else:
            self._settle(key, future, None, grammar=grammar)
        finally:
            deadline.cancel()

    def _expire(self, key: str, future: Future[G]) -> None:
        error = GrammarTooComplex(
            "compile_timeout_s", f"compiling it took longer than {self.timeout_s:g} s"
        )
        self._settle(key, future, "timeouts", error=error)

    def _settle(
        self,
        key: str,
        future: Future[G],
        count: str | None,
        grammar: G | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Whichever of the compile and its deadline comes first resolves the future; the
        other finds it gone from the in-flight table and does nothing."""
        with self._lock:
            if self._inflight.get(key) is not future:
                return
            del self._inflight[key]
            if count is not None:
                self._counts[count] += 1
            if grammar is not None:
                self.cache.put(key, grammar)
            elif isinstance(error, GrammarError):
                self.cache.put_failure(key, error)
        # Resolved outside the lock: done-callbacks run here and may submit again.
        if grammar is not None:
            future.set_result(grammar)
        else:
            future.set_exception(error)


def _resolved(grammar: G | None = None, error: BaseException | None = None) -> Future[G]:
    future: Future[G] = Future()
    future.set_running_or_notify_cancel()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(grammar)
    return future
