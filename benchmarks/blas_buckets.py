"""Graph replay time per captured batch bucket with cuBLAS against cuBLASLt as torch's BLAS
library, in one process: the decode graphs are captured under each library in turn (twice,
alternating, to show the noise) and replayed with events.

    python benchmarks/blas_buckets.py --model /tmp/noesis-bench/llama-8b
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    from noesis.engine.engine import Engine, EngineConfig

    engine = Engine(args.model, EngineConfig(device="cuda", max_num_seqs=128, max_model_len=4096,
                                             cuda_graphs=False, progress=False))
    rows: dict[str, list[dict[int, float]]] = {"cublas": [], "cublaslt": []}
    for library in ["cublas", "cublaslt"] * 2:
        torch.backends.cuda.preferred_blas_library(library)
        engine.runner.capture_graphs(128)
        graphs = engine.runner.graphs
        rows[library].append({b: replay_ms(g) for b, g in sorted(graphs.graphs.items())})
        engine.runner.graphs = None
        torch.cuda.empty_cache()
    buckets = sorted(rows["cublas"][0])
    print("bucket " + " ".join(f"{b:>6}" for b in buckets))
    for library, runs in rows.items():
        for run in runs:
            print(f"{library:<9}" + " ".join(f"{run[b]:6.3f}" for b in buckets), flush=True)


if __name__ == "__main__":
    main()
