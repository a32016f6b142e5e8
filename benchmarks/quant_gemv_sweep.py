"""Sweep the packed int4 / int8 decode kernel's launch configs (noesis.quant.kernel._packed_gemv)
on the 8B Llama projection shapes, beside torch's bf16 matmul, and write the best per shape in
the form the kernel reads (gemv_configs.json, per GPU name and "bits,N,K,rows").

    python benchmarks/quant_gemv_sweep.py --json $OUT/sweep.json \
        --save-configs src/noesis/quant/gemv_configs.json
    python benchmarks/quant_gemv_sweep.py --smoke --json /tmp/sweep.json    # CPU, interpreter

int4: AWQ-style group 128 with zero points; int8: one scale and zero per output row. Rows 1, 16
and 64 (the config of every batch of 17-128 rows), bf16 activations. Every config is checked
against a float32 reference (fresh random codes,
zeros, scales, inputs; output allocated full of NaN) before it is timed; a wrong or failing one
is reported and skipped. Times: median of graph replays, each replay calling the kernel on
several copies of the weights in turn so that they are read from HBM, not L2; bandwidth share
from the packed bytes (codes + scales + zeros) over the copy bandwidth measured in the same run.
The grid is visited config by config across all shapes and row counts (the first config of
every row count, then the second, ...), and stops at --budget seconds (the sweep must fit in two
minutes), so a cut-off run keeps each shape's first configs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the kernel on a CPU runs under Triton's interpreter: set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from noesis.quant import kernel  # noqa: E402
from noesis.quant.kernel import GemvConfig  # noqa: E402
from noesis.quant.linear import dequantize, group_index  # noqa: E402
from noesis.quant.packing import pack  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"tiny": (48, 256), "odd": (40, 384)}
BITS = {4: 128, 8: -1}  # bits -> group size (-1: per output row)
ROWS = (1, 16, 64)
L2_FLUSH_BYTES = 256 << 20  # weight copies per timed replay: more than this many bytes
# Likeliest first: a run cut off by --budget keeps these. (block_n, words per row per tile,
# split (0: auto), warps, stages, dot); block_k = words * codes per word. One row: the
# CUDA-core kernel, then tl.dot with W as the MMA's left operand; 16 and 64 rows: tl.dot (64:
# 64-row tiles of x; 16 words of int4 are one AWQ group, scaled after the dot).
GRID = {
    1: [(16, 64, 0, 2, 3, False), (16, 64, 0, 1, 3, False), (32, 32, 0, 2, 3, False),
        (16, 32, 0, 1, 3, False), (32, 64, 0, 2, 3, False), (8, 64, 0, 1, 3, False),
        (16, 64, 0, 2, 1, False), (8, 64, 0, 4, 3, False), (16, 32, 0, 4, 3, False),
        (32, 32, 0, 4, 3, False), (64, 32, 0, 4, 3, False), (32, 16, 0, 4, 3, True)],
    16: [(32, 16, 0, 4, 3, True), (64, 16, 0, 4, 3, True), (16, 32, 0, 4, 3, True),
         (64, 32, 0, 8, 3, True)],
    64: [(64, 16, 0, 4, 3, True), (128, 16, 0, 8, 3, True), (64, 16, 0, 4, 4, True),
         (128, 16, 0, 4, 3, True), (64, 32, 0, 4, 3, True), (128, 16, 0, 8, 4, True),
         (64, 16, 0, 8, 3, True), (128, 32, 0, 8, 3, True)],
}
SMOKE_GRID = {1: [(8, 16, 0, 4, 1, False), (16, 8, 2, 4, 1, True)],
              16: [(16, 8, 0, 4, 1, True), (32, 16, 2, 4, 2, True)],
              64: [(32, 8, 0, 4, 2, True), (16, 16, 2, 4, 1, True)]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes, 2 configs: checks the script, measures nothing")
    parser.add_argument("--json", type=Path, default=Path(".bench/quant_gemv_sweep.json"))
    parser.add_argument("--save-configs", type=Path,
                        help="merge the best configs into this gemv_configs.json")
    parser.add_argument("--budget", type=float, default=100.0,
                        help="seconds after which no further config is tried")
    return parser.parse_args()


def config_for(entry: tuple, bits: int) -> GemvConfig:
    """A grid entry as a launch config: block_k counted in words, times the codes per word."""
    block_n, words, split, warps, stages, dot = entry
    return GemvConfig(block_n, words * (32 // bits), split, warps, stages, dot)


def make_case(n: int, k: int, bits: int, rows: int, device: str, dtype: torch.dtype) -> dict:
    """Random packed weights (copies enough to spill L2), inputs, and the float32 reference."""
    group = k if BITS[bits] == -1 else BITS[bits]
    packed = n * k * bits // 8 + 2 * n * (k // group) * torch.finfo(dtype).bits // 8
    copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // packed))
    weights = []
    for _ in range(copies):
        codes = torch.randint(0, 1 << bits, (n, k), device=device)
        weights.append((
            pack(codes, bits),
            (torch.rand(n, k // group, device=device) * 0.02 + 0.001).to(dtype),
            torch.randint(0, 1 << bits, (n, k // group), device=device).to(dtype),
        ))
    x = torch.randn(rows, k, device=device).to(dtype)
    qweight, scales, zeros = weights[0]
    weight = dequantize(qweight, scales, zeros, group_index(None, k, group, x.device), bits)
    reference = x.float() @ weight.float().t()  # [M, N]
    return {"weights": weights, "x": x, "group": group, "bytes": packed, "ref": reference}


def check(case: dict, bits: int, config: GemvConfig | None) -> float:
    """Relative error of one launch against the reference; the output is poisoned with NaN
    first through torch.empty, so an unwritten element fails."""
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    try:
        qweight, scales, zeros = case["weights"][0]
        got = kernel.packed_matmul(case["x"], qweight, scales, zeros, None, bits, case["group"],
                                   config=config).float()
    finally:
        torch.empty = empty
    error = float((got - case["ref"]).norm() / case["ref"].norm())
    return error if error == error else float("inf")  # NaN: unwritten output


def time_us(calls, device: str, replays: int = 15) -> float:
    """Median microseconds per call: graphs of every call in `calls`, replayed."""
    for call in calls:
        call()
    if device == "cpu":
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6
    repeats = max(1, 64 // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for call in calls:
                call()
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (repeats * len(calls)))
    return statistics.median(samples)


def time_kernel(case: dict, bits: int, config: GemvConfig | None, device: str) -> float:
    x, group = case["x"], case["group"]
    return time_us([lambda w=w: kernel.packed_matmul(x, *w, None, bits, group, config=config)
                    for w in case["weights"]], device)


def time_bf16(n: int, k: int, rows: int, device: str, dtype: torch.dtype) -> float:
    copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device=device).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device=device).to(dtype)
    us = time_us([lambda w=w: x @ w.t() for w in weights], device)
    del weights
    return us


def main() -> None:
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is off
    shapes, grid = (SMOKE_SHAPES, SMOKE_GRID) if args.smoke else (SHAPES, GRID)
    from noesis.telemetry.bench import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device(device))
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{gpu}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    started = time.perf_counter()
    cases, results = {}, {}
    for (name, (n, k)), bits, rows in _cases(shapes):
        key = kernel.config_key(bits, n, k, rows)
        cases[key] = make_case(n, k, bits, rows, device, dtype)
        default = kernel.default_gemv_config(bits, rows)
        results[key] = {"shape": name, "bits": bits, "rows": rows, "N": n, "K": k,
                        "packed_bytes": cases[key]["bytes"],
                        "bf16_us": time_bf16(n, k, rows, device, dtype),
                        "default": _measure(cases[key], bits, default, device, tolerance),
                        "configs": []}
    cut_off = False
    for rows, entry in _grid_order(grid):
        for key, result in results.items():
            if result["rows"] != rows:
                continue
            if time.perf_counter() - started > args.budget:
                cut_off = True
                break
            config = config_for(entry, result["bits"])
            measured = _measure(cases[key], result["bits"], config, device, tolerance)
            result["configs"].append({"config": config.as_list(), **measured})
    report = _report(results, gpu, bandwidth, cut_off, time.perf_counter() - started)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    if args.save_configs:
        _save_configs(args.save_configs, gpu, report["best"])
    _print_table(report)


def _grid_order(grid):
    """(rows, entry): every row count's first entry, then every second one, and so on."""
    for i in range(max(len(entries) for entries in grid.values())):
        for rows in ROWS:
            if i < len(grid[rows]):
                yield rows, grid[rows][i]


