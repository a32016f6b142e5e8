"""OpenAI API gaps of issue 22 through the official client on the shared server: logit_bias,
cached prompt tokens in usage, best_of, unknown schema formats, and fields that are refused rather
than ignored."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import MODEL_NAME, chat

GREEDY = {"model": MODEL_NAME, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_logit_bias_forces_a_token_in_chat_and_completions(server, client):
    text = httpx.post(server.url + "/detokenize", json={"tokens": [42]}).json()["prompt"]
    forced = client.completions.create(prompt="Hello", max_tokens=4, logit_bias={"42": 100},
                                       logprobs=0, **GREEDY)  # fmt: skip
    assert forced.choices[0].logprobs.tokens == [text] * 4
    reply = client.chat.completions.create(messages=chat("Hi"), max_tokens=3, logprobs=True,
                                           logit_bias={"42": 100}, **GREEDY)
    assert [entry.token for entry in reply.choices[0].logprobs.content] == [text] * 3


@pytest.mark.parametrize("bias", [{"42": 101}, {"x": 1}, {"99999999": 1}])
def test_bad_logit_bias_is_a_400_naming_it(client, bias):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt="Hi", max_tokens=1, logit_bias=bias, **GREEDY)
    assert info.value.body["param"].startswith("logit_bias")


def test_usage_reports_prompt_tokens_from_the_prefix_cache(client):
    prompt = "The prefix cache keeps full pages of this prompt for the next request. " * 3
    first = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    again = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached < again.usage.prompt_tokens
    streamed = []
    for _ in range(2):
        stream = client.chat.completions.create(
            messages=chat(prompt), max_tokens=2, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
        streamed += [chunk.usage for chunk in stream if chunk.usage is not None]
    assert streamed[-1].prompt_tokens_details.cached_tokens > 0


def test_best_of_returns_the_most_likely_of_its_generations(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once", max_tokens=6, temperature=1.0, seed=11)
    # n=3 with a seed runs the same three generations (seeds 11, 12, 13) as best_of=3
    three = client.completions.create(n=3, logprobs=0, **kwargs)
    totals = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(best_of=3, **kwargs)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == three.choices[totals.index(max(totals))].text
    assert best.usage.completion_tokens == three.usage.completion_tokens  # all three billed
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(best_of=2, stream=True, **kwargs)
    assert info.value.body["param"] == "best_of"


def test_an_unknown_schema_format_is_an_annotation(client):
    schema = {"type": "object", "properties": {"site": {"type": "string", "format": "iri"}},
              "required": ["site"], "additionalProperties": False}
    reply = client.chat.completions.create(
        messages=chat("Hi"), max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        model=MODEL_NAME, temperature=0,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            messages=chat("Hi"), max_tokens=4, model=MODEL_NAME, response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"format": "iri", "not": {"type": "null"}}},
            },
        )
    assert "not" in info.value.body["message"]


@pytest.mark.parametrize(("options", "param"), [
    ({"service_tier": "flex"}, "service_tier"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # the tiny template does not read it
    ({"extra_body": {"thinking_budget": 8}}, "thinking_budget"),  # no reasoning format
])  # fmt: skip
def test_fields_that_would_change_nothing_are_400s_naming_them(client, options, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), max_tokens=2,
                                       **options)
    assert info.value.body["param"] == param


def test_documented_no_ops_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=chat("Hi"), max_tokens=2, user="u", metadata={"k": "v"},
        store=False, service_tier="auto", safety_identifier="s", prompt_cache_key="p",
    )
    assert reply.choices[0].message.content is not None
