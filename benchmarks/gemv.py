"""Single-row GEMV on the GPU: cuBLAS (F.linear) vs the Triton kernel, in TB/s of weight read.

    python benchmarks/gemv.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = {  # (N, K): Llama-3.1-8B and Llama-3.2-1B projections and LM heads
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096),
    "8b down": (4096, 14336), "8b lm_head": (128256, 4096),
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048),
    "1b down": (2048, 8192), "1b lm_head": (128256, 2048),
}


def timed(fn, weights, x) -> float:
    for w in weights[:2]:
        fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        for w in weights:  # rotate weights so L2 holds none of them
            fn(x, w)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (10 * len(weights))


def main() -> None:
    from noesis.kernels.triton_kernels import gemv

    print(f"{'shape':<12}{'N x K':>14}{'cuBLAS TB/s':>13}{'Triton TB/s':>13}{'rel err':>10}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(2e9 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(min(copies, 8))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0]).float()
        err = ((gemv(x, weights[0]).float() - ref).norm() / ref.norm()).item()
        cublas = n * k * 2 / timed(F.linear, weights, x) / 1e12
        triton_bw = n * k * 2 / timed(gemv, weights, x) / 1e12
        print(f"{name:<12}{f'{n}x{k}':>14}{cublas:>13.2f}{triton_bw:>13.2f}{err:>10.1e}")


if __name__ == "__main__":
    main()
