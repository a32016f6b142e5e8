"""The cold load's two buckets: read (the model's files into memory) and place (device memory,
dtype conversion, copies) are both there, non-negative, and add up to the load bucket, in the
loaded model, in the engine's timing buckets and in its start-up log line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from noesis.engine.engine import format_timings
from noesis.engine.loading import load_model
from noesis.weights.paging import ReadClock


def test_read_and_place_add_up_to_the_cold_load(checkpoints):
    loaded = load_model(checkpoints.path("llama"), device="cpu", dtype="bfloat16", progress=False)
    phases = loaded.load_phases
    assert set(phases) == {"read_s", "place_s"}
    assert phases["read_s"] > 0 and phases["place_s"] > 0
    assert phases["read_s"] + phases["place_s"] == pytest.approx(loaded.load_seconds, abs=1e-9)


def test_engine_buckets_and_start_up_line_carry_the_split(checkpoints):
    engine = checkpoints.llm("llama").engine
    buckets = engine.timing_buckets()
    assert buckets["read_s"] >= 0 and buckets["place_s"] >= 0
    assert buckets["read_s"] + buckets["place_s"] == pytest.approx(buckets["load_s"], abs=1e-9)
    line = format_timings(buckets)
    assert f"(read {buckets['read_s']:.2f} s, place {buckets['place_s']:.2f} s)" in line


def test_the_clock_passes_mapped_tensors_through_and_books_their_read(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.arange(5000.0), "b": torch.ones(0), "c": torch.ones(())}
    save_file(tensors, path)
    clock = ReadClock()
    with safe_open(str(path), framework="pt") as handle:
        read = dict(clock.tensors((key, handle.get_tensor(key)) for key in tensors))
    assert read.keys() == tensors.keys()
    assert all(torch.equal(read[key], tensors[key]) for key in tensors)
    assert clock.seconds > 0
