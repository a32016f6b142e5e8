"""Tensor-parallel decode benchmark (issue 21): TP 1 vs TP 2 on a random bf16 Llama-3.1-8B-shaped
checkpoint, at batch 1 and 64, on a machine with 2 GPUs.

    python benchmarks/tp_decode.py --json tp_decode.json [--shape llama-8b] [--batches 1,64]

Per configuration (TP 1 with CUDA graphs, TP 1 eager, TP 2, which runs eagerly: graphs do not
capture the collectives yet): steady decode tok/s over 128 steps once every sequence decodes
(128-token prompts, greedy); NCCL kernel time per step on rank 0 (torch.profiler over 16 steps:
the all-reduces after o_proj and down_proj, the embedding's, and the logit gather); and the
share of the roofline, weights (plus KV) read once per step at the copy bandwidth measured here,
times the GPUs the weights are split over. The target: TP 2 >= 1.6x TP 1 at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_random_checkpoint import make_checkpoint  # noqa: E402

PROMPT_LEN, STEPS, PROFILED_STEPS = 128, 128, 16
CONFIGS = {"tp1-graphs": (1, True), "tp1-eager": (1, False), "tp2": (2, False)}


def decode_steps(engine, batch: int, steps: int, profile: bool = False) -> tuple[float, float]:
    """(seconds of `steps` decode steps at `batch`, NCCL milliseconds per step when profiled)."""
    from noesis import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    prompts = [[(97 * row + 7 * i + 1) % 32000 for i in range(PROMPT_LEN)] for row in range(batch)]
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in running):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    nccl_ms = 0.0
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        nccl_us = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
        nccl_ms = nccl_us / 1e3 / steps
        seconds = float("nan")
    else:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds, nccl_ms


def bench(path: Path, tp: int, graphs: bool, batches: list[int], bandwidth: float) -> dict:
    from noesis import LLM

    llm = LLM(str(path), device="cuda", dtype="bfloat16", progress=False, cuda_graphs=graphs,
              tensor_parallel_size=tp, max_num_seqs=max(batches), max_model_len=1024)
    engine = llm.engine
    shard_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    result = {"load_s": engine.timings["load_s"], "weight_bytes_per_gpu": shard_bytes}
    for batch in batches:
        seconds, _ = decode_steps(engine, batch, STEPS)
        _, nccl_ms = decode_steps(engine, batch, PROFILED_STEPS, profile=tp > 1)
        tok_s = batch * STEPS / seconds
        kv_bytes = (engine.kv.nbytes / engine.kv.num_pages / engine.kv.page_size
                    * batch * (PROMPT_LEN + STEPS / 2))  # per GPU, read once per step
        roofline = batch * bandwidth / (shard_bytes + kv_bytes)  # each GPU reads its share
        result[f"batch_{batch}"] = {"tok_s": tok_s, "step_ms": seconds / STEPS * 1e3,
                                    "nccl_ms_per_step": nccl_ms, "roofline_tok_s": roofline,
                                    "share_of_roofline": tok_s / roofline}
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs; PyTorch sees {torch.cuda.device_count()}")
    from noesis.telemetry.bench import copy_bandwidth

    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = statistics.median(copy_bandwidth(torch.device("cuda", i)) for i in range(2))
    path = make_checkpoint(args.workdir / args.shape, args.shape, "bfloat16", 8192, 0, False,
                           "cuda")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "shape": args.shape,
              "copy_bandwidth_bytes_s": bandwidth, "date": time.strftime("%Y-%m-%d"),
              "command": "python " + " ".join(sys.argv), "configs": {}}
    for name in args.configs.split(","):
        tp, graphs = CONFIGS[name]
        report["configs"][name] = bench(path, tp, graphs, batches, bandwidth)
        print(name, json.dumps(report["configs"][name]), flush=True)
    print_table(report, batches)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def print_table(report: dict, batches: list[int]) -> None:
    configs = report["configs"]
    copy = report["copy_bandwidth_bytes_s"] / 1e12
    print(f"\n{report['device']}, {report['shape']} bf16, copy {copy:.2f} TB/s")
    print(f"{'config':<12}{'batch':>6}{'tok/s':>10}{'step ms':>9}{'nccl ms':>9}"
          f"{'roofline':>10}{'share':>7}")
    for name, result in configs.items():
        for batch in batches:
            row = result[f"batch_{batch}"]
            print(f"{name:<12}{batch:>6}{row['tok_s']:>10.1f}{row['step_ms']:>9.2f}"
                  f"{row['nccl_ms_per_step']:>9.2f}{row['roofline_tok_s']:>10.1f}"
                  f"{row['share_of_roofline']:>7.0%}")
    if "tp2" in configs:
        for base in ("tp1-graphs", "tp1-eager"):
            if base in configs:
                for batch in batches:
                    ratio = (configs["tp2"][f"batch_{batch}"]["tok_s"]
                             / configs[base][f"batch_{batch}"]["tok_s"])
                    print(f"tp2 / {base} at batch {batch}: {ratio:.2f}x (target at batch 1: 1.6x)")


if __name__ == "__main__":
    main()
