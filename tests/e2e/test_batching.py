"""Continuous batching and prefix caching seen from the outside: nothing lost, nothing mixed up."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import MODEL_NAME

NUM_STREAMS = 64
MAX_TOKENS = 16


def _prompt(i: int) -> str:
    return f"Stream {i}: the quick brown fox {i * 7} jumps"


def _request(i: int) -> dict:
    # Seeded sampling (not greedy) also checks that a request's randomness ignores its batch.
    return dict(
        model=MODEL_NAME,
        prompt=_prompt(i),
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        seed=1000 + i,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )


@pytest.fixture(scope="module")
def sequential(server) -> list[tuple[str, list[str]]]:
    """Each request alone on the shared server, one after another: (text, tokens). Seeded, so
    one run is the reference of both the plain and the overlapped server's concurrent runs."""
    client = server.client()
    outs = [client.completions.create(**_request(i)).choices[0] for i in range(NUM_STREAMS)]
    return [(out.text, out.logprobs.tokens) for out in outs]


def _concurrent(server) -> list[tuple[str, list[str], object]]:
    """All requests at once, streamed: (text, tokens, usage) each."""

    async def one(aclient, i: int):
        stream = await aclient.completions.create(
            **_request(i), stream=True, stream_options={"include_usage": True}
        )
        text, tokens, usage = "", [], None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                tokens += choice.logprobs.tokens if choice.logprobs else []
            usage = chunk.usage or usage
        return text, tokens, usage

    async def run():
        aclient = server.async_client()
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_STREAMS)))
        finally:
            await aclient.close()

    return asyncio.run(run())


def test_64_concurrent_streams_match_a_sequential_run(server, sequential):
    for i, (text, tokens, usage) in enumerate(_concurrent(server)):
        assert (text, tokens) == sequential[i], f"stream {i} differs"
        assert usage.completion_tokens == MAX_TOKENS == len(tokens)
    server.wait_idle()


def _cache_counters(server) -> tuple[float, float]:
    m = server.metrics()
    return m["noesis_prefix_cache_hits_total"], m["noesis_prefix_cache_queries_total"]


def test_identical_prompt_hits_the_prefix_cache_with_identical_tokens(server, client):
    prompt = "Prefix cache check. " * 12  # several full KV pages
    kwargs = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    hits0, queries0 = _cache_counters(server)
    first = client.completions.create(**kwargs)
    hits1, queries1 = _cache_counters(server)
    second = client.completions.create(**kwargs)
    hits2, queries2 = _cache_counters(server)
    prompt_len = first.usage.prompt_tokens
    assert hits1 - hits0 == 0 and queries1 - queries0 == prompt_len
    assert hits2 - hits1 == (prompt_len - 1) // 16 * 16 > 0  # every full page but the last token
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].logprobs.tokens == first.choices[0].logprobs.tokens
    server.wait_idle()


def test_twenty_turn_chat_reuses_its_history(server, client):
    """Each turn's prompt starts with the last one: all its full pages come from the cache."""
    messages = [{"role": "system", "content": "You are a twenty-turn test."}]
    ttft, hit_fraction = [], []
    for turn in range(20):
        messages.append({"role": "user", "content": f"Item {turn}?"})
        hits0, queries0 = _cache_counters(server)
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        reply, first = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            reply += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        ttft.append(first)
        hits1, queries1 = _cache_counters(server)
        hit_fraction.append((hits1 - hits0) / (queries1 - queries0))
        messages.append({"role": "assistant", "content": reply})
    assert hit_fraction[0] == 0
    assert min(hit_fraction[5:]) > 0.7, hit_fraction
    print(
        f"\nTTFT turn 1 {ttft[0] * 1e3:.1f} ms, turn 20 {ttft[-1] * 1e3:.1f} ms; "
        f"prefix-cache hit fraction at turn 20: {hit_fraction[-1]:.2f}"
    )


def test_overlapped_steps_serve_the_same_tokens(spare_server, sequential):
    """A server that plans each step while the last one runs (`--overlap-steps`, the CUDA
    default, forced on here on the CPU): 64 concurrent streams get what the synchronous server
    gives one request at a time, and a client that leaves mid-stream frees its pages."""
    overlapped = spare_server
    aborted = 'noesis_requests_total{finish_reason="abort"}'
    aborted_before = overlapped.metrics().get(aborted, 0)
    concurrent = [(text, tokens) for text, tokens, _ in _concurrent(overlapped)]
    assert concurrent == sequential
    with overlapped.client().completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as stream:
        for _, _ in zip(stream, range(4), strict=False):
            pass
    metrics = overlapped.wait_idle()
    assert metrics[aborted] == aborted_before + 1
