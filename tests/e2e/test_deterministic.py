"""`"deterministic": true` through the real server: a 400 naming the field where no trace is kept;
on a `--trace --batch-invariant` server, busy with other streams, the response names each choice's
request id in the trace (a `noesis` object and a header, streamed or not) and `noesis replay TRACE
--request ID` reproduces the request alone."""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import MODEL_NAME, chat

from noesis.cli import main
from noesis.telemetry.trace import load_trace

HEADER = "x-noesis-request-ids"
TARGET_PROMPT = list(range(20, 52))
OTHERS = 4


@pytest.fixture(scope="module")
def traced(start_server, tmp_path_factory):
    """A batch-invariant server recording every step to its trace, and the trace's path."""
    trace = tmp_path_factory.mktemp("serve-trace") / "serve.trace"
    return start_server("--trace", str(trace), "--batch-invariant"), trace


def test_deterministic_is_refused_without_a_trace(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                                  extra_body={"deterministic": True})
    assert info.value.body["param"] == "deterministic"
    assert "--trace PATH" in info.value.body["message"]


async def busy_run(server):
    """Two deterministic requests (a seeded chat; a streamed completion) sent once the other
    streams are generating: (chat response, its headers, streamed headers, streamed tokens)."""
    client = server.async_client()
    others = [
        await client.completions.create(
            model=MODEL_NAME, prompt=[7 + i] * (3 + 5 * i), max_tokens=40, stream=True,
            temperature=1.0, seed=i, extra_body={"ignore_eos": True})
        for i in range(OTHERS)
    ]  # fmt: skip
    for stream in others:  # each is past its prefill: the targets join running batches
        await stream.__anext__()
    deterministic = {"deterministic": True, "ignore_eos": True}
    chat_call = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=chat("Tell me a story"), max_tokens=12, temperature=0.8,
        seed=3, extra_body=deterministic)
    stream_call = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt=TARGET_PROMPT, max_tokens=10, temperature=0, stream=True,
        extra_body=deterministic)
    chat_raw, stream_raw = await asyncio.gather(chat_call, stream_call)
    streamed = [chunk async for chunk in stream_raw.parse()]
    for stream in others:
        async for _ in stream:
            pass
    return chat_raw.parse(), chat_raw.headers, stream_raw.headers, streamed


def test_a_busy_servers_request_replays_alone(traced, capsys):
    server, trace = traced
    reply, chat_headers, stream_headers, streamed = asyncio.run(busy_run(server))
    ids = reply.model_extra["noesis"]["request_ids"]
    assert len(ids) == 1 and chat_headers[HEADER] == ids[0]
    chat_id, stream_id = ids[0], stream_headers[HEADER]
    assert streamed and chat_id != stream_id

    recorded = load_trace(trace)
    adds = {e["request_id"]: e for e in recorded.requests}
    ends = {e["request_id"]: e for e in recorded.of_kind("finish")}
    assert adds[stream_id]["prompt"] == TARGET_PROMPT and len(ends[stream_id]["token_ids"]) == 10
    assert len(ends[chat_id]["token_ids"]) == reply.usage.completion_tokens == 12
    shared = [e["rows"] for e in recorded.of_kind("step")
              if chat_id in {row[0] for row in e["rows"]} and len(e["rows"]) > 1]  # fmt: skip
    assert shared, "the request never shared a batch"

    assert main(["replay", str(trace), "--request", chat_id]) == 0, capsys.readouterr().err
    assert "all 12 tokens of 1 request over" in capsys.readouterr().out
