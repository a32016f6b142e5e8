"""Telemetry and deterministic replay on the CPU: telemetry files parse and add up to the
engine's counters; traces replay token-exact across batch compositions (staggered arrivals,
mixed lengths, preemption, prefix-cache hits, chunked prefill, grammar and speculative rows,
overlapped steps); corrupted or mismatched traces are refused; edited tokens are found."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from noesis import SamplingParams, SpeculativeConfig
from noesis.cli import main
from noesis.engine.engine import Engine, EngineConfig
from noesis.errors import ConfigError
from noesis.kv.cache import page_bytes
from noesis.structured import GrammarSpec
from noesis.telemetry import TraceError, load_trace, read_records
from noesis.telemetry.replay import replay

PROMPTS = [[0, 5, 9, 77, 100, 21], list(range(40, 72)), [3, 14, 15, 92, 65] * 3, [7] * 11]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True),
    ]


def record(model: Path, trace: Path, telemetry: Path | None = None, **options) -> Engine:
    """A busy run: requests arrive over several steps, each with its own length and knobs."""
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        progress=False,
        trace=str(trace),
        deterministic=True,
        telemetry=str(telemetry) if telemetry else False,
        **options,
    )
    engine = Engine(str(model), config)
    arrivals = {0: [0, 1], 2: [2], 5: [3]}  # step -> prompts added before it
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for index in arrivals.get(step, []):
            engine.add_request(PROMPTS[index], mixed_params()[index], f"r{index}")
        engine.step()
        step += 1
    engine.close()
    return engine


@pytest.fixture(scope="module")
def model(checkpoints) -> Path:
    return checkpoints.path("llama")


@pytest.fixture(scope="module")
def recorded(model, tmp_path_factory) -> Path:
    """One plain busy run's trace, shared by the tests that damage copies of it."""
    trace = tmp_path_factory.mktemp("traces") / "run.trace"
    record(model, trace)
    return trace


def small_pool(checkpoints) -> int:
    return 6 * page_bytes(checkpoints.llm("llama").model_config, 16, torch.float32)


def test_busy_trace_replays_token_exact(model, checkpoints, tmp_path):
    """Preemption (a 6-page pool), chunked prefill (8-token steps), prefix caching, n-gram
    speculation: the replay matches every step's batch and every token."""
    spec = SpeculativeConfig(method="ngram", ngram_min=1, k=3, adaptive=False)
    trace, telemetry = tmp_path / "busy.trace", tmp_path / "busy.jsonl"
    engine = record(
        model,
        trace,
        telemetry,
        kv_cache_memory=small_pool(checkpoints),
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        speculative=spec,
    )
    events = load_trace(trace).events
    assert any(len(e["rows"]) > 1 for e in events if e["kind"] == "step")
    assert any(row[2] for e in events if e["kind"] == "step" for row in e["rows"])  # verify rows
    assert engine.spec_counts["proposed"] > 0
    assert any("preempted" in e for e in events if e["kind"] == "step")
    assert engine.prefix_cache.hit_tokens > 0
    assert max(sum(row[1] for row in e["rows"]) for e in events if e["kind"] == "step") == 8
    report = replay(trace)
    assert report.ok, report.divergence.describe()
    assert report.tokens == sum(p.max_tokens for p in mixed_params())
    assert report.requests == 4
    check_telemetry_sums(engine, telemetry)


