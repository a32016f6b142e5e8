"""`noesis bench` (offline, and its bounded load generator against the shared server), `noesis
info --timings`, and `generate --telemetry --deterministic --trace` then `noesis replay`, all
in-process on the tiny checkpoint with small sizes."""

from __future__ import annotations

import json

import pytest

from noesis.cli import main
from noesis.telemetry import read_records


def test_bench_offline_writes_the_table_and_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--prompt-len",
        "8",
        "--gen-len",
        "4",
        "--batches",
        "2",
        "--repeats",
        "1",
        "--overhead",
        "2",
        "--overhead-steps",
        "2",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "roofline" in table and "telemetry overhead at batch 2" in table
    report = json.loads(out.read_text())
    assert report["bandwidth_gb_s"] > 0 and report["weight_bytes"] > 0
    assert report["latency"]["ttft_ms"] > 0 and report["latency"]["decode_tok_s"] > 0
    assert set(report["throughput"]) == {"2"}
    assert all(e["roofline_tok_s"] > 0 for e in report["throughput"].values())
    assert report["timings"]["load_s"] > 0 and "warmup_s" in report["timings"]
    assert "step_ms_on" in report["telemetry_overhead"]["2"]


def test_bench_against_a_running_server(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = [
        "bench",
        "--url",
        server.url,
        "--requests",
        "4",
        "--concurrency",
        "2",
        "--prompt-len",
        "4",
        "--gen-len",
        "3",
        "--timeout",
        "60",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["requests"], report["failed"]) == (4, 0)
    assert report["ttft_ms_p50"] > 0 and report["output_tok_s"] > 0
    assert "req/s" in capsys.readouterr().out


def test_info_timings(tiny_model, capsys):
    assert main(["info", "--model", str(tiny_model), "--device", "cpu", "--timings"]) == 0
    text = capsys.readouterr().out
    seconds = {line[:30].strip(): float(line.split()[-2])
               for line in text.splitlines() if line.startswith("    ")}  # the load's parts
    assert set(seconds) == {"read (files into memory)", "place (device, dtype)"}, text
    assert all(value >= 0 for value in seconds.values())
    load = next(float(line.split()[-2]) for line in text.splitlines() if "cold load" in line)
    assert sum(seconds.values()) == pytest.approx(load, abs=2e-4)  # each printed to 1e-4
    for label in (
        "cold load",
        "graph capture",
        "warm-up",
        "prefill",
        "decode (device)",
        "host overhead",
    ):
        assert label in text, text


def test_generate_records_telemetry_and_a_trace_that_replays(tiny_model, tmp_path, capsys):
    telemetry, trace = tmp_path / "t.jsonl", tmp_path / "run.trace"
    argv = [
        "generate",
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "-p",
        "Hello there",
        "--max-tokens",
        "5",
        "--seed",
        "3",
        "--ignore-eos",
        "--telemetry",
        str(telemetry),
        "--deterministic",
        "--trace",
        str(trace),
    ]
    assert main(argv) == 0
    records = read_records(telemetry)
    assert sum(len(ids) for r in records if r["kind"] == "step" for _, ids in r["out"]) == 5
    assert main(["replay", str(trace)]) == 0
    assert "5 tokens of 1 request over" in capsys.readouterr().out
