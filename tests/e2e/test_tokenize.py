"""/tokenize and /detokenize (vLLM's shapes): the same ids the generation endpoints use."""

from __future__ import annotations

import httpx
import pytest
from conftest import CONTEXT, MODEL_NAME, chat


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_a_prompt_tokenizes_to_what_a_completion_counts(server, client):
    prompt = "Hello there, how are you?"
    out = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": prompt}).json()
    usage = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1).usage
    assert out["count"] == len(out["tokens"]) == usage.prompt_tokens
    assert out["max_model_len"] == CONTEXT
    bare = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert len(bare["tokens"]) <= out["count"]  # model is optional, as in vLLM
    back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": bare["tokens"]}).json()
    assert back["prompt"] == prompt


def test_messages_tokenize_to_what_a_chat_completion_counts(server, client):
    messages = chat("What is <|im_start|> doing in my text?")
    out = post(server, "/tokenize", {"model": MODEL_NAME, "messages": messages,
                                     "return_token_strs": True}).json()
    usage = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_tokens=1).usage
    assert out["count"] == usage.prompt_tokens
    assert len(out["token_strs"]) == out["count"]
    assert "<|im_start|>" in "".join(out["token_strs"])  # as text: encode_chat's tokens


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": MODEL_NAME}, "prompt"),  # neither prompt nor messages
    ("/tokenize", {"prompt": "x", "messages": chat("x")}, "prompt"),  # both
    ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_bodies_are_openai_errors(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param
