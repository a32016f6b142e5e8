"""Sweep the batch-invariant matmul's tiles (noesis.kernels.batch_invariant.linear) on the 8B
Llama shapes and write the best per shape where matmul_config reads it
(batch_invariant_configs.json, per GPU name and "N,K").

    python benchmarks/batch_invariant_sweep.py --json $OUT/bi_sweep.json \
        --save-configs src/noesis/kernels/batch_invariant_configs.json
    python benchmarks/batch_invariant_sweep.py --smoke --json /tmp/bi_sweep.json   # CPU

A tiling is one per weight, whatever the batch: it is timed at 1, 16 and 64 rows against what
the default mode runs there (the one-row GEMV kernel at 1 row, torch's matmul, cuBLAS, at 16
and 64), and scored by the mean of those three ratios. Every candidate is checked first: row 0
alone must equal row 0 in batches of 16 and 64 bitwise, and the result must be a matmul
(relative error under 1e-2 against float32); a failing one is reported and skipped. Times are
medians of graph replays over enough weight copies to read them from HBM, not L2. The sweep
stops trying candidates at --budget seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_gemv_sweep import L2_FLUSH_BYTES, _save_configs, time_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (96, 128), "down": (64, 256)}
ROWS = (1, 16, 64)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--json", type=Path, default=Path(".bench/batch_invariant_sweep.json"))
    parser.add_argument("--save-configs", type=Path,
                        help="merge the best tiling per shape into this JSON table")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds after which no further candidate is tried")
    return parser.parse_args()


def candidates(kernels, cols: int, depth: int, device: torch.device) -> list:
    """The heuristic's tiling first, then column tiles of 32-128 and K steps of 64-128, each
    unsplit and, where the column tiles alone leave SMs idle, split to fill them."""
    found = [kernels.heuristic_config(cols, depth, device)]
    for block_n in (32, 64, 128):
        for block_k in (64, 128):
            chunks, tiles = -(-depth // block_k), -(-cols // block_n)
            programs = kernels._num_programs(device)
            splits = 1
            while tiles * splits < 0.9 * programs and chunks % (2 * splits) == 0:
                splits *= 2
            for split in sorted({1, splits}):
                stages = 3 if block_n * block_k >= 128 * 128 else 4
                found.append(kernels.MatmulConfig(block_n, split, 4, stages, block_k))
    return list(dict.fromkeys(found))


def measure(kernels, config, weights, xs, reference, device) -> dict:
    """Check a tiling (bitwise row-0 identity across batches, error), then time it per rows."""
    try:
        alone = kernels.linear(xs[1], weights[0], config=config)
        # Under the interpreter tl.dot is numpy's matmul, which rounds a row by its place in
        # the tile (tests/unit/test_batch_invariant.py): bitwise only on a GPU.
        same = torch.equal if device == "cuda" else lambda a, b: torch.allclose(a, b, atol=1e-5)
        for rows in (16, 64):
            if not same(kernels.linear(xs[rows], weights[0], config=config)[:1], alone):
                return {"why": f"row 0 differs in a batch of {rows}"}
        error = float((alone.float() - reference).norm() / reference.norm())
        if not error < 1e-2:
            return {"why": f"error {error:.2e}"}
        us = {rows: time_us([lambda w=w, x=xs[rows]: kernels.linear(x, w, config=config)
                             for w in weights], device) for rows in ROWS}
        return {"error": error, "us": us}
    except Exception as exc:  # shared memory or registers over the limit
        return {"why": f"{type(exc).__name__}: {str(exc)[:160]}"}


def default_us(weights, xs, device) -> dict:
    """What the default mode runs: the one-row GEMV at 1 row, torch's matmul otherwise."""
    from noesis.kernels import row_gemv

    one_row = (lambda w, x: row_gemv.gemv(x, w)) if device == "cuda" else (lambda w, x: x @ w.t())
    us = {1: time_us([lambda w=w: one_row(w, xs[1]) for w in weights], device)}
    for rows in ROWS[1:]:
        us[rows] = time_us([lambda w=w, x=xs[rows]: x @ w.t() for w in weights], device)
    return us


def sweep_shape(kernels, name, cols, depth, device, dtype, deadline) -> dict:
    copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // (cols * depth * 2)))
    weights = [(torch.randn(cols, depth, device=device) / depth**0.5).to(dtype)
               for _ in range(copies)]
    x = torch.randn(max(ROWS), depth, device=device).to(dtype)
    xs = {rows: x[:rows] for rows in ROWS}  # row 0 the same in every batch
    reference = xs[1].float() @ weights[0].float().t()
    result = {"N": cols, "K": depth, "default_us": default_us(weights, xs, device),
              "configs": []}
    for config in candidates(kernels, cols, depth, torch.device(device)):
        if time.perf_counter() > deadline:
            result["cut_off"] = True
            break
        measured = measure(kernels, config, weights, xs, reference, device)
        if "us" in measured:
            measured["score"] = sum(measured["us"][r] / result["default_us"][r]
                                    for r in ROWS) / len(ROWS)
        result["configs"].append({"config": config.as_list(), **measured})
    timed = [c for c in result["configs"] if "score" in c]
    if timed:
        result["best"] = min(timed, key=lambda c: c["score"])
    print_shape(name, result)
    return result


def print_shape(name: str, result: dict) -> None:
    base = result["default_us"]
    print(f"{name} [{result['N']}, {result['K']}] default us "
          + " ".join(f"{rows}:{base[rows]:.1f}" for rows in ROWS), flush=True)
    for entry in result["configs"]:
        if "us" in entry:
            times = " ".join(f"{rows}:{entry['us'][rows]:.1f}" for rows in ROWS)
            print(f"  {entry['config']}  {times}  score {entry['score']:.3f}", flush=True)
        else:
            print(f"  {entry['config']}  skipped: {entry['why']}", flush=True)


def main() -> None:
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from noesis.kernels import batch_invariant as kernels

    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is off
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    deadline = time.perf_counter() + args.budget
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    results = {name: sweep_shape(kernels, name, *shape, device, dtype, deadline)
               for name, shape in shapes.items()}
    best = {f"{r['N']},{r['K']}": r["best"]["config"] for r in results.values() if "best" in r}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": gpu, "results": results, "best": best},
                                    indent=1, default=str))
    if args.save_configs:
        _save_configs(args.save_configs, gpu, best)
    print(f"\n{gpu}: best tiling [block_n, splits, warps, stages, block_k] and its mean ratio "
          "to the default mode's kernels at 1/16/64 rows")
    for name, r in results.items():
        if "best" in r:
            print(f"  {name:8} {r['best']['config']}  score {r['best']['score']:.3f}")


if __name__ == "__main__":
    main()