def _cases(shapes):
    for bits in BITS:
        for rows in ROWS:
            for shape in shapes.items():
                yield shape, bits, rows


def _measure(case, bits, config, device, tolerance) -> dict:
    """The config's error and time; an error above tolerance, or a failure, skips timing."""
    try:
        error = check(case, bits, config)
        if error > tolerance:
            return {"error": error, "us": None, "why": "wrong result"}
        return {"error": error, "us": time_kernel(case, bits, config, device)}
    except Exception as exc:  # a config the compiler rejects (registers, shared memory)
        return {"error": None, "us": None, "why": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _report(results, gpu, bandwidth, cut_off, seconds) -> dict:
    best = {}
    for key, result in results.items():
        default = {"config": kernel.default_gemv_config(result["bits"], result["rows"]).as_list(),
                   **result["default"]}
        timed = [c for c in [default, *result["configs"]] if c["us"] is not None]
        if timed:
            winner = min(timed, key=lambda c: c["us"])
            result["best"] = winner
            best[key] = winner["config"]
        for entry in [result["default"], *result["configs"]]:
            if entry["us"]:
                entry["bandwidth_share"] = result["packed_bytes"] / (entry["us"] * 1e-6) / bandwidth
    return {"device": gpu, "copy_bandwidth_TBps": bandwidth / 1e12, "cut_off": cut_off,
            "seconds": seconds, "results": results, "best": best}


def _save_configs(path: Path, gpu: str, best: dict) -> None:
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(gpu, {}).update(best)
    path.parent.mkdir(parents=True, exist_ok=True)
    gpus = [f' {json.dumps(name)}: {{\n' + ",\n".join(
        f"  {json.dumps(key)}: {json.dumps(table[name][key])}" for key in sorted(table[name])
    ) + "\n }" for name in sorted(table)]
    path.write_text("{\n" + ",\n".join(gpus) + "\n}\n")


def _print_table(report: dict) -> None:
    print(f"\n{report['device']} copy {report['copy_bandwidth_TBps']:.2f} TB/s, "
          f"{report['seconds']:.0f} s{', CUT OFF by --budget' if report['cut_off'] else ''}")
    print(f"{'key':22} {'shape':8} {'bf16 us':>8} {'default us':>10} {'best us':>8} "
          f"{'BW%':>5} {'x bf16':>6}  best config [BN, BK, split, warps, stages, dot]")
    for key, r in report["results"].items():
        best = r.get("best") or {}
        us = best.get("us")
        print(f"{key:22} {r['shape']:8} {r['bf16_us']:8.1f} {_num(r['default']['us']):>10} "
              f"{_num(us):>8} {100 * best.get('bandwidth_share', 0):5.0f} "
              f"{r['bf16_us'] / us if us else 0:6.2f}  {best.get('config')}")
    failures = [(key, c) for key, r in report["results"].items() for c in r["configs"]
                if c["us"] is None]
    for key, c in failures[:12]:
        print(f"failed {key} {c['config']}: {c.get('why')} (error {c['error']})")


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
