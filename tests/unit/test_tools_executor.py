"""ToolExecutor: concurrency and its bound, timeouts, retries with backoff, call order, and every
failure mapped to an `error: ...` result."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from noesis.errors import ConfigError
from noesis.tools import RetryPolicy, ToolError, ToolExecutor, ToolRegistry

NO_RETRY = RetryPolicy(max_attempts=1)


def call(name: str, arguments: str = "{}", call_id: str | None = None) -> dict:
    return {
        "id": call_id or f"id_{name}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class InFlight:
    """Counts tools running at once, from threads and from the event loop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def sleepers(gauge: InFlight) -> ToolRegistry:
    def nap(seconds: float) -> str:
        """Sleeps in a thread."""
        gauge.enter()
        time.sleep(seconds)
        gauge.leave()
        return f"slept {seconds}"

    async def anap(seconds: float) -> str:
        """Sleeps on the loop."""
        gauge.enter()
        await asyncio.sleep(seconds)
        gauge.leave()
        return f"slept {seconds}"

    return ToolRegistry([nap, anap])


@pytest.mark.parametrize("name", ["nap", "anap"])
def test_calls_of_one_turn_run_concurrently(name):
    gauge = InFlight()
    executor = ToolExecutor(sleepers(gauge), max_concurrency=4, retry=NO_RETRY)
    calls = [call(name, '{"seconds": 0.3}', f"c{i}") for i in range(4)]
    start = time.perf_counter()
    results = executor.run(calls)
    wall = time.perf_counter() - start
    assert all(r.ok for r in results), results
    assert gauge.peak == 4
    assert wall < 0.8, f"4 x 0.3 s took {wall:.2f} s: not concurrent (serial would be 1.2 s)"
    assert all(0.25 < r.seconds < 0.8 for r in results)


@pytest.mark.parametrize("name", ["nap", "anap"])
def test_concurrency_is_bounded(name):
    gauge = InFlight()
    executor = ToolExecutor(sleepers(gauge), max_concurrency=3, retry=NO_RETRY)
    start = time.perf_counter()
    results = executor.run([call(name, '{"seconds": 0.1}', f"c{i}") for i in range(9)])
    wall = time.perf_counter() - start
    assert all(r.ok for r in results)
    assert gauge.peak == 3
    assert wall >= 0.29, "9 calls of 0.1 s three at a time need three waves"


def test_results_come_back_in_call_order():
    gauge = InFlight()
    executor = ToolExecutor(sleepers(gauge), retry=NO_RETRY)
    durations = [0.3, 0.2, 0.1, 0.0]
    calls = [call("nap", f'{{"seconds": {d}}}', f"c{i}") for i, d in enumerate(durations)]
    results = executor.run(calls)
    assert [r.call_id for r in results] == ["c0", "c1", "c2", "c3"]
    assert [r.content for r in results] == [f"slept {d}" for d in durations]


@pytest.mark.parametrize("name", ["nap", "anap"])
def test_timeout_becomes_an_error_result_and_spares_the_others(name):
    executor = ToolExecutor(sleepers(InFlight()), timeout_s=0.2, retry=NO_RETRY)
    start = time.perf_counter()
    slow, quick = executor.run(
        [call(name, '{"seconds": 3}', "slow"), call(name, '{"seconds": 0.01}', "quick")]
    )
    assert time.perf_counter() - start < 1.5
    assert (slow.ok, slow.error, slow.attempts) == (False, "timeout", 1)
    assert slow.content == f"error: tool {name!r} timed out after 0.2s"
    assert quick.ok and quick.content == "slept 0.01"


def test_an_abandoned_thread_does_not_starve_later_calls():
    # One slot; the first call hangs past its timeout. The next ones still get a thread at once.
    executor = ToolExecutor(sleepers(InFlight()), max_concurrency=1, timeout_s=0.3, retry=NO_RETRY)
    results = executor.run(
        [call("nap", '{"seconds": 2}', "hang")]
        + [call("nap", '{"seconds": 0.05}', f"c{i}") for i in range(3)]
    )
    assert results[0].error == "timeout"
    assert [r.ok for r in results[1:]] == [True, True, True]


