"""Sidecars in the voice assistant: the voice config's `[sidecars]` tables (the server's file
format), every expert engine running them, and an answer the safety sidecar ends spoken as a
short refusal after what was already said, not cut to silence."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from noesis.errors import ConfigError
from noesis.harmony.parser import ContentDelta, MessageStart
from noesis.session import AssistantTurn
from noesis.voice.config import load_config
from noesis.voice.experts import BLOCKED_SPEECH, ExpertSpec, _spoken, llm_loader

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_the_voice_config_reads_sidecar_tables(tmp_path):
    assert load_config().sidecars is None  # none by default
    toml = tmp_path / "voice.toml"
    toml.write_text("[sidecars.safety]\nthreshold = 0.9\n[sidecars.intent]\n")
    (safety, intent) = load_config(toml).sidecars.sidecars
    assert (safety.kind, safety.threshold, safety.cadence.kind) == ("safety", 0.9, "clause")
    assert intent.kind == "intent" and Path(intent.model).name == "noesis-router"
    off = tmp_path / "off.json"
    off.write_text(json.dumps({"sidecars": {"safety": {"enabled": False}}}))
    assert load_config(off).sidecars is None
    bad = tmp_path / "bad.toml"
    bad.write_text("[sidecars.safety]\nthreshhold = 0.9\n")
    with pytest.raises(ConfigError, match="threshhold"):
        load_config(bad)
    bad.write_text('sidecars = "safety"\n')
    with pytest.raises(ConfigError, match="sidecars"):
        load_config(bad)


def test_every_expert_engine_runs_the_configured_sidecars(tmp_path):
    toml = tmp_path / "voice.toml"
    toml.write_text("[sidecars.safety]\n")
    config = load_config(toml)
    llm = llm_loader("float32", 512, sidecars=config.sidecars)(
        ExpertSpec("draft", MODELS / "noesis-tiny-draft"), "cpu")
    try:
        assert set(llm.engine.sidecars.lanes) == {"safety"}
    finally:
        llm.engine.sidecars.close()


def turn(reason: str) -> AssistantTurn:
    return AssistantTurn("", [], None, 10, 4, reason)


@pytest.mark.parametrize(("reason", "said"), [
    ("content_filter", "Here is how" + BLOCKED_SPEECH),
    ("length", "Here is how"),
])  # fmt: skip
def test_a_blocked_answer_is_said_to_be_refused(reason, said):
    events = [MessageStart("assistant", "final", None, None),
              ContentDelta("Here is how", "final", None), turn(reason)]
    spoken = _spoken(iter(events), threading.Event(), lambda: None, stray_calls=False)
    assert "".join(spoken) == said
