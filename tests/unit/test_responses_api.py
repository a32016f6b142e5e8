"""/v1/responses with function tools: a Responses body becomes the chat route's request, and a
model with tool-call syntax (a tiny random checkpoint with the Hermes template) answers a forced
call as a function_call item, whole and through the official client's `responses.stream`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from dialect_checkpoints import family_checkpoints

from noesis import LLM
from noesis.server.errors import APIError
from noesis.server.responses_api import ResponsesRequest

ROLL = {"type": "function", "name": "roll", "description": "Roll a die.",
        "parameters": {"type": "object", "properties": {"sides": {"enum": [6, 20]}},
                       "required": ["sides"], "additionalProperties": False}}  # fmt: skip
FORCED = {"type": "function", "name": "roll"}


def chat_of(**fields):
    return ResponsesRequest.model_validate({"model": "m", **fields}).chat_request()


def test_input_items_become_the_chat_routes_messages_and_tools():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Roll two."}]},
        {"type": "function_call", "call_id": "c1", "name": "roll", "arguments": '{"sides":6}'},
        {"type": "function_call", "call_id": "c2", "name": "roll", "arguments": '{"sides":20}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                              "text": "Done."}]},
    ]  # fmt: skip
    chat = chat_of(input=items, instructions="Be brief.", tools=[ROLL], tool_choice=FORCED,
                   max_output_tokens=7, text={"format": {"type": "json_object"}})
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "Roll two."), ("assistant", None),
                     ("tool", "4"), ("assistant", "Done.")]
    assert [c["id"] for c in chat.messages[2].tool_calls] == ["c1", "c2"]  # one turn, two calls
    assert chat.tools[0]["function"]["parameters"] == ROLL["parameters"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "roll"}}
    assert chat.max_completion_tokens == 7 and chat.response_format == {"type": "json_object"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0][0]"),
    ({"input": []}, "input"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
])  # fmt: skip
def test_what_it_cannot_honour_names_the_field(fields, param):
    with pytest.raises(APIError) as info:
        chat_of(**{"input": "Hi", **fields})
    assert info.value.status == 400 and info.value.param == param


@pytest.fixture(scope="module")
def client(checkpoints, tmp_path_factory):
    from starlette.testclient import TestClient

    from noesis.engine.transport import EngineThread
    from noesis.server.app import create_app
    from noesis.server.config import ServeConfig

    path = family_checkpoints(checkpoints.path("llama"), tmp_path_factory.mktemp("responses"),
                              ("qwen25",))["qwen25"]  # fmt: skip
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=4)
    with TestClient(create_app(ServeConfig("qwen25", engine_process=False),
                               EngineThread(llm.engine))) as http:  # fmt: skip
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def test_a_forced_call_is_a_function_call_item_whole_and_streamed(client):
    ask = dict(model="qwen25", input="Roll a die.", tools=[ROLL], tool_choice=FORCED,
               temperature=0, max_output_tokens=60, parallel_tool_calls=False)  # fmt: skip
    whole = client.responses.create(**ask)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and [c.name for c in calls] == ["roll"]
    jsonschema.validate(json.loads(calls[0].arguments), ROLL["parameters"])
    with client.responses.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    follow_up = [{"role": "user", "content": "Roll a die."},
                 {"type": "function_call", "call_id": calls[0].call_id, "name": "roll",
                  "arguments": calls[0].arguments},
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": "4"}]
    answer = client.responses.create(model="qwen25", input=follow_up, tools=[ROLL],
                                     temperature=0, max_output_tokens=3)  # fmt: skip
    assert answer.usage.input_tokens > whole.usage.input_tokens