def check_telemetry_sums(engine: Engine, path: Path) -> None:
    """The telemetry file's step lines add up to the engine's own counters."""
    records = read_records(path)
    steps = [r for r in records if r["kind"] == "step"]
    done = {r["request_id"]: r for r in records if r["kind"] == "request"}
    assert len(steps) == sum(engine.runner.step_counts.values())
    assert sum(not s["graph"] for s in steps) == engine.runner.step_counts["eager"]
    assert sum(s["spec_proposed"] for s in steps) == engine.spec_counts["proposed"]
    assert sum(s["spec_accepted"] for s in steps) == engine.spec_counts["accepted"]
    produced = {}
    for step in steps:
        assert step["gpu_ms"] > 0 and step["host_ms"] >= 0 and step["bytes_per_token"] > 0
        for request_id, ids in step["out"]:
            produced[request_id] = produced.get(request_id, 0) + len(ids)
    assert produced == {f"r{i}": p.max_tokens for i, p in enumerate(mixed_params())}
    assert {rid: r["output_tokens"] for rid, r in done.items()} == produced
    assert all(r["ttft_s"] > 0 and r["num_steps"] > 0 for r in done.values())


def test_grammar_rows_and_overlapped_steps_replay(model, tmp_path):
    trace = tmp_path / "grammar.trace"
    config = EngineConfig(
        device="cpu", dtype="float32", progress=False, trace=str(trace), overlap_steps=True
    )
    engine = Engine(str(model), config)
    lark = GrammarSpec.lark('start: "yes" | "no" | "maybe"')
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, grammar=lark) for s in (1, 2)]
    engine.add_request(PROMPTS[0], params[0], "g0")
    engine.add_request(PROMPTS[2], mixed_params()[1], "plain")
    engine.step()
    engine.add_request(PROMPTS[1], params[1], "g1")
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert replay(trace).ok


def test_edited_tokens_are_found(recorded, tmp_path):
    trace = recorded
    lines = trace.read_text().splitlines()
    target = next(i for i, line in enumerate(lines) if '"kind":"tokens","step":4' in line)
    edited = json.loads(lines[target])
    request_id, ids = edited["out"][0]
    ids[0] = (ids[0] + 1) % 384
    lines[target] = json.dumps(edited)
    bad = tmp_path / "edited.trace"
    bad.write_text("\n".join(lines) + "\n")
    report = replay(bad)
    assert not report.ok
    assert (report.divergence.what, report.divergence.step) == ("token", 4)
    assert report.divergence.request_id == request_id
    assert report.divergence.logit_gap < 0  # the edited token was not the replay's choice
    # the CLI: 0 when all match, 1 (and the divergence on stderr) otherwise
    assert main(["replay", str(trace)]) == 0
    assert main(["replay", str(bad), "--json", str(tmp_path / "r.json")]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["divergence"]["step"] == 4


def test_corrupted_and_mismatched_traces_are_refused(recorded, checkpoints, tmp_path):
    trace = recorded
    lines = trace.read_text().splitlines()
    broken = tmp_path / "broken.trace"
    broken.write_text("\n".join(lines[:3] + ['{"kind": "step", "st'] + lines[3:]))
    with pytest.raises(TraceError, match="not JSON"):
        replay(broken)
    no_header = tmp_path / "no_header.trace"
    no_header.write_text("\n".join(lines[1:]))
    with pytest.raises(TraceError, match="no header"):
        replay(no_header)
    with pytest.raises(TraceError, match="model hash"):
        replay(trace, model=str(checkpoints.path("llama-mqa")))
    header = json.loads(lines[0])
    header["tokenizer_hash"] = "0" * 64
    other = tmp_path / "other.trace"
    other.write_text("\n".join([json.dumps(header), *lines[1:]]))
    with pytest.raises(TraceError, match="tokenizer hash"):
        replay(other)
    assert main(["replay", str(broken)]) == 1  # a clear error, not a traceback


def test_options_are_checked():
    with pytest.raises(ConfigError, match="trace"):
        EngineConfig(deterministic=True)
    with pytest.raises(ConfigError, match="telemetry"):
        EngineConfig(telemetry=3)


def test_request_metrics_signals_and_histograms(model, checkpoints):
    """RequestOutput.metrics; a signal hook's per-token values and a host decision reach the
    request's metrics; the histograms expose as Prometheus text."""
    llm = checkpoints.new_llm("llama", telemetry=True)
    engine = llm.engine

    def entropy(logits, seqs):
        logp = torch.log_softmax(logits.float(), dim=-1)
        return {"entropy": -(logp.exp() * logp).sum(dim=-1)}

    engine.runner.signal_hooks.append(entropy)
    engine.add_request(PROMPTS[0], mixed_params()[0], "m0")
    engine.observer.annotate("m0", decision="emit")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    metrics = final.metrics
    assert final.finished and metrics.output_tokens == len(final.token_ids) == 12
    assert metrics.ttft_s > 0 and metrics.tpot_s > 0 and metrics.gpu_ms > 0
    assert len(metrics.signals["entropy"]) == 12
    assert all(0 <= h <= math.log(384) + 1e-4 for h in metrics.signals["entropy"])
    assert metrics.decisions == {0: {"decision": "emit"}}
    assert outputs[0].metrics is not final.metrics  # outputs hold copies
    from noesis.server.metrics import _telemetry_histograms

    class Collector:
        def collect(self):
            return _telemetry_histograms(engine.observer.telemetry.snapshot())

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    steps = engine.observer.telemetry.totals["steps"]
    assert f'noesis_step_gpu_seconds_bucket{{le="+Inf"}} {float(steps)}' in text
    assert "noesis_batch_rows_count" in text
    # the sampler's per-token metrics (SamplingParams.metrics), when a request asks for them
    engine.runner.signal_hooks.clear()
    asked = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, metrics=True)
    engine.add_request(PROMPTS[1], asked, "m1")
    while engine.has_unfinished():
        outputs = engine.step() or outputs
    signals = outputs[-1].metrics.signals
    assert len(signals["entropy"]) == len(signals["margin"]) == 5
    assert [m.entropy for m in outputs[-1].token_metrics] == signals["entropy"]
    buckets = engine.timing_buckets()
    steps = engine.observer.telemetry.totals["steps"]
    assert buckets["decode_s"] > 0 and buckets["steps"] == steps and "read_s" in buckets


