"""Decode graph replay time per captured batch bucket under two settings, in one process: the
graphs are captured under each setting in turn (twice, alternating, to show the noise) and
replayed with events.

    python benchmarks/graph_ab.py --model /tmp/noesis-bench/llama-8b --what blas
    python benchmarks/graph_ab.py --model /tmp/noesis-bench/llama-1b --what gemv --max-batch 8
    python benchmarks/graph_ab.py --model M --what fusion --max-batch 8 --tuned fusion.json

`blas`: cuBLAS against cuBLASLt as torch's BLAS library. `gemv`: the one-row Triton GEMV for
the output projection (`ops.ONE_ROW_GEMV`) on and off. `fusion`: the fused one-row decoder block
(`ops.ONE_ROW_FUSION`, DecoderLayer.forward_one_row) on and off; only bucket 1 uses it. `pdl`:
programmatic dependent launch (`pdl.PDL`) on and off, with the fused block on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def replay_ms(graph, reps: int = 10) -> float:
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def settings(what: str) -> dict:
    from noesis.kernels import ops

    if what == "blas":
        return {name: lambda name=name: torch.backends.cuda.preferred_blas_library(name)
                for name in ("cublas", "cublaslt")}
    module, flag = ops, {"gemv": "ONE_ROW_GEMV", "fusion": "ONE_ROW_FUSION"}.get(what)
    if what == "pdl":  # on the fused batch-1 path, whose kernels take it
        from noesis.kernels import pdl

        ops.ONE_ROW_FUSION = True
        module, flag = pdl, "PDL"
    return {f"{what} {state}": lambda on=on: setattr(module, flag, on)
            for state, on in (("on", True), ("off", False))}


def load_tuned(paths: str) -> None:
    """Every shape's best one-row kernel configs from gemv_fused.py, keyed by weight shape."""
    from gemv_fused import best_configs

    from noesis.kernels import row_gemv

    report = {}
    for path in paths.split(","):
        if not os.path.exists(path):
            print(f"{path}: no such file, its shape keeps the default configs", flush=True)
            continue
        with open(path) as f:
            report |= json.load(f)
    for key, config in best_configs(report).items():
        row_gemv.ROW_GEMV_TUNED[tuple(map(int, key.split(",")))] = tuple(config)
    print("tuned one-row configs:", row_gemv.ROW_GEMV_TUNED, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--what", choices=["blas", "gemv", "fusion", "pdl"], default="blas")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--tuned", help="gemv_fused.py's JSON files (comma list): the best "
                        "one-row configs they found")
    args = parser.parse_args()
    if args.tuned:
        load_tuned(args.tuned)
    from noesis.engine.engine import Engine, EngineConfig

    engine = Engine(args.model, EngineConfig(device="cuda", max_num_seqs=args.max_batch,
                                             max_model_len=4096, cuda_graphs=False,
                                             progress=False))
    variants = settings(args.what)
    rows: dict[str, list[dict[int, float]]] = {name: [] for name in variants}
    for name in list(variants) * 2:
        variants[name]()
        engine.runner.capture_graphs(args.max_batch)
        graphs = engine.runner.graphs
        rows[name].append({b: replay_ms(g) for b, g in sorted(graphs.graphs.items())})
        engine.runner.graphs = None
        torch.cuda.empty_cache()
    buckets = sorted(next(iter(rows.values()))[0])
    print("bucket    " + " ".join(f"{b:>6}" for b in buckets))
    for name, runs in rows.items():
        for run in runs:
            print(f"{name:<10}" + " ".join(f"{run[b]:6.3f}" for b in buckets), flush=True)


if __name__ == "__main__":
    main()
