"""API key (401), admission control (429 + Retry-After), and `noesis serve` argument handling.
(tests/e2e/test_edge_validation.py checks the key on every route, /metrics behind it.)"""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest
from conftest import MODEL_NAME, chat
from conftest import STRICT_KEY as KEY

from noesis import cli

# strict_server (conftest): one running sequence, one waiting, the API key from the
# environment, /metrics left open.


def test_api_key_required_on_v1(strict_server):
    for key in ("wrong", "sk-test-12"):
        with pytest.raises(openai.AuthenticationError) as info:
            strict_server.client(api_key=key).models.list()
        assert info.value.status_code == 401
        assert info.value.body["type"] == "authentication_error"
    missing = httpx.post(strict_server.url + "/v1/chat/completions", json={})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    out = strict_server.client(api_key=KEY).chat.completions.create(
        model=MODEL_NAME, messages=chat("Hi"), max_tokens=2
    )
    assert out.choices[0].message.content is not None
    # health stays open for probes; metrics only with --metrics-public (else behind the key)
    assert httpx.get(strict_server.url + "/health").status_code == 200
    assert httpx.get(strict_server.url + "/metrics").status_code == 200
    # the docs are off unless --enable-docs: a key holder gets 404, anyone else 401 first
    headers = {"Authorization": f"Bearer {KEY}"}
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(strict_server.url + path).status_code == 401
        assert httpx.get(strict_server.url + path, headers=headers).status_code == 404


def test_queue_full_is_429_with_retry_after(strict_server):
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 800,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    url = strict_server.url + "/v1/completions"
    with contextlib.ExitStack() as stack:
        for _ in range(2):  # one runs, one waits: the server is full
            response = stack.enter_context(
                httpx.stream("POST", url, json=body, headers=headers, timeout=30)
            )
            assert response.status_code == 200
        rejected = httpx.post(url, json={**body, "stream": False}, headers=headers, timeout=30)
        assert rejected.status_code == 429
        assert int(rejected.headers["Retry-After"]) >= 1
        error = rejected.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        client = strict_server.client(api_key=KEY)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi"), max_tokens=2)
    # both streams closed: their requests are aborted and capacity comes back
    strict_server.wait_idle()
    out = strict_server.client(api_key=KEY).completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=2
    )
    assert out.usage.completion_tokens >= 1


def test_api_key_flag_and_env_reach_the_config(monkeypatch):
    monkeypatch.setenv("NOESIS_API_KEY", "from-env")
    args = cli._parser().parse_args(["serve", "--model", "m"])
    assert args.api_key == "from-env"
    args = cli._parser().parse_args(["serve", "--model", "m", "--api-key", "flag"])
    assert args.api_key == "flag"


def test_serve_without_model_needs_the_bundled_one(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("NOESIS_MODEL", raising=False)
    monkeypatch.setattr(cli, "BUNDLED_MODEL", tmp_path / "absent")
    assert cli.main(["serve", "--port", "0"]) == 1
    assert "--model" in capsys.readouterr().err