def test_a_gguf_trace_replays(tmp_path):
    """A GGUF checkpoint is one file, not a directory: the replay resolves it as the loader does."""
    from test_gguf import bpe_vocab, hf_model, write_gguf

    model = tmp_path / "tiny.gguf"
    write_gguf(model, hf_model("llama"), "llama", "Q8_0", bpe_vocab())
    trace = tmp_path / "gguf.trace"
    record(model, trace)
    assert load_trace(trace).header["model"] == str(model)
    report = replay(trace)
    assert report.ok and report.tokens == sum(p.max_tokens for p in mixed_params())



def test_the_control_planes_phi_and_entropy_reach_the_metrics(checkpoints, tmp_path):
    """A controlled row's per-token entropy and Φ ([temperature, top_p, verify_width,
    think_budget] after each token) in RequestOutput.metrics and the telemetry file, Φ's move
    included; a greedy row beside it (no control) has none."""
    from test_control_knobs import SWITCH_AT, Switch

    path = tmp_path / "control.jsonl"
    llm = checkpoints.new_llm("llama", telemetry=str(path), control=Switch(SWITCH_AT))
    steered, greedy = llm.generate(PROMPTS[:2], [mixed_params()[1], mixed_params()[0]])
    llm.engine.close()
    phis = steered.metrics.signals["phi"]
    assert len(phis) == len(steered.metrics.signals["entropy"]) == 10
    assert phis[SWITCH_AT - 2] == [0.9, 0.9, 4, 128]  # the request's own knobs...
    assert phis[SWITCH_AT - 1][1] == pytest.approx(0.9e-6)  # ...until the policy switched
    assert set(greedy.metrics.signals.get("phi", [None])) == {None}
    steps = [r for r in read_records(path) if r["kind"] == "step"]
    assert sum(phi is not None for s in steps for phi in s.get("signals", {}).get("phi", [])) == 10


