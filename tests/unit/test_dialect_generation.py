"""Turns of the text-dialect families sampled under the turn grammar, on tiny random checkpoints:
every completed call is valid for its schema under each tool_choice, thinking budgets hold, the
Session loop runs, and the server answers the official openai client (whole and streamed)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from dialect_checkpoints import family_checkpoints

from noesis import LLM, SamplingParams
from noesis.session import TurnRequest
from noesis.tools.registry import make_tool

# Schemas a random model completes in a few tokens: enums and short strings.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ROLL = {
    "type": "function",
    "function": {
        "name": "roll",
        "parameters": {
            "type": "object",
            "properties": {"sides": {"enum": [6, 20]}},
            "required": ["sides"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ROLL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "roll"}}
FAMILIES = ("qwen25", "qwen3", "llama31", "mistral03")


@pytest.fixture(scope="module")
def llms(checkpoints, tmp_path_factory) -> dict[str, LLM]:
    root = tmp_path_factory.mktemp("dialects")
    paths = family_checkpoints(checkpoints.path("llama"), root, (*FAMILIES, "r1_distill"))
    return {
        family: LLM(str(path), device="cpu", dtype="float32", max_num_seqs=16)
        for family, path in paths.items()
    }


def _requests(choices, seeds, max_tokens=40, **options) -> list[TurnRequest]:
    return [
        TurnRequest(QUESTION, TOOLS, choice, False, {
            "params": SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0),
            **options,
        })
        for choice in choices for seed in seeds
    ]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_every_completed_call_is_valid_for_its_schema_under_each_tool_choice(family, llms):
    """Random weights, sampled at T=1: the grammar alone makes calls well formed, of the
    declared tools, with arguments valid for their schemas; `required` and a named choice
    always call, `none` never does, parallel_tool_calls=False calls once."""
    llm = llms[family]
    choices = ("required", NAMED, "none", "auto")
    turns = llm.generate_turns(_requests(choices, range(2), thinking_budget=4))
    serial = llm.generate_turns(
        _requests(["required"], range(2), max_tokens=96, parallel_tool_calls=False)
    )
    for index, turn in enumerate(turns + serial):
        choice = choices[index // 2] if index < len(turns) else "required"
        if turn.finish_reason == "length":
            continue  # a call cut off by max_tokens is not a completed one
        assert turn.finish_reason == ("stop" if choice == "none" else turn.finish_reason)
        if choice in ("required", NAMED):
            assert turn.tool_calls and turn.finish_reason == "tool_calls", turn
        if choice == "none":
            assert not turn.tool_calls
        for call in turn.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert choice != NAMED or call.name == "roll"
    assert all(len(turn.tool_calls) <= 1 for turn in serial)
    # One call each (no room for more): the grammar ends the turn once it closes.
    assert [t.finish_reason for t in serial] == ["tool_calls"] * 2


def _think_tokens(llm: LLM, token_ids: list[int], opened: bool) -> int:
    """Tokens between <think> (or the reply's start, when the prompt opened it) and </think>."""
    close = llm.tokenizer.token_to_id("</think>")
    start = 0 if opened else token_ids.index(llm.tokenizer.token_to_id("<think>")) + 1
    return token_ids.index(close) - start


def test_a_thinking_budget_bounds_the_reasoning_in_tokens(llms):
    qwen3, r1 = llms["qwen3"], llms["r1_distill"]
    params = SamplingParams(max_tokens=24, seed=0, temperature=1.0)
    for budget in (0, 3):
        turn = r1.generate_turn(QUESTION, params=params, thinking_budget=budget)
        assert _think_tokens(r1, turn.token_ids, opened=True) <= budget
        assert turn.final is not None or turn.finish_reason == "length"
    for seed in range(3):
        params = SamplingParams(max_tokens=24, seed=seed, temperature=1.0)
        turn = qwen3.generate_turn(QUESTION, TOOLS, tool_choice="required", params=params,
                                   thinking_budget=2)  # fmt: skip
        if qwen3.tokenizer.token_to_id("<think>") in turn.token_ids:  # optional for Qwen3
            assert _think_tokens(qwen3, turn.token_ids, opened=False) <= 2


def test_response_format_holds_the_answer_of_a_dialect_turn(llms):
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["unit"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    params = SamplingParams(max_tokens=32, seed=0, temperature=1.0)
    turn = llms["qwen25"].generate_turn(QUESTION, params=params, response_format=response_format)
    jsonschema.validate(json.loads(turn.final), schema)


def test_reasoning_streams_apart_from_the_answer(llms):
    r1 = llms["r1_distill"]
    params = SamplingParams(max_tokens=16, seed=1, temperature=1.0)
    stream = r1.stream_turn(QUESTION, params=params, thinking_budget=4)
    channels = []
    while True:
        try:
            event = next(stream)
        except StopIteration as stop:
            turn = stop.value
            break
        channel = getattr(event, "channel", None)
        if channel is not None and (not channels or channels[-1] != channel):
            channels.append(channel)
    assert channels[0] == "analysis" and set(channels) <= {"analysis", "final"}
    assert turn.analysis and "</think>" not in turn.analysis + (turn.final or "")


def test_the_session_loop_runs_tools_for_a_text_dialect(llms):
    seen = []

    def roll(sides: Literal[6, 20]) -> str:
        """Roll a die."""
        seen.append(sides)
        return "4"

    tool = make_tool(roll)
    params = SamplingParams(max_tokens=64, seed=0, temperature=1.0)
    session = llms["qwen25"].session(max_tool_rounds=1)
    response = session.generate(
        QUESTION, [tool], tool_choice="required", params=params, parallel_tool_calls=False
    )
    assert seen and seen[0] in (6, 20)
    assert response.tool_calls[0].result.content == "4"
    tool_message = response.messages[2]
    assert tool_message["role"] == "tool" and response.usage.generations == 2


# ---- the server, in process, through the official client ----------------------------------------


@pytest.fixture(scope="module")
def server(llms):
    from starlette.testclient import TestClient

    from noesis.engine.transport import EngineThread
    from noesis.server.app import create_app
    from noesis.server.config import ServeConfig

    engine = llms["qwen3"].engine
    config = ServeConfig("qwen3", engine_process=False)
    with TestClient(create_app(config, EngineThread(engine))) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def test_the_server_returns_schema_valid_tool_calls_whole_and_streamed(server):
    for choice, seed in (("required", 0), (NAMED, 1)):
        ask = dict(model="qwen3", messages=QUESTION, tools=TOOLS, tool_choice=choice, seed=seed,
                   max_tokens=48, extra_body={"thinking_budget": 3})  # fmt: skip
        whole = server.chat.completions.create(**ask).choices[0]
        calls = {}
        for chunk in server.chat.completions.create(**ask, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
        assert whole.finish_reason in ("tool_calls", "length")
        if whole.finish_reason == "length":
            continue
        expected = [(c.function.name, json.loads(c.function.arguments))
                    for c in whole.message.tool_calls]  # fmt: skip
        for name, arguments in expected:
            jsonschema.validate(arguments, SCHEMAS[name])
            assert choice != NAMED or name == "roll"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


def test_the_server_splits_reasoning_and_refuses_reserved_template_kwargs(server):
    ask = dict(model="qwen3", messages=QUESTION, seed=3, max_tokens=12,
               extra_body={"thinking_budget": 4})  # fmt: skip
    whole = server.chat.completions.create(**ask).choices[0].message
    assert "<think>" not in (whole.content or "")
    no_thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    closed = server.chat.completions.create(**ask | no_thinking).choices[0].message
    assert getattr(closed, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        server.chat.completions.create(
            **ask | {"extra_body": {"chat_template_kwargs": {"tools": []}}}
        )


def test_tools_for_a_model_without_tool_syntax_are_a_400_naming_the_fix(llms, checkpoints):
    from noesis.engine.transport import EngineThread
    from noesis.errors import InvalidRequest
    from noesis.server.app import ServerState
    from noesis.server.config import ServeConfig
    from noesis.server.errors import APIError
    from noesis.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": QUESTION, "tools": TOOLS}
    )
    for llm, error in ((llms["r1_distill"], InvalidRequest), (checkpoints.llm("llama"), APIError)):
        state = ServerState(ServeConfig("m", engine_process=False), EngineThread(llm.engine))
        with pytest.raises(error, match="--tool-dialect"):
            state.chat_turn(body, state.chat_prompt(body))
    named = ServeConfig("m", engine_process=False, tool_dialect="hermes")
    state = ServerState(named, EngineThread(llms["r1_distill"].engine))
    assert state.turns.name == "hermes" and state.tool_calls
