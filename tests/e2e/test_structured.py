"""Structured output and tool calls through the server: response_format on a plain model, and
tools / tool_choice / tool_calls (whole and streamed) on the bundled Harmony model."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import MODEL_NAME, ServerProcess, chat

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"

CHOICE_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0,
                                                                 "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def test_response_format_json_schema_on_a_random_model_always_validates(client):
    """Random weights would never write this JSON by themselves; the grammar makes every seed's
    output an instance of the schema, and the request stops when the object closes."""
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Rate it."), max_tokens=40, seed=seed,
            temperature=1.0, response_format=_json_schema(CHOICE_SCHEMA),
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), CHOICE_SCHEMA)


def test_unsupported_schema_keyword_is_a_400_naming_it(client):
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "dependentSchemas": {"a": {"required": ["b"]}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=chat("x"), max_tokens=4,
                                       response_format=_json_schema(schema))
    assert "dependentSchemas" in info.value.body["message"]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory) -> openai.OpenAI:
    server = ServerProcess(BUNDLED, tmp_path_factory.mktemp("harmony-logs"))
    try:
        yield server.client()
    finally:
        assert server.stop() == 0, server.log()


def _ask(client, question: str, **options):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=chat(question), max_tokens=160, temperature=0, **options
    )


def test_tool_call_comes_back_as_tool_calls(harmony):
    out = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR, WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, CALCULATOR["function"]["parameters"])
    assert choice.message.content is None


def test_tool_result_leads_to_a_final_answer(harmony):
    first = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR]).choices[0].message
    call = first.tool_calls[0]
    messages = chat("What is 17 times 23?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "391"},
    ]
    out = harmony.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=160,
                                          temperature=0, tools=[CALCULATOR])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "391" in choice.message.content


def test_named_tool_choice_forces_that_tool_with_valid_arguments(harmony):
    """The model would call the calculator; tool_choice makes it call get_weather, and the
    schema makes the arguments valid anyway (unit from the enum)."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR, WEATHER],
                   tool_choice=forced, seed=seed)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])


def test_tool_choice_none_answers_without_calling(harmony):
    out = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR], tool_choice="none")
    choice = out.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert "<|" not in (choice.message.content or "")


def test_streamed_tool_call_deltas_add_up_to_the_whole_response(harmony):
    whole = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR]).choices[0]
    stream = _ask(harmony, "What is 17 times 23?", tools=[CALCULATOR], stream=True)
    name, arguments, reasoning, reasons = "", "", "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls"
    assert name == whole.message.tool_calls[0].function.name
    assert arguments == whole.message.tool_calls[0].function.arguments
    assert reasoning == whole.message.reasoning_content


def test_plain_chat_on_a_harmony_model_returns_the_final_channel(harmony):
    out = _ask(harmony, "Hello!")
    message = out.choices[0].message
    assert message.content and "<|" not in message.content
    assert message.reasoning_content  # the analysis channel, kept apart
