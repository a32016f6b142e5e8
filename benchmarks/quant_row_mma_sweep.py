"""One row of int4 (AWQ layout, group 128) at the Llama-3.1-8B projection shapes on the lent GPU:
the CUDA-core GEMV with its tuned config against the tensor-core one (`_packed_gemv_mma`) over
rows per program, K tile, warps and operand order. Each variant is checked against
dequantize-then-matmul, then timed in one CUDA graph cycling through weight copies that do not
fit the L2 together; the share is of the copy bandwidth measured in the same run.

    python benchmarks/quant_row_mma_sweep.py --json row_mma.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_quant import random_packed  # noqa: E402
from gpu_moe import copy_bandwidth  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--copies-mb", type=int, default=400, help="weights cycled per replay")
    args = parser.parse_args()
    from noesis.quant import kernel
    from noesis.quant.linear import dequantized_matmul

    bandwidth = copy_bandwidth("cuda", 1 << 30)
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("| shape | variant | us | share of bandwidth | rel. error |")
    print("|---|---|---|---|---|")
    rows = []
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        one = random_packed(n, k, 4, 128, "cuda", gen, torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for t in one)
        copies = [one] + [tuple(t.clone() for t in one)
                          for _ in range(max(1, args.copies_mb * 2**20 // nbytes) - 1)]  # fmt: skip
        want = dequantized_matmul(x.float(), *(t.float() if t.is_floating_point() else t
                                               for t in one), None, 4, 128)  # fmt: skip
        tuned = kernel.gemv_config(4, n, k, 1, x.device)
        for variant, call in _variants(kernel, tuned):
            try:
                got = call(x, *one).float()
                err = float((got - want).norm() / want.norm())
                us = _time(lambda c=call: [c(x, *w) for w in copies]) / len(copies)
            except Exception as exc:
                print(f"| {name} | {variant} | failed: {type(exc).__name__}: {str(exc)[:200]} | | |")
                continue
            share = nbytes / (us / 1e6) / bandwidth
            rows.append(dict(shape=name, variant=variant, us=us, share=share, error=err))
            print(f"| {name} [{n}, {k}] | {variant} | {us:.1f} | {share:.0%} | {err:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


def _variants(kernel, tuned):
    def packed(config=None, launch=None):
        def call(x, qweight, scales, zeros):
            if launch is not None:
                return kernel._row_mma(x, qweight, scales, zeros, 128, None, launch)
            return kernel.packed_matmul(x, qweight, scales, zeros, None, 4, 128, config=config)

        return call

    yield f"cuda cores {tuned.as_list()}", packed(config=tuned)
    for trans in (True, False):
        for block_n in (32, 64, 128):
            for block_k in (512, 1024):
                for warps in (4, 8):
                    if not trans and block_n < 16 * warps:
                        continue  # the weights as the left operand: 16 rows per warp at least
                    launch = kernel.RowMma(block_n, block_k, warps, 3, trans)
                    yield f"mma {asdict(launch)}", packed(launch=launch)


def _time(step, repeats: int = 20) -> float:
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


if __name__ == "__main__":
    main()
