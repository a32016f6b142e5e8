"""Speculative rows replay token-exact: a busy trace (staggered arrivals, mixed lengths, greedy,
seeded and unseeded sampled rows) recorded with n-gram or draft-model speculation, adaptive depth
on, comes back token for token, verify rows included, also with chunked prefill and overlapped
steps. A trace whose speculative config was edited diverges (a row's proposals differ); one whose
draft checkpoint is another is refused (the trace holds the draft's hash)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_engine_speculative import near_draft

from noesis import SamplingParams, SpeculativeConfig
from noesis.cli import main
from noesis.engine.engine import Engine, EngineConfig
from noesis.telemetry import TraceError, load_trace
from noesis.telemetry.replay import replay

# The random model's greedy output of [7] * 11 repeats a bigram: an n-gram proposal is accepted.
PROMPTS = [[7] * 11, [0, 5, 9, 77, 100, 21], list(range(40, 72)), [3, 14, 15, 92, 65] * 3]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, max_tokens=10, ignore_eos=True),  # seed resolved
]
ARRIVALS = {0: [0, 1], 2: [2], 4: [3]}  # step -> prompts added before it


def record(model: Path, trace: Path, spec: SpeculativeConfig, **options) -> Engine:
    config = EngineConfig(device="cpu", dtype="float32", progress=False, deterministic=True,
                          trace=str(trace), speculative=spec, **options)
    engine = Engine(str(model), config)
    step = 0
    while step <= max(ARRIVALS) or engine.has_unfinished():
        for index in ARRIVALS.get(step, []):
            engine.add_request(PROMPTS[index], PARAMS[index], f"r{index}")
        engine.step()
        step += 1
    engine.close()
    return engine


def spec_config(checkpoints, method: str) -> SpeculativeConfig:
    """Adaptive depth: it follows each request's acceptance, which the replay must follow too."""
    if method == "ngram":
        return SpeculativeConfig(method="ngram", ngram_min=1, k=3)
    return SpeculativeConfig(method="draft", draft=str(near_draft(checkpoints)), k=3,
                             min_samples=4, entropy_cutoff=math.inf)


# "draft-chunked": 8-token prefill chunks and overlapped steps. (test_telemetry's busy trace
# replays n-gram rows under preemption and prefix-cache hits; a pool small enough to preempt
# leaves a draft model one page, and it stops proposing.)
RUNS = {
    "ngram": ("ngram", {}),
    "draft": ("draft", {}),
    "draft-chunked": ("draft", {"max_num_batched_tokens": 8, "overlap_steps": True}),
}


@pytest.fixture(scope="module", params=list(RUNS))
def recorded(request, checkpoints, tmp_path_factory) -> tuple[Path, Engine]:
    method, options = RUNS[request.param]
    trace = tmp_path_factory.mktemp("spec") / f"{request.param}.trace"
    engine = record(checkpoints.path("llama"), trace, spec_config(checkpoints, method), **options)
    return trace, engine


def test_speculative_rows_replay_token_exact(recorded):
    trace, engine = recorded
    events = load_trace(trace).events
    steps = [e for e in events if e["kind"] == "step"]
    assert any(len(e["rows"]) > 1 and any(row[2] for row in e["rows"]) for e in steps)
    assert 0 < engine.spec_counts["accepted"] < engine.spec_counts["proposed"]
    # a step that emitted several tokens for a row: an accepted proposal
    assert any(len(ids) > 1 for e in events if e["kind"] == "tokens" for _, ids in e["out"])
    report = replay(trace)
    assert report.ok, report.divergence.describe()
    assert (report.requests, report.tokens) == (4, sum(p.max_tokens for p in PARAMS))
    assert main(["replay", str(trace)]) == 0


def edited(trace: Path, dest: Path, **speculative) -> Path:
    lines = trace.read_text().splitlines()
    header = json.loads(lines[0])
    header["engine"]["speculative"].update(speculative)
    dest.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    return dest


def test_an_edited_speculative_config_diverges(recorded, tmp_path):
    trace, _ = recorded
    report = replay(edited(trace, tmp_path / "k1.trace", k=1))
    assert not report.ok
    assert report.divergence.what == "batch"  # a row's proposals: 3 recorded, 1 replayed
    assert main(["replay", str(tmp_path / "k1.trace")]) == 1


def test_another_draft_checkpoint_is_refused(checkpoints, tmp_path):
    trace = tmp_path / "draft.trace"
    record(checkpoints.path("llama"), trace, spec_config(checkpoints, "draft"))
    other = edited(trace, tmp_path / "other.trace", draft=str(checkpoints.path("llama-mqa")))
    with pytest.raises(TraceError, match="draft"):
        replay(other)
