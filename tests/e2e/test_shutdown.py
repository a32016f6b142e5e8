"""SIGTERM: stop accepting, let requests finish until the deadline, end the rest, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from conftest import MODEL_NAME
from conftest import SHUTDOWN_DEADLINE as DEADLINE

NUM_LONG = 24


def _stream(server, max_tokens: int, result: dict, started: threading.Event) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "Shut down",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, timeout=60
        ) as response:
            for line in response.iter_lines():
                started.set()
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices", [])
                    if any(c["finish_reason"] == "length" for c in choices):
                        result["finished"] = True
                if line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as exc:
        result["error"] = exc
    finally:
        started.set()


def test_sigterm_drains_then_exits_zero(spare_server):
    server = spare_server  # stopped here: the spare's next user gets a fresh one
    short, longs = {}, [{} for _ in range(NUM_LONG)]
    jobs = [(20, short)] + [(1000, r) for r in longs]
    events = [threading.Event() for _ in jobs]
    threads = [
        threading.Thread(target=_stream, args=(server, n, result, event))
        for (n, result), event in zip(jobs, events, strict=True)
    ]
    for thread in threads:
        thread.start()
    assert all(event.wait(30) for event in events)

    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # no new work: the listening socket is closed (or, if a connection slips in, 503)
        refused = httpx.get(server.url + "/health", timeout=2).status_code == 503
    except httpx.HTTPError:
        refused = True
    assert refused
    code = server.process.wait(DEADLINE + 20)
    elapsed = time.monotonic() - start
    for thread in threads:
        thread.join(10)

    assert code == 0, server.log()
    assert elapsed < DEADLINE + 10
    assert short.get("finished") and short.get("done")  # finished within the deadline
    # these could not finish: at the deadline they end with an error event and [DONE]
    assert not any(r.get("finished") for r in longs)
    assert all(r.get("done") for r in longs)
    assert "Traceback" not in server.log()
