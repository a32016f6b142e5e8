"""Telemetry and replay on CUDA (graphs captured, steps overlapped): device times come from
events, graph steps are counted, and a busy run's trace replays token-exact. `pytest -m gpu`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[0, 5, 9, 77, 100, 21], [0, 3] * 20, list(range(2, 90)), [0, 44, 45]]



def test_cuda_trace_replays_and_telemetry_counts(checkpoint, tmp_path):
    from noesis import SamplingParams
    from noesis.engine.engine import Engine, EngineConfig
    from noesis.telemetry import read_records
    from noesis.telemetry.replay import replay

    trace, telemetry = tmp_path / "cuda.trace", tmp_path / "cuda.jsonl"
    config = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        progress=False,
        trace=str(trace),
        telemetry=str(telemetry),
        max_num_seqs=8,
    )
    engine = Engine(str(checkpoint), config)
    assert engine.overlap and engine.runner.graphs is not None
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=20, ignore_eos=True),
    ]
    for step in range(40):
        if step in (0, 3, 7, 12):
            index = (0, 3, 7, 12).index(step)
            engine.add_request(PROMPTS[index], params[index % 2], f"r{index}")
        engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.close()
    steps = [r for r in read_records(telemetry) if r["kind"] == "step"]
    assert sum(s["graph"] for s in steps) == engine.runner.step_counts["graph"] > 0
    assert all(s["gpu_ms"] > 0 for s in steps)
    report = replay(trace)
    assert report.ok, report.divergence.describe()
    assert report.tokens == 2 * 24 + 2 * 20
