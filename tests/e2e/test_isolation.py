"""No request hurts another, end to end: a grammar compiling does not stall running streams, an
engine process that dies is replaced while the server stays up, the engine process never outlives
the server, and a short soak of mixed valid and malformed traffic with disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import CONTEXT, MODEL_NAME, ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak import Soak, children  # noqa: E402

STREAM = {
    "model": MODEL_NAME,
    "prompt": "Hello",
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "logprobs": 0,
}


def stream_events(url: str, body: dict, times: list[float] | None = None) -> list[dict]:
    """The events of one streamed completion (each token is an event: logprobs=0)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if times is not None:
                    times.append(time.perf_counter())
    return events


def tokens_of(events: list[dict]) -> list[str]:
    return [t for e in events if "choices" in e for t in e["choices"][0]["logprobs"]["tokens"]]


def engine_pids(server_pid: int) -> list[int]:
    """The server's engine process (by the name it gives itself: not the body parser's worker
    or multiprocessing's resource tracker)."""
    return [
        pid
        for pid in children(server_pid)
        if Path(f"/proc/{pid}/comm").read_text().strip() == "noesis-engine"
    ]


def max_gap(times: list[float]) -> float:
    return max(b - a for a, b in zip(times[1:], times[2:], strict=False))  # after the first


def wide_schema(properties: int, salt: str) -> dict:
    names = {f"{salt}_field_{i}": {"type": "integer"} for i in range(properties)}
    return {"type": "object", "properties": names, "required": list(names)}


def test_running_streams_do_not_stall_while_a_big_schema_compiles(server):
    solo = tokens_of(stream_events(server.url, STREAM))
    baseline: list[float] = []
    stream_events(server.url, STREAM, baseline)
    base_gap = max_gap(baseline)
    times: list[float] = []
    result: dict = {}
    victim = threading.Thread(
        target=lambda: result.setdefault("events", stream_events(server.url, STREAM, times))
    )
    victim.start()
    while len(times) < 3:
        time.sleep(0.01)
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Fill the form"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "form", "schema": wide_schema(3000, f"s{time.time_ns()}")},
        },
    }
    started = time.perf_counter()
    big = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    compile_s = time.perf_counter() - started
    victim.join(120)
    assert big.status_code in (200, 400), big.text
    assert tokens_of(result["events"]) == solo
    # Within 2x the solo run's worst gap (plus a little for a 2-core machine's scheduling noise),
    # while the schema took far longer than that to compile and run.
    assert max_gap(times) <= 2 * base_gap + 0.05, (max_gap(times), base_gap, compile_s)
    server.wait_idle()


@pytest.mark.parametrize(
    ("properties", "required", "code"),
    [
        (1000, False, "grammar_too_complex"),  # compiles, but cannot take its first token
        (9000, False, "schema_too_large"),  # the schema: refused before it is compiled
    ],
)
def test_a_schema_over_the_limits_is_a_400_and_running_streams_go_on(
    server, properties, required, code
):
    solo = tokens_of(stream_events(server.url, STREAM))
    baseline: list[float] = []
    stream_events(server.url, STREAM, baseline)
    result: dict = {}
    times: list[float] = []
    victim = threading.Thread(
        target=lambda: result.setdefault("events", stream_events(server.url, STREAM, times))
    )
    victim.start()
    while len(times) < 3:
        time.sleep(0.01)
    schema = wide_schema(properties, f"r{time.time_ns()}")
    if not required:
        schema["required"] = []
    body = {
        "model": MODEL_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "form", "schema": schema},
        },
    }
    refused = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    victim.join(120)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    assert tokens_of(result["events"]) == solo
    assert max_gap(times) <= 2 * max_gap(baseline) + 0.05, (max_gap(times), max_gap(baseline))
    server.wait_idle()


def test_a_dead_engine_process_is_replaced_and_the_server_stays_up(spare_server):
    server = spare_server
    restarts = server.wait_idle()["noesis_engine_restarts_total"]
    (engine_pid,) = engine_pids(server.process.pid)
    results: dict = {}
    times: list[float] = []

    def victim() -> None:
        try:
            results["events"] = stream_events(server.url, {**STREAM, "max_tokens": 1000}, times)
        except (httpx.HTTPError, AssertionError) as exc:
            results["error"] = exc

    thread = threading.Thread(target=victim)
    thread.start()
    while len(times) < 3 and thread.is_alive():
        time.sleep(0.005)
    os.kill(engine_pid, signal.SIGKILL)
    thread.join(60)
    events = results.get("events", [])
    assert events and "error" in events[-1], results  # the in-flight stream ends with an error
    deadline = time.monotonic() + 90
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "no fresh engine after 90 s"
        time.sleep(0.2)
    assert len(engine_pids(server.process.pid)) == 1
    assert engine_pids(server.process.pid) != [engine_pid]
    body = {k: v for k, v in STREAM.items() if k != "stream"}
    after = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 40
    metrics = server.metrics()
    assert metrics["noesis_engine_restarts_total"] == restarts + 1
    assert metrics["noesis_kv_pages_used"] == 0


def test_the_engine_process_never_outlives_the_server(tiny_model, tmp_path):
    server = ServerProcess(tiny_model, tmp_path)  # not start_server's: this one dies unclean
    assert len(engine_pids(server.process.pid)) == 1
    deadline = time.monotonic() + 30
    while len(children(server.process.pid)) < 3:  # the body parser's worker starts in the back
        assert time.monotonic() < deadline, children(server.process.pid)
        time.sleep(0.1)
    pids = children(server.process.pid)  # engine, body parser, multiprocessing's tracker
    server.process.kill()  # no chance to clean up: the children must notice by themselves
    server.stop()
    deadline = time.monotonic() + 10
    while left := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, f"{left} outlived the server"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("duration", [float(os.environ.get("NOESIS_SOAK_S", "12"))])
def test_a_short_soak_keeps_every_response_intact(server, duration):
    soak = Soak(server.url, MODEL_NAME, CONTEXT, [server.process.pid], seed=1)
    report = asyncio.run(soak.run(duration, concurrency=32))
    assert report.ok, report.problems
    assert report.valid + report.streamed > 0 and report.malformed > 0 and report.disconnects > 0
    assert server.process.poll() is None
