"""/v1/responses through the official client's `responses.create` and `responses.stream` on the
shared server: the chat route's reply as output items, text.format through its grammar, the
Responses SSE events, and the fields it cannot honour refused by name."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import MODEL_NAME

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # fmt: skip
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                          "strict": True}}  # fmt: skip
ASK = {"model": MODEL_NAME, "temperature": 0, "instructions": "Answer briefly.",
       "input": "Is the sky blue?"}  # fmt: skip


def test_a_response_is_the_chat_routes_reply_as_output_items(client):
    response = client.responses.create(max_output_tokens=5, **ASK)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    message = response.output[-1]
    assert message.type == "message" and message.content[0].type == "output_text"
    assert 0 < response.usage.output_tokens <= 5 and response.usage.input_tokens > 5
    chat = client.chat.completions.create(
        model=MODEL_NAME, temperature=0, max_tokens=5,
        messages=[{"role": "system", "content": ASK["instructions"]},
                  {"role": "user", "content": ASK["input"]}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_message_items_and_a_json_schema_format(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Is it "},
                                          {"type": "input_text", "text": "raining?"}]}]
    response = client.responses.create(model=MODEL_NAME, input=items, text=JSON_FORMAT,
                                       max_output_tokens=40, temperature=0)  # fmt: skip
    assert response.status == "completed" and response.incomplete_details is None
    assert set(json.loads(response.output_text)) == {"ok"}


def test_streamed_events_build_the_same_response(client):
    whole = client.responses.create(text=JSON_FORMAT, max_output_tokens=40, **ASK)
    with client.responses.stream(text=JSON_FORMAT, max_output_tokens=40, **ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_response_cut_at_max_output_tokens_streams_incomplete(client):
    events = list(client.responses.create(max_output_tokens=2, stream=True, **ASK))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(numbers)))
    last = events[-1]
    if last.type == "response.incomplete":  # (an early EOS would complete it instead)
        assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"truncation": "auto"}, "truncation"),
])  # fmt: skip
def test_what_it_cannot_honour_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{**ASK, "max_output_tokens": 2, **fields})
    assert info.value.body["param"] == param


def test_function_tools_go_through_the_chat_routes_turn_format(client):
    """The tiny model has no tool-call syntax: the chat route's refusal, naming the fix."""
    tool = {"type": "function", "name": "roll", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="--tool-dialect"):
        client.responses.create(tools=[tool], max_output_tokens=2, **ASK)