def test_controlled_rows_replay(checkpoints, tmp_path):
    """Rows the engine's control policy steers token by token replay token-exact."""
    trace = tmp_path / "control.trace"
    llm = checkpoints.new_llm("llama", control="default", deterministic=True, trace=str(trace))
    llm.generate(PROMPTS, mixed_params())
    llm.engine.close()
    assert load_trace(trace).header["engine"]["control"] == "default"
    assert replay(trace).ok
    # A custom policy is recorded by name, which a replay cannot rebuild: a clear refusal.
    from test_control_knobs import Switch

    llm = checkpoints.new_llm("llama", control=Switch(4), deterministic=True, trace=str(trace))
    llm.generate(PROMPTS[:1], mixed_params()[1:2])
    llm.engine.close()
    with pytest.raises(TraceError, match="control must be"):
        replay(trace)


def test_a_conversations_control_state_is_recorded_and_restored():
    """A later generation of a controlled conversation starts from the belief and Φ the
    conversation reached: the trace records that state with the request, and the replayed
    request's knobs start, and then move token by token, as the live ones do."""
    from noesis.control.phi import Phi
    from noesis.control.policy import DefaultPolicy
    from noesis.control.turns import TurnControl
    from noesis.sampling.metrics import TokenMetrics
    from noesis.telemetry.trace import params_from_dict, params_to_dict

    live = TurnControl(DefaultPolicy())
    params = live.params(SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8))
    state = live.state
    for entropy in (0.9, 1.4, 1.6, 1.5, 1.7, 0.2):  # an earlier generation's tokens
        state.belief.observe(TokenMetrics(entropy, 0.1, 0.9, 0.5))
    state.belief.observe_tool("calculator", ok=True, attempts=2, error=None)
    state.phi.phi = Phi(0.72, 0.81, 3, 140)
    state.phi.direction, state.phi.streak = 1, 2
    live.tool_choice("auto")  # the policy's emit-vs-tool decision for this generation
    recorded = json.loads(json.dumps(params_to_dict(params, 3)))
    assert recorded["control_state"]["decisions"] == state.decisions != []
    replayed = params_from_dict(recorded)
    assert replayed.temperature == 0.8 and replayed.seed == 3
    knobs_live, knobs_replayed = live.knobs(params), replayed.control.knobs(replayed)
    assert (knobs_replayed.temperature, knobs_replayed.top_p) == pytest.approx((0.72, 0.81))
    for entropy in (1.8, 1.9, 2.0, 0.1, 0.1, 0.1, 0.1, 0.1, 2.5, 2.5, 2.5):
        metrics = TokenMetrics(entropy, 0.2, 0.8, 0.3)
        knobs_live.observe(metrics)
        knobs_replayed.observe(metrics)
        assert (knobs_replayed.temperature, knobs_replayed.top_p) == (
            knobs_live.temperature, knobs_live.top_p)
    assert knobs_live.temperature != pytest.approx(0.72)  # the sequence moved the knobs
    restored = knobs_replayed.state
    assert restored.belief.reliability("calculator") == state.belief.reliability("calculator")
    assert list(restored.belief.recent) == list(state.belief.recent)


def test_a_conversations_emit_vs_tool_decision_reaches_the_metrics(checkpoints):
    """The policy's decision at a controlled conversation's generation (TurnControl.tool_choice)
    is recorded with the generation's first token, with no call from the Session."""
    from noesis.control.policy import DefaultPolicy
    from noesis.control.turns import TurnControl

    llm = checkpoints.new_llm("llama", telemetry=True)
    control = TurnControl(DefaultPolicy())
    params = control.params(SamplingParams(temperature=0.8, seed=1, max_tokens=3,
                                           ignore_eos=True))
    control.tool_choice("auto")
    (output,) = llm.generate([PROMPTS[0]], params)
    assert output.metrics.decisions == {0: {"decision": control.state.decisions[-1]}}
