"""The server's safety sidecar through the official openai client: with a threshold that any
text passes, every answer ends with finish_reason "content_filter", streamed or not, and
/metrics shows the sidecar's windows and decisions. (Slow: its own server start; the engine-level
behaviour is covered cheaply in tests/unit/test_safety_sidecar.py.)"""

from __future__ import annotations

import pytest
from conftest import MODEL_NAME

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def blocking_server(start_server, tmp_path_factory):
    config = tmp_path_factory.mktemp("sidecars") / "sidecars.toml"
    config.write_text('[sidecars.strict]\nkind = "safety"\nthreshold = 1e-9\ncadence = "tokens"\n'
                      "every = 1\n")  # a sidecar of the safety kind under a name of its own
    return start_server("--sidecars", str(config))


def test_blocked_answers_end_with_content_filter(blocking_server):
    client = blocking_server.client()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "content_filter"
    assert reply.usage.completion_tokens < 200
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "content_filter" and reasons.count("content_filter") == 1
    metrics = blocking_server.wait_idle()
    assert metrics['noesis_sidecar_decisions_total{decision="block",sidecar="strict"}'] >= 2
    assert metrics['noesis_requests_total{finish_reason="content_filter"}'] == 2
