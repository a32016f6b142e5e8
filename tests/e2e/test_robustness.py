"""Bad input gets a clear OpenAI-shaped error with the right status, and hurts no other request."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from conftest import CONTEXT, MODEL_NAME, chat

GOOD = {"model": MODEL_NAME, "messages": chat("Hi"), "max_tokens": 4}


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"model": "tiny-chat", "messages": [', None),  # malformed JSON
        (b"\xff\xfe\x00garbage", None),  # not UTF-8
        (b"[1, 2, 3]", None),  # JSON, but not an object
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "max_tokens": "4"}, "max_tokens"),
        ({**GOOD, "n": True}, "n"),
        ({**GOOD, "messages": "Hi"}, "messages"),
        ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({**GOOD, "temperature": 2.5}, "temperature"),
        ({**GOOD, "top_p": 0}, "top_p"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "presence_penalty": -3}, "presence_penalty"),
        ({**GOOD, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({**GOOD, "messages": []}, "messages"),
        ({"messages": chat("Hi")}, "model"),
        ({**GOOD, "stop": [""]}, "stop"),
        (
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_chat_bodies_are_400(server, body, param):
    error = error_of(post(server, "/v1/chat/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL_NAME, "prompt": 5}, "prompt"),
        ({"model": MODEL_NAME, "prompt": []}, "prompt"),
        ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": MODEL_NAME, "prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": MODEL_NAME, "prompt": [[0, 10**9]]}, None),  # token id out of vocab
    ],
)
def test_bad_completion_bodies_are_400(server, body, param):
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


def test_unknown_fields_are_ignored_on_both_endpoints(server):
    extra = {"made_up_field": {"a": 1}, "store": False, "metadata": {"k": "v"}}
    assert post(server, "/v1/chat/completions", {**GOOD, **extra}).status_code == 200
    completion = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **extra}
    assert post(server, "/v1/completions", completion).status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=chat("Hi"), max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert MODEL_NAME in info.value.body["message"]


def test_unsupported_features_are_clear_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Hi"), max_tokens=2,
            prediction={"type": "content", "content": "x"},
        )
    assert info.value.body["param"] == "prediction"
    assert "not supported" in info.value.body["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"tool_choice": "required"},
    ],
)
def test_tools_on_a_model_without_tool_syntax_are_clear_400s(client, extra):
    """The e2e checkpoint's template shows no tool-call syntax: calls cannot be enforced, and the
    error says how to name one."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Hi"), max_tokens=2, extra_body=extra
        )
    assert "--tool-dialect" in info.value.body["message"]


def test_response_format_text_is_accepted(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=chat("Hi"), max_tokens=2, response_format={"type": "text"}
    )
    assert out.choices[0].message.content is not None


def test_prompt_longer_than_context_names_the_numbers(client):
    prompt = list(range(10, 10 + CONTEXT + 5))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded"
    assert str(CONTEXT + 5) in info.value.body["message"]
    assert str(CONTEXT) in info.value.body["message"]


def test_prompt_plus_max_tokens_over_context_names_the_numbers(client):
    prompt = list(range(10, 10 + CONTEXT - 10))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=50)
    message = info.value.body["message"]
    assert info.value.body["code"] == "context_length_exceeded"
    assert all(str(v) in message for v in (CONTEXT, CONTEXT - 10, 50))


def test_huge_n_and_max_tokens_are_capped_by_config(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), n=10_000)
    assert info.value.body["param"] == "n" and "--max-n" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), max_tokens=10**12)
    assert info.value.body["param"] == "max_tokens"
    assert "--max-tokens-limit" in info.value.body["message"]


def test_body_too_large_is_413(server):
    body = json.dumps({**GOOD, "messages": chat("x" * (17 << 20))}).encode()
    error_of(post(server, "/v1/chat/completions", body), 413)


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = server.metrics()
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert received and received[0].startswith("data: ")
        during = server.metrics()
        assert during["noesis_running_sequences"] >= 1 and during["noesis_kv_pages_used"] > 0
    # the connection is closed here, long before 900 tokens
    after = server.wait_idle()
    aborted = 'noesis_requests_total{finish_reason="abort"}'
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    generated = after["noesis_generation_tokens_total"] - before["noesis_generation_tokens_total"]
    assert generated < 900


def test_client_timeout_on_non_streaming_request_aborts_it(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    server.wait_idle()


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    reference = client.completions.create(
        model=MODEL_NAME,
        prompt="Steady",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    result: dict = {}

    def stream() -> None:
        chunks = client.completions.create(
            model=MODEL_NAME,
            prompt="Steady",
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["text"] = "".join(c.choices[0].text for c in chunks)

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 20
    bad = [
        b"{",
        {**GOOD, "temperature": -1},
        {**GOOD, "model": "nope"},
        {"model": MODEL_NAME, "prompt": list(range(2 * CONTEXT))},
    ]
    while thread.is_alive() and time.monotonic() < deadline:
        for body in bad:
            path = "/v1/completions" if "prompt" in str(body) else "/v1/chat/completions"
            assert post(server, path, body).status_code in (400, 404)
    thread.join(20)
    assert result["text"] == reference.choices[0].text
    assert httpx.get(server.url + "/health").status_code == 200


def test_method_and_route_errors_keep_the_shape(server):
    error_of(httpx.get(server.url + "/v1/chat/completions"), 405)
    error_of(httpx.get(server.url + "/v1/nothing-here"), 404)
