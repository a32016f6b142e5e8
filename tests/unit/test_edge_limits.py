"""The edge: SamplingParams refuses what the engine cannot carry, bodies are parsed with a depth
limit and no lone surrogates, requests are held to RequestLimits, `noesis serve` checks its flags,
and the API key gate covers every route but /health."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.testclient import TestClient

from noesis import cli
from noesis.errors import ConfigError, InvalidSamplingParams
from noesis.sampling.params import SamplingParams
from noesis.server.app import APIKeyGate, CanonicalPaths, longest_token_chars
from noesis.server.config import RequestLimits, ServeConfig
from noesis.server.errors import APIError
from noesis.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from noesis.tokenizer import Tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def refused(body, model=ChatCompletionRequest, limits: RequestLimits | None = None) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_body(raw, model, limits)
    assert info.value.status == 400, info.value.message
    return info.value


def nested(depth: int) -> str:
    """A JSON schema whose JSON nests `depth` levels (arrays of arrays)."""
    return '{"type":"array","items":' * (depth - 1) + "{}" + "}" * (depth - 1)


# ---- SamplingParams (the Python API's edge too) -------------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("top_k", 2**63, "<= 2147483647"),
        ("top_k", 2**31, "vocabulary"),
        ("seed", 2**63, "<= 9223372036854775807"),
        ("seed", -1, ">= 0"),
        ("max_tokens", 2**63, "<= 9223372036854775807"),
        ("stop_token_ids", (1, 2**64), "<= 9223372036854775807"),
        ("logprobs", 10**30, "<= 20"),
        ("temperature", float("inf"), "finite"),
        ("temperature", float("nan"), "finite"),
        ("top_p", float("nan"), "finite"),
        ("min_p", float("-inf"), "finite"),
        ("repetition_penalty", float("inf"), "finite"),
        ("presence_penalty", float("nan"), "finite"),
        ("frequency_penalty", float("-inf"), "finite"),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_carry(field, value, words):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert words in str(info.value) and field in str(info.value)


def test_sampling_params_keep_the_largest_values_that_fit():
    params = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, max_tokens=2**63 - 1,
                            stop_token_ids=[2**63 - 1])
    assert params.top_k == 2**31 - 1 and params.seed == 2**63 - 1


def test_a_huge_integer_is_not_echoed_whole():
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(temperature=10**4000)
    assert len(str(info.value)) < 200 and "4001 characters" in str(info.value)


# ---- JSON depth, before parsing -----------------------------------------------------------------


def test_a_body_nested_1e5_deep_is_invalid_json_naming_the_limit():
    error = refused(b"[" * 100_000 + b"]" * 100_000)
    assert error.code == "invalid_json" and error.param is None
    assert "64" in error.message and "--max-json-depth" in error.message


def test_depth_limit_is_exact_and_names_the_top_level_field():
    def body(depth: int) -> dict:  # response_format sits 2 levels down, the schema below it
        schema = json.loads(nested(depth - 3))
        return {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "schema": schema}}}

    limits = RequestLimits(max_json_depth=20, max_schema_depth=40)
    parse_body(json.dumps(body(20)).encode(), ChatCompletionRequest, limits)
    error = refused(body(21), limits=limits)
    assert error.code == "invalid_json" and error.param == "response_format"


def test_brackets_and_escaped_quotes_inside_strings_do_not_count():
    content = '\\"' + "[{" * 5000 + '"[' * 300
    request = parse_body(json.dumps({**CHAT, "messages": [
        {"role": "user", "content": content}]}).encode(), ChatCompletionRequest)
    assert request.messages[0].content == content


def test_depth_is_counted_across_scan_chunks():
    """Over 1 MiB of string (with brackets and quotes) before the deep part: the chunked scan
    must carry the depth and the in-string state from one chunk to the next."""
    filler = 'x"[' * 400_000  # escaped quotes in JSON, split across the 1 MiB chunk edge
    body = {"model": "m", "prompt": "Hi", "user": filler, "logit_bias": json.loads(
        '{"a":' * 70 + "1" + "}" * 70)}
    error = refused(body, CompletionRequest)
    assert error.param == "logit_bias" and error.code == "invalid_json"
    shallow = {**body, "logit_bias": json.loads('{"a":' * 50 + "1" + "}" * 50)}
    parse_body(json.dumps(shallow).encode(), CompletionRequest)
    # 40 levels before the chunk edge, 30 after it: 71 in all, counted across the edge
    split = '{"a":' * 40 + json.dumps(filler) + ', "b":' + '{"a":' * 30 + "1" + "}" * 71
    error = refused(b'{"model": "m", "prompt": "Hi", "logit_bias": ' + split.encode() + b"}",
                    CompletionRequest)
    assert error.param == "logit_bias"


def test_deep_bodies_are_refused_fast():
    body = b'{"model": "m", "prompt": [' + b",".join([b"[1]"] * 1_000_000) + b"]" + (
        b', "stop": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    )
    start = time.perf_counter()
    error = refused(body, CompletionRequest)
    assert error.param == "stop"
    assert time.perf_counter() - start < 2.0  # json.loads alone takes longer on such a body


# ---- what JSON itself lets through --------------------------------------------------------------


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_literals_are_invalid_json(literal):
    error = refused(b'{"model": "m", "messages": [], "temperature": ' + literal + b"}")
    assert error.code == "invalid_json" and literal.decode().lstrip("-") in error.message


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p"])
def test_a_float_that_overflows_to_inf_names_its_field(field):
    error = refused(json.dumps(CHAT)[:-1].encode() + f', "{field}": 1e999}}'.encode())
    assert error.param == field and "finite" in error.message


def test_an_integer_past_the_digit_limit_is_a_400():
    error = refused(json.dumps(CHAT)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}")
    assert error.code == "invalid_json" and "digits" in error.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**63),
        ("top_k", -2),
        ("n", 2**63),
        ("seed", 2**63),
        ("max_tokens", 2**63),
        ("max_completion_tokens", 2**64),
        ("top_logprobs", 2**70),
    ],
)
def test_every_integer_field_is_range_checked(field, value):
    error = refused({**CHAT, field: value, "logprobs": True})
    assert error.param == field


# ---- lone surrogates ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
         b'"text": "\\udfff"}]}]}', "messages[0].content[0].text"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["ok", '
         b'"\\uDC00"]}', "stop[1]"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
         b'"function", "function": {"name": "f", "description": "\\ud83d"}}]}',
         "tools[0].function.description"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": '
         b'{"\\ud800": 1}}', "metadata"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(raw, param):
    error = refused(raw)
    assert error.param == param and "surrogate" in error.message


def test_a_lone_surrogate_in_a_completion_prompt():
    error = refused(b'{"model": "m", "prompt": ["fine", "\\ud800"]}', CompletionRequest)
    assert error.param == "prompt[1]"


def test_surrogate_pairs_and_escaped_backslashes_are_fine():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}'
    request = parse_body(raw, ChatCompletionRequest)
    assert request.messages[0].content == "\U0001f600 \\ud800"


# ---- RequestLimits ------------------------------------------------------------------------------


def test_message_stop_and_tool_counts():
    limits = RequestLimits(max_messages=2, max_stop=2, max_stop_chars=3, max_tools=1)
    three = [{"role": "user", "content": "x"}] * 3
    assert refused({**CHAT, "messages": three}, limits=limits).param == "messages"
    assert refused({**CHAT, "stop": ["a", "b", "c"]}, limits=limits).param == "stop"
    assert refused({**CHAT, "stop": ["a", "long"]}, limits=limits).param == "stop[1]"
    assert refused({**CHAT, "stop": "long"}, limits=limits).param == "stop"
    tool = {"type": "function", "function": {"name": "f"}}
    error = refused({**CHAT, "tools": [tool, tool]}, limits=limits)
    assert error.param == "tools" and "--max-tools" in error.message
    parse_body(json.dumps({**CHAT, "tools": [tool], "stop": ["a", "abc"],
                           "messages": three[:2]}).encode(), ChatCompletionRequest, limits)


@pytest.mark.parametrize("as_text", [False, True])
def test_schema_size_and_depth(as_text):
    limits = RequestLimits(max_schema_bytes=2000, max_schema_depth=10)

    def tool(schema):
        return {"type": "function", "function": {"name": "f", "parameters": schema}}

    def fmt(schema):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

    def send(schema):
        return schema if as_text else json.loads(schema)

    deep, fits = nested(11), nested(10)
    big = json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(300)}})
    for field, wrap in (("tools[0].function.parameters", lambda s: {"tools": [tool(s)]}),
                        ("response_format.json_schema.schema",
                         lambda s: {"response_format": fmt(s)})):
        error = refused({**CHAT, **wrap(send(deep))}, limits=limits)
        assert (error.param, error.code) == (field, "schema_too_deep")
        error = refused({**CHAT, **wrap(send(big))}, limits=limits)
        assert (error.param, error.code) == (field, "schema_too_large")
        assert "--max-schema-bytes" in error.message
        parse_body(json.dumps({**CHAT, **wrap(send(fits))}).encode(), ChatCompletionRequest,
                   limits)


def test_a_schema_with_an_infinite_number_is_refused():
    raw = json.dumps({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "number", "maximum": 1}}}}).encode().replace(b'"maximum": 1',
                                                                          b'"maximum": 1e999')
    assert refused(raw).param == "response_format.json_schema.schema"


def test_prompt_characters_are_counted_before_tokenizing():
    limits = RequestLimits(max_prompt_chars=10)
    messages = [{"role": "system", "content": "12345"},
                {"role": "user", "content": [{"type": "text", "text": "678901"}]}]
    error = refused({**CHAT, "messages": messages}, limits=limits)
    assert (error.param, error.code) == ("messages", "context_length_exceeded")
    assert "--max-prompt-chars" in error.message
    calls = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "x" * 20}}]}]
    assert refused({**CHAT, "messages": calls}, limits=limits).param == "messages"
    prompts = {"model": "m", "prompt": ["short", "x" * 11]}
    assert refused(prompts, CompletionRequest, limits).param == "prompt[1]"
    assert refused({"model": "m", "prompt": "x" * 11}, CompletionRequest, limits).param == "prompt"
    for ok in (["x" * 10, "y"], [[1] * 50]):  # token ids are counted as tokens, later
        parse_body(json.dumps({"model": "m", "prompt": ok}).encode(), CompletionRequest, limits)


def test_limits_and_config_refuse_bad_values():
    for bad in ({"max_tools": 0}, {"max_json_depth": 513}, {"max_prompt_chars": -1},
                {"max_stop": 2**31}, {"max_messages": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RequestLimits(**bad)
    for bad in ({"api_key": ""}, {"api_key": "   "}, {"api_key": " k"}, {"port": 65536},
                {"shutdown_timeout": float("nan")}, {"shutdown_timeout": float("inf")},
                {"max_queue": -1}, {"max_n": 2**63}):
        with pytest.raises(ConfigError):
            ServeConfig("m", **bad)


# ---- the prompt-character bound -----------------------------------------------------------------


def test_longest_token_bounds_the_characters_per_token():
    tokenizer = Tokenizer.from_dir(BUNDLED)
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True))
    texts = ["a" * 5000, " " * 3000, "<|start|>" * 200, "naïve café 東京 " * 100,
             "What is 17 times 23? " * 100, "\n\n\n\t" * 500]
    for text in texts:  # no prompt of more characters than context x longest can fit
        assert len(tokenizer.encode(text, add_special_tokens=False)) * longest >= len(text)


# ---- `noesis serve` flags -----------------------------------------------------------------------


@pytest.mark.parametrize("env", [False, True])
def test_an_empty_api_key_is_a_start_up_error(monkeypatch, capsys, env):
    monkeypatch.setattr("noesis.server.app.serve", lambda config: pytest.fail("served"))
    if env:
        monkeypatch.setenv("NOESIS_API_KEY", "")
        argv = ["serve", "--model", "m"]
    else:
        monkeypatch.delenv("NOESIS_API_KEY", raising=False)
        argv = ["serve", "--model", "m", "--api-key", ""]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "NOESIS_API_KEY" in err and "--api-key" in err


@pytest.mark.parametrize(
    "flag, value",
    [("--port", "65536"), ("--max-n", "0"), ("--max-queue", "-1"), ("--max-num-seqs", "0"),
     ("--seed", str(2**63)), ("--kv-cache-memory", str(2**63)), ("--shutdown-timeout", "nan"),
     ("--shutdown-timeout", "inf"), ("--max-json-depth", "513"), ("--max-tools", "0"),
     ("--max-prompt-chars", "many"), ("--max-body-bytes", str(2**31))],
)
def test_serve_flags_out_of_range_are_argument_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        cli._parser().parse_args(["serve", flag, value])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_serve_flags_reach_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("noesis.server.app.serve", lambda config: seen.update(c=config))
    monkeypatch.delenv("NOESIS_API_KEY", raising=False)
    cli.main(["serve", "--model", "m", "--api-key", "k", "--metrics-public", "--enable-docs",
              "--max-body-bytes", "1000", "--max-json-depth", "8", "--max-prompt-chars", "99",
              "--max-messages", "3", "--max-stop", "2", "--max-stop-chars", "5",
              "--max-tools", "4", "--max-schema-bytes", "600", "--max-schema-depth", "6"])
    config = seen["c"]
    assert (config.api_key, config.metrics_public, config.enable_docs) == ("k", True, True)
    assert config.max_body_bytes == 1000
    assert config.limits == RequestLimits(8, 99, 3, 2, 5, 4, 600, 6)
    cli.main(["serve", "--model", "m"])
    assert seen["c"].limits == RequestLimits() and seen["c"].max_body_bytes == 16 << 20


def test_limit_flags_state_the_defaults_they_have():
    limits = RequestLimits()
    for flag, help_text in cli._LIMIT_FLAGS.items():
        default = getattr(limits, flag.replace("-", "_"))
        assert default is None or f"default {default}" in help_text, flag


# ---- the API key gate and canonical paths -------------------------------------------------------


def gated_app(**options) -> TestClient:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    for path in ("/health", "/metrics", "/v1/models"):
        app.add_api_route(path, lambda: PlainTextResponse("ok"), methods=["GET"])
    app.add_middleware(APIKeyGate, config=ServeConfig("m", **options))
    app.add_middleware(CanonicalPaths)
    return TestClient(app)


@pytest.mark.parametrize("metrics_public", [False, True])
def test_every_route_but_health_needs_the_key(metrics_public):
    client = gated_app(api_key="k", metrics_public=metrics_public)
    key = {"Authorization": "Bearer k"}
    for path in ("/health", "/health/"):
        assert client.get(path).status_code == 200
    for path in ("/v1/models", "/v1/models/", "/v1/models//", "/docs", "/openapi.json",
                 "/nothing", "/metrics", "/metrics/"):
        expected = 200 if metrics_public and path.startswith("/metrics") else 401
        response = client.get(path)
        assert response.status_code == expected, path
        if expected == 401:
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["WWW-Authenticate"] == "Bearer"
        wrong = client.get(path, headers={"Authorization": "Bearer kk"}).status_code
        assert wrong == expected, path
    assert client.get("/v1/models/", headers=key).status_code == 200
    assert client.get("/docs", headers=key).status_code == 404
    assert client.get("/v1/models", headers={"Authorization": "bearer  k "}).status_code == 200


def test_without_a_key_everything_is_open():
    client = gated_app()
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models/").status_code == 200
