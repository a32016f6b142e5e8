"""A request a sidecar blocks mid-generation (finish_reason "content_filter") replays with the
block where the recording had it: in the whole trace, in its recorded batches, and alone in
batch-invariant mode. Sidecar verdicts arrive a varying number of steps late, so a replay takes
them from the trace rather than running the sidecars again."""

from __future__ import annotations

import pytest

from noesis import SamplingParams
from noesis.engine.engine import Engine, EngineConfig
from noesis.telemetry.replay import replay
from noesis.telemetry.trace import load_trace


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
@pytest.mark.parametrize("reason", ["content_filter", "pruned"])
def test_a_sidecar_block_replays_where_it_was_recorded(checkpoints, tmp_path, invariant, reason):
    """A branch the binding gate pruned (noesis.control.branches) replays the same way: the
    trace has the prune; the replay does not run the gate again."""
    trace = tmp_path / "blocked.trace"
    config = EngineConfig(device="cpu", dtype="float32", progress=False, deterministic=True,
                          trace=str(trace), batch_invariant=invariant)
    engine = Engine(str(checkpoints.path("llama")), config)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request([1, 2, 3], greedy, "blocked")
    engine.add_request([4, 5, 6, 7], greedy, "other")
    for _ in range(3):
        engine.step()
    if reason == "pruned":
        engine.prune_request("blocked")  # as Engine._check_branches does
    else:
        engine.filter_request("blocked", "a sidecar's verdict")  # as Engine._to_sidecars does
    while engine.has_unfinished():
        engine.step()
    engine.close()
    ends = {e["request_id"]: e for e in load_trace(trace).of_kind("finish")}
    assert ends["blocked"]["reason"] == reason
    assert 0 < len(ends["blocked"]["token_ids"]) < 12
    for request_id in (None, "blocked"):
        report = replay(trace, request_id=request_id)
        assert report.ok, report.divergence.describe()
