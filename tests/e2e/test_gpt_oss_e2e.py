"""gpt-oss through `noesis serve` and the official client, on the tiny random checkpoint with
the o200k_harmony vocabulary: Harmony turns come back parsed into OpenAI's fields (tool calls,
reasoning_content, content). Slow: the 200k-token
vocabulary costs the server ~30 s to load and compile its grammar
(`pytest -m slow tests/e2e/test_gpt_oss_e2e.py`)."""

from __future__ import annotations

import json

import pytest
from checkpoints import build_gpt_oss_o200k
from conftest import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_gpt_oss_o200k(tmp_path_factory.mktemp("gpt-oss") / "model")
    process = ServerProcess(model, tmp_path_factory.mktemp("logs"))
    yield process
    process.stop()


def test_harmony_turns_through_the_official_client(server):
    """A required tool: the reply is parsed Harmony, never raw markup. A random model either
    calls (the call and its arguments so far, cut by max_tokens) or reasons first (the analysis
    as reasoning_content; which one depends on near-ties of random logits, so either passes).
    No tools: the final channel's text is the content."""
    client = server.client(timeout=120)
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=24,
        temperature=0,
    )
    message = reply.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert message.content is None and (message.tool_calls or reasoning), message
    for call in message.tool_calls or ():
        assert call.function.name == "get_weather"
        assert call.function.arguments.startswith('{"city":')
    assert "<|" not in (reasoning or "") + json.dumps(reply.model_dump())
    plain = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert not plain.choices[0].message.tool_calls
    assert plain.choices[0].message.content or plain.choices[0].message.model_extra
