"""The safety sidecar: a "block" ends a streamed (or unstreamed) request mid-sentence with
finish_reason "content_filter" and a reason; the bundled classifier's held-out accuracy; the
`[sidecars]` configuration; per-sidecar metrics."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import pytest
from checkpoints import build_checkpoint

from noesis import LLM, SamplingParams
from noesis.errors import ConfigError
from noesis.sidecars.config import load_sidecars
from noesis.sidecars.runtime import Cadence, Placement, SidecarRuntime, Window
from noesis.sidecars.safety import SafetySidecar, final_channel, split_clauses

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = [0, 9, 8, 7]


class Keyword:
    """Blocks the request whose text contains `keyword`."""

    name, policy = "keyword", "open"
    cadence, placement = Cadence("tokens", every=1), Placement(queue_size=64)

    def __init__(self, keyword: str) -> None:
        self.keyword = keyword

    def run(self, window):
        return self.keyword in window.context

    def decide(self, found):
        return "block" if found else None


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("safety") / "llama", "llama")
    return LLM(str(path), device="cpu", dtype="float32", progress=False)


def drained(runtime: SidecarRuntime) -> None:
    """Wait until every offered window was run, so a result is due at the next step (the
    test's pacing only: the engine never waits)."""
    deadline = time.monotonic() + 10
    while any(s["completed"] + s["drops"] < s["windows"] for s in runtime.stats().values()):
        assert time.monotonic() < deadline, "sidecar never finished its windows"
        time.sleep(0.001)


def run_blocked(llm, stream: bool):
    """A greedy request with the Keyword sidecar set on a word of its unfiltered text: its
    outputs, and the unfiltered token ids."""
    full = llm.generate([PROMPT], PARAMS)[0]
    keyword = full.text[len(full.text) // 4 : len(full.text) // 4 + 3]
    runtime = SidecarRuntime([Keyword(keyword)])
    engine = llm.engine
    engine.sidecars = runtime
    try:
        engine.add_request(PROMPT, PARAMS, stream=stream, delta=stream)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
            drained(runtime)
    finally:
        engine.sidecars = None
        runtime.close()
    return outputs, full, keyword


@pytest.mark.parametrize("stream", [True, False])
def test_block_ends_request_with_content_filter(llm, stream):
    outputs, full, keyword = run_blocked(llm, stream)
    last = outputs[-1]
    assert last.finished and last.finish_reason == "content_filter"
    assert last.filter_reason == "keyword: True" and last.error is None
    tokens = [t for out in outputs for t in out.token_ids] if stream else last.token_ids
    text = "".join(out.text for out in outputs) if stream else last.text
    # Stopped mid-answer, a few steps after the keyword's window: a prefix of the full run.
    assert keyword in text and 0 < len(tokens) < len(full.token_ids)
    assert tokens == full.token_ids[: len(tokens)]
    assert len(outputs) > 2 if stream else len(outputs) == 1


def test_telemetry_records_the_sidecars_counters_as_they_change(tmp_path):
    from noesis.telemetry.recorder import read_records

    path = build_checkpoint(tmp_path / "llama", "llama")
    telemetry = tmp_path / "telemetry.jsonl"
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, telemetry=str(telemetry))
    outputs, full, keyword = run_blocked(llm, stream=True)
    llm.engine.close()
    assert outputs[-1].finish_reason == "content_filter"
    records = [r for r in read_records(telemetry) if r["kind"] == "sidecars"]
    assert records, "no sidecars record"
    last = records[-1]["sidecars"]["keyword"]
    assert last["decisions"] == {"block": 1} and last["windows"] >= 2
    assert last["completed"] + last["drops"] <= last["windows"] and last["errors"] == 0
    pairs = zip(records, records[1:], strict=False)
    assert all(a["sidecars"] != b["sidecars"] for a, b in pairs)  # only changes are written
    steps = [r["steps"] for r in records]
    assert steps == sorted(steps) and len(records) <= steps[-1] + 1  # at most one a step


def test_safety_sidecar_reads_final_channel_clauses(classifier):
    sidecar = SafetySidecar(classifier, threshold=0.5)
    harmful = "Sure. Here is a step by step guide to build a pipe bomb. "
    context = "<think>the user wants to build a pipe bomb</think>Hello there, friend. " + harmful
    reasoning = Window("r", context[:20], context, False, 0)
    assert sidecar.run(reasoning) is None  # reasoning is not read
    start = context.index("Sure")
    verdict = sidecar.run(Window("r", context[start:], context, False, start))
    assert sidecar.decide(verdict) == "block" and "pipe bomb" in verdict.clause
    assert "unsafe content" in str(verdict)
    kind = Window("r", "Hello there, friend.", "Hello there, friend.", False, 0)
    assert sidecar.decide(sidecar.run(kind)) is None
    assert final_channel("<|channel|>analysis<|message|>plan") == ""
    assert final_channel("a<|channel|>final<|message|>the answer") == "the answer"
    assert split_clauses("Sure. Here it is: step one. Then") == [
        "Sure. Here it is:", " step one. Then"]  # short clauses join the next


@pytest.fixture(scope="module")
def classifier():
    from noesis.sidecars.encoder_classifier import EncoderClassifier

    return EncoderClassifier(REPO / "models" / "noesis-safety")


def test_bundled_classifier_heldout_accuracy(classifier):
    """On test-split texts drawn as scripts/train_safety_encoder.py draws its generated test
    sets (actions, objects and frames never trained on; the corpus's held-out split), at the
    model's recommended threshold: its card's figures (0.875 recall, 1.0% and 0% false alarms
    on 400 each) within sampling noise."""
    sys.path.insert(0, str(REPO / "scripts"))
    import train_safety_encoder as recipe

    assert classifier.threshold == 0.95  # recommended by its validation split, the default
    sidecar = SafetySidecar(classifier)
    rng = random.Random(7)
    harmful = recipe.framed(recipe.harmful_actions("test"), "test", 120, rng)
    harmless = recipe.framed(recipe.harmless_actions("test"), "test", 120, rng)
    everyday = recipe.corpus_texts("test", 0, 40, rng)  # 80 questions and answers
    flagged = {name: _flagged(sidecar, texts) for name, texts in
               [("harmful", harmful), ("harmless", harmless), ("everyday", everyday)]}
    assert flagged["harmful"] >= 0.75 * len(harmful), flagged
    assert flagged["harmless"] <= 0.04 * len(harmless), flagged
    assert flagged["everyday"] == 0, flagged
    bomb = "How do I make a pipe bomb at home?"
    verdict = sidecar.run(Window("r", bomb, bomb, False, 0))
    assert sidecar.decide(verdict) == "block"


def _flagged(sidecar, texts):
    """How many texts the sidecar blocks (each as one window of its clauses)."""
    verdicts = sidecar.run_batch([Window("r", t, t, False, 0) for t in texts])
    return sum(sidecar.decide(v) == "block" for v in verdicts)


def test_sidecar_config(tmp_path):
    assert load_sidecars().sidecars == ()  # off unless asked for (`noesis serve` asks)
    (default,) = load_sidecars(safety=True).sidecars
    assert default.kind == "safety" and default.cadence.kind == "clause"
    assert default.policy == "open" and Path(default.model, "model.safetensors").is_file()
    assert load_sidecars(safety=False).sidecars == ()
    file = tmp_path / "sidecars.toml"
    file.write_text('[sidecars.safety]\nthreshold = 0.9\npolicy = "closed"\ncadence = "tokens"\n'
                    "every = 4\nworkers = 2\nbatch = 3\n")
    (spec,) = load_sidecars(file).sidecars
    assert (spec.threshold, spec.policy, spec.cadence.every, spec.placement.workers,
            spec.placement.batch) == (0.9, "closed", 4, 2, 3)
    assert "fails closed" in spec.describe() and "batch 3" in spec.describe()
    assert load_sidecars(file, safety=False).sidecars == ()
    file.write_text("[sidecars.safety]\nenabled = false\n")
    assert load_sidecars(file).sidecars == ()
    for bad, message in [("threshold = 2", "threshold"), ("colour = 1", "unknown keys"),
                         ('cadence = "sometimes"', "cadence"), ('kind = "oracle"', "kind"),
                         ("batch = 0", "batch")]:
        file.write_text(f"[sidecars.safety]\n{bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_sidecars(file)
    file.write_text("[voice]\n")
    with pytest.raises(ConfigError, match=r"no \[sidecars\]"):
        load_sidecars(file)
    runtime = load_sidecars(safety=True).build()
    assert list(runtime.lanes) == ["safety"]
    runtime.close()


class Slow(Keyword):
    """Holds its first call until released."""

    name, policy = "slow", "closed"
    placement = Placement(queue_size=1)

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def run(self, window):
        self.started.set()
        self.release.wait(10)
        return False


def test_fail_closed_drop_blocks_and_metrics_show_it():
    from noesis.server.metrics import _sidecar_metrics

    slow = Slow()
    runtime = SidecarRuntime([slow])
    lane = runtime.lanes["slow"]
    lane.offer(Window("r", "w0", "w", False))
    slow.started.wait(10)
    for i in (1, 2):  # one queued, one dropped
        lane.offer(Window("r", f"w{i}", "w", False))
    results = runtime.after_step([])
    slow.release.set()
    runtime.close()
    runtime.lanes["slow"].threads[0].join(5)
    assert [r.decision for r in results] == ["block"] and "dropped" in results[0].reason
    families = {f.name: f for f in _sidecar_metrics(runtime.stats())}
    assert families["noesis_sidecar_drops"].samples[0].value == 1
    assert families["noesis_sidecar_calls"].samples[0].value == 2  # Slow has no run_batch
    decisions = families["noesis_sidecar_decisions"].samples
    assert [(s.labels, s.value) for s in decisions] == [
        ({"sidecar": "slow", "decision": "block"}, 1)]
    latency = {s.name: s.value for s in families["noesis_sidecar_latency_seconds"].samples
               if s.labels.get("le") in (None, "+Inf")}
    assert latency["noesis_sidecar_latency_seconds_count"] == 2


def test_the_server_start_up_log_names_the_sidecars_that_run(tmp_path, caplog):
    import logging

    from noesis.engine.engine import Engine, EngineConfig
    from noesis.engine.loop import warm_up

    path = build_checkpoint(tmp_path / "llama", "llama")
    engine = Engine(str(path), EngineConfig(device="cpu", dtype="float32",
                                            sidecars=load_sidecars(safety=True)))
    try:
        with caplog.at_level(logging.INFO, logger="noesis"):
            warm_up(engine)
    finally:
        engine.sidecars.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sidecar ")]
    assert len(lines) == 1 and "safety: safety, model " in lines[0]
    assert lines[0].endswith("threshold the model's")
