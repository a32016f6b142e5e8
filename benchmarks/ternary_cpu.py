"""CPU benchmark: packed ternary projection (noesis.ternary) vs torch float32 dense, per shape.

    python benchmarks/ternary_cpu.py [--threads 1 2] [--batch 1 4] [--repeats 7] [--json PATH]

For each projection shape (out_features x in_features: those of noesis-tiny and -draft, then
2048x2048, 2048x8192 and 8192x2048) and each torch thread count, times `y = x @ W^T` at the given
batch sizes: torch.nn.functional.linear on float32 W, and the engine's TernaryLinear forward (int8
activation quantization, kernel call and Python overhead included). Each figure is the median over
--repeats rounds of a timed loop, the two contenders interleaved round by round; "best" compares
the fastest rounds (on a shared machine, the rounds least disturbed by other processes). Weight
memory is the bytes each layer holds (packed codes + float32 row scales for ternary). Prints a
table, writes JSON, and checks every ternary output against the unpacked float reference.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from noesis.ternary import kernel
from noesis.ternary.linear import TernaryLinear
from noesis.ternary.quant import absmean_ternary, pack, reference_linear

ROOT = Path(__file__).resolve().parents[1]
# (name, out_features, in_features)
SHAPES = [
    ("tiny qkv_proj", 640, 384),
    ("tiny o_proj", 384, 384),
    ("tiny gate_up_proj", 2048, 384),
    ("tiny down_proj", 384, 1024),
    ("draft qkv_proj", 320, 192),
    ("draft o_proj", 192, 192),
    ("draft gate_up_proj", 1024, 192),
    ("draft down_proj", 192, 512),
    ("2048x2048", 2048, 2048),
    ("2048x8192", 2048, 8192),
    ("8192x2048", 8192, 2048),
]
TARGET_SECONDS = 0.05  # length of one timed loop


def layers(out_features: int, in_features: int) -> tuple[torch.Tensor, TernaryLinear]:
    weight = torch.randn(out_features, in_features) * 0.02
    ternary, scale = absmean_ternary(weight)
    layer = TernaryLinear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight_packed.copy_(pack(ternary.to(torch.int8)))
        layer.weight_scale.copy_(scale.expand(out_features))
    layer.check_loaded("bench")
    return weight, layer


def loop_seconds(fn, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def time_pair(dense, ternary, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per call of each, one figure per round, the rounds alternating."""
    for fn in (dense, ternary):
        fn()
    iterations = [
        max(3, int(TARGET_SECONDS / max(loop_seconds(fn, 3), 1e-7))) for fn in (dense, ternary)
    ]
    rounds = [[], []]
    for _ in range(repeats):
        for index, fn in enumerate((dense, ternary)):
            rounds[index].append(loop_seconds(fn, iterations[index]))
    return rounds[0], rounds[1]


def measure(name: str, out_features: int, in_features: int, batch: int, repeats: int) -> dict:
    weight, layer = layers(out_features, in_features)
    x = torch.randn(batch, in_features)
    with torch.no_grad():
        error = layer(x) - reference_linear(x, layer.weight_packed, layer.weight_scale, in_features)
        dense_s, ternary_s = time_pair(lambda: F.linear(x, weight), lambda: layer(x), repeats)
    dense_median, ternary_median = statistics.median(dense_s), statistics.median(ternary_s)
    dense_bytes = weight.numel() * weight.element_size()
    ternary_bytes = layer.weight_packed.numel() + layer.weight_scale.numel() * 4
    return {
        "shape": name, "out_features": out_features, "in_features": in_features, "batch": batch,
        "threads": torch.get_num_threads(), "dense_us": dense_median * 1e6,
        "ternary_us": ternary_median * 1e6, "speedup": dense_median / ternary_median,
        "dense_best_us": min(dense_s) * 1e6, "ternary_best_us": min(ternary_s) * 1e6,
        "best_speedup": min(dense_s) / min(ternary_s),
        "dense_bytes": dense_bytes, "ternary_bytes": ternary_bytes,
        "memory_ratio": dense_bytes / ternary_bytes, "max_abs_error": float(error.abs().max()),
    }  # fmt: skip


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(0)
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            for name, out_features, in_features in SHAPES:
                row = measure(name, out_features, in_features, batch, args.repeats)
                results.append(row)
                print_row(row, header=len(results) == 1)
    meta = {
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu": _cpu_name(), "kernel_isa": kernel.kernel_isa(), "repeats": args.repeats,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"\nkernel path {meta['kernel_isa']}; JSON written to {args.json}")


COLUMNS = [  # (header, width, row -> text)
    ("shape (out x in)", 30, lambda r: f"{r['shape']} ({r['out_features']}x{r['in_features']})"),
    ("thr", 4, lambda r: str(r["threads"])),
    ("batch", 6, lambda r: str(r["batch"])),
    ("dense us", 10, lambda r: f"{r['dense_us']:.1f}"),
    ("ternary us", 11, lambda r: f"{r['ternary_us']:.1f}"),
    ("speedup", 9, lambda r: f"{r['speedup']:.2f}x"),
    ("best", 8, lambda r: f"{r['best_speedup']:.2f}x"),
    ("dense KiB", 11, lambda r: f"{r['dense_bytes'] / 1024:.0f}"),
    ("tern KiB", 10, lambda r: f"{r['ternary_bytes'] / 1024:.1f}"),
    ("mem x", 7, lambda r: f"{r['memory_ratio']:.1f}"),
    ("max err", 9, lambda r: f"{r['max_abs_error']:.1e}"),
]


def print_row(row: dict, header: bool) -> None:
    if header:
        print(COLUMNS[0][0].ljust(COLUMNS[0][1]) + "".join(h.rjust(w) for h, w, _ in COLUMNS[1:]))
    first, *rest = COLUMNS
    cells = [first[2](row).ljust(first[1])] + [text(row).rjust(w) for _, w, text in rest]
    print("".join(cells), flush=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "ternary_cpu.json")
    return parser


if __name__ == "__main__":
    main()