class Flaky:
    """Fails with `error` for the first `failures` calls, then answers."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return f"ok after {self.calls}"


def recording_sleep(delays: list[float]):
    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    return sleep


def test_retry_with_exponential_backoff_without_jitter():
    flaky = Flaky(3, ConnectionError("reset"))
    delays: list[float] = []
    policy = RetryPolicy(max_attempts=4, initial_s=0.5, multiplier=3.0, max_s=2.0, jitter=0.0)
    executor = ToolExecutor(_registry_of(flaky), retry=policy, sleep=recording_sleep(delays))
    (result,) = executor.run([call("flaky")])
    assert result.ok and result.content == "ok after 4" and result.attempts == 4
    assert delays == [0.5, 1.5, 2.0]  # 0.5, 0.5*3, 0.5*9 capped at max_s


def test_jitter_stays_in_bounds_and_follows_the_rng():
    policy = RetryPolicy(max_attempts=6, initial_s=1.0, multiplier=2.0, max_s=8.0, jitter=0.5)
    runs = []
    for _ in range(2):
        delays: list[float] = []
        executor = ToolExecutor(
            _registry_of(Flaky(5, TimeoutError("slow upstream"))),
            retry=policy,
            sleep=recording_sleep(delays),
            rng=random.Random(7),
        )
        (result,) = executor.run([call("flaky")])
        assert result.ok and result.attempts == 6
        runs.append(delays)
    assert runs[0] == runs[1]  # the injected rng decides the jitter
    for delay, base in zip(runs[0], [1.0, 2.0, 4.0, 8.0, 8.0], strict=True):
        assert base * 0.5 <= delay <= base
    assert len(set(runs[0])) == 5


def test_gives_up_after_max_attempts():
    flaky = Flaky(10, ConnectionError("refused"))
    delays: list[float] = []
    executor = ToolExecutor(
        _registry_of(flaky),
        retry=RetryPolicy(max_attempts=3, jitter=0),
        sleep=recording_sleep(delays),
    )
    (result,) = executor.run([call("flaky")])
    assert (result.ok, result.error, result.attempts, flaky.calls) == (False, "exception", 3, 3)
    assert result.content == "error: ConnectionError: refused"
    assert len(delays) == 2


@pytest.mark.parametrize("error", [ValueError("bad"), ToolError("no such city"), KeyError("k")])
def test_errors_outside_retry_on_are_not_retried(error):
    flaky = Flaky(1, error)
    executor = ToolExecutor(_registry_of(flaky), retry=RetryPolicy(max_attempts=5))
    (result,) = executor.run([call("flaky")])
    assert (result.ok, result.attempts, flaky.calls) == (False, 1, 1)


def test_retry_on_is_configurable():
    flaky = Flaky(1, ValueError("transient"))
    delays: list[float] = []
    policy = RetryPolicy(max_attempts=2, retry_on=(ValueError,))
    executor = ToolExecutor(_registry_of(flaky), retry=policy, sleep=recording_sleep(delays))
    (result,) = executor.run([call("flaky")])
    assert result.ok and result.attempts == 2 and len(delays) == 1


@pytest.mark.parametrize("retry_timeouts", [False, True])
def test_timeouts_are_retried_only_when_configured(retry_timeouts):
    attempts = []

    async def slow_once() -> str:
        """Hangs the first time."""
        attempts.append(1)
        if len(attempts) == 1:
            await asyncio.sleep(5)
        return "second try"

    policy = RetryPolicy(max_attempts=3, initial_s=0.0, retry_timeouts=retry_timeouts)
    executor = ToolExecutor(ToolRegistry([slow_once]), timeout_s=0.1, retry=policy)
    (result,) = executor.run([call("slow_once")])
    if retry_timeouts:
        assert result.ok and result.content == "second try" and result.attempts == 2
    else:
        assert result.error == "timeout" and result.attempts == 1


def test_every_failure_is_a_result_not_an_exception():
    def boom(x: int) -> str:
        """Raises."""
        raise RuntimeError(f"kaput {x}")

    def refuse() -> str:
        """Refuses."""
        raise ToolError("cannot do that")

    def structured(n: int) -> dict:
        """Returns data."""
        return {"n": n, "squares": [i * i for i in range(n)]}

    executor = ToolExecutor(ToolRegistry([boom, refuse, structured]), retry=NO_RETRY)
    results = executor.run(
        [
            call("boom", '{"x": 1}'),
            call("refuse"),
            call("missing"),
            call("boom", '{"x": "one"}', "bad_type"),
            call("boom", "{oops", "bad_json"),
            call("structured", '{"n": 3}'),
        ]
    )
    assert [(r.ok, r.error) for r in results] == [
        (False, "exception"),
        (False, "tool_error"),
        (False, "unknown_tool"),
        (False, "invalid_arguments"),
        (False, "invalid_arguments"),
        (True, None),
    ]
    assert results[0].content == "error: RuntimeError: kaput 1"
    assert results[1].content == "error: cannot do that"
    assert results[2].content == "error: tool 'missing' is not declared"
    assert results[3].content.startswith("error: invalid arguments: x: Input should be")
    assert results[4].content.startswith("error: invalid arguments: Invalid JSON")
    assert results[5].content == '{"n":3,"squares":[0,1,4]}'
    assert [r.attempts for r in results] == [1, 1, 0, 0, 0, 1]
    assert results[2].message() == {
        "role": "tool",
        "tool_call_id": "id_missing",
        "name": "missing",
        "content": results[2].content,
    }


def test_calls_may_be_objects_or_openai_dicts():
    class Call:
        id, name, arguments = "obj", "nap", '{"seconds": 0}'

    executor = ToolExecutor(sleepers(InFlight()), retry=NO_RETRY)
    flat = {"id": "flat", "name": "nap", "arguments": {"seconds": 0}}
    results = executor.run([Call(), flat, call("nap", '{"seconds": 0}', "nested")])
    assert [(r.call_id, r.ok) for r in results] == [("obj", True), ("flat", True), ("nested", True)]
    assert executor.run([]) == []


def test_run_works_inside_a_running_event_loop_and_arun_awaits():
    executor = ToolExecutor(sleepers(InFlight()), retry=NO_RETRY)
    calls = [call("anap", '{"seconds": 0.05}', "a"), call("nap", '{"seconds": 0.05}', "b")]

    async def main():
        blocking = executor.run(calls)  # from a coroutine: must not raise "loop is running"
        awaited = await executor.arun(calls)
        return blocking, awaited

    blocking, awaited = asyncio.run(main())
    assert [r.content for r in blocking] == [r.content for r in awaited] == ["slept 0.05"] * 2


def test_cancel_stops_waiting_for_running_tools():
    cancel = threading.Event()
    executor = ToolExecutor(sleepers(InFlight()), timeout_s=None, retry=NO_RETRY)
    threading.Timer(0.2, cancel.set).start()
    start = time.perf_counter()
    quick, slow = executor.run(
        [call("nap", '{"seconds": 0}', "quick"), call("anap", '{"seconds": 10}', "slow")], cancel
    )
    assert time.perf_counter() - start < 2
    assert quick.ok
    assert (slow.ok, slow.error, slow.attempts) == (False, "cancelled", 1)
    assert slow.content == "error: cancelled before tool 'anap' finished"


def test_seconds_come_from_the_injected_clock():
    ticks = iter([10.0, 12.5])
    executor = ToolExecutor(sleepers(InFlight()), retry=NO_RETRY, clock=lambda: next(ticks))
    (result,) = executor.run([call("nap", '{"seconds": 0}')])
    assert result.seconds == 2.5


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"jitter": 1.5}, "jitter"),
        ({"initial_s": -1}, "initial_s"),
    ],
)
def test_retry_policy_rejects_bad_settings(options, words):
    with pytest.raises(ConfigError, match=words):
        RetryPolicy(**options)


def test_executor_rejects_bad_settings():
    with pytest.raises(ConfigError, match="max_concurrency"):
        ToolExecutor(max_concurrency=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ToolExecutor(timeout_s=0)


def _registry_of(flaky: Flaky) -> ToolRegistry:
    registry = ToolRegistry()
    registry.register(flaky, name="flaky", description="Fails a few times, then answers.")
    return registry
