"""Single-row projections (batch-1 decode): cuBLAS against a Triton GEMV that can fuse what
precedes the projection (add + RMSNorm before qkv and gate_up, SiLU-and-multiply before down),
on the Llama-3.1-8B and Llama-3.2-1B shapes. Every figure is timed inside a CUDA graph (20 calls
per graph), as the decode step runs: timed from Python, a Triton launch costs tens of
microseconds and hides the kernel.

    python benchmarks/gemv_fused.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from graph_timing import graph_us  # benchmarks/ is on sys.path when run as a script

PLAIN, NORM, SILU = 0, 1, 2


@triton.jit
def _gemv(x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, N, eps, K: tl.constexpr,
          PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    inv = 1.0
    if PROLOGUE == 1:  # rms of x + r over the whole row; program 0 writes the new residual
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + cols) + tl.load(r_ptr + cols)
            if pid == 0:
                tl.store(res_ptr + cols, v)
            v32 = v.to(tl.float32)
            sq += v32 * v32
        inv = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        if PROLOGUE == 0:
            xv = tl.load(x_ptr + cols).to(tl.float32)
        elif PROLOGUE == 1:
            v = (tl.load(x_ptr + cols) + tl.load(r_ptr + cols)).to(tl.float32)
            xv = (tl.load(nw_ptr + cols) * (v * inv).to(DTYPE)).to(tl.float32)
        else:
            g = tl.load(x_ptr + cols).to(tl.float32)
            u = tl.load(x_ptr + K + cols)
            xv = ((g / (1.0 + tl.exp(-g))).to(DTYPE) * u).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(DTYPE), mask=row_ok)


def gemv(prologue, x, weight, r=None, norm_weight=None, config=(16, 512, 4, 3)):
    n, k = weight.shape
    block_n, block_k, warps, stages = config
    y = torch.empty(n, device=x.device, dtype=x.dtype)
    res = torch.empty(k, device=x.device, dtype=x.dtype) if prologue == NORM else y
    _gemv[(triton.cdiv(n, block_n),)](
        x, r if r is not None else x, norm_weight if norm_weight is not None else x, weight, y,
        res, n, 1e-5, K=k, PROLOGUE=prologue, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return y


def reference(prologue, x, weight, r=None, norm_weight=None):
    from noesis.kernels import ops

    if prologue == NORM:
        x, _ = ops.add_rms_norm(x[None], r[None], norm_weight, 1e-5)
        x = x[0]
    elif prologue == SILU:
        x = ops.silu_mul(x[None])[0]
    return torch.nn.functional.linear(x[None], weight)[0]


SHAPES = {  # name: (N, K, prologue); weights of 4 layers rotate so the cache never holds them
    "8b qkv": (6144, 4096, NORM), "8b o": (4096, 4096, PLAIN),
    "8b gate_up": (28672, 4096, NORM), "8b down": (4096, 14336, SILU),
    "1b qkv": (3072, 2048, NORM), "1b o": (2048, 2048, PLAIN),
    "1b gate_up": (16384, 2048, NORM), "1b down": (2048, 8192, SILU),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    configs = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (3, 4)))
    results = {}
    for name, (n, k, prologue) in SHAPES.items():
        layers = 4
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(layers)]
        width = 2 * k if prologue == SILU else k
        x = torch.randn(width, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        extra = (r, nw) if prologue == NORM else ()
        expected = reference(prologue, x, weights[0], *extra).float()

        def cublas(p=prologue, x=x, extra=extra, weights=weights):
            for w in weights:
                reference(p, x, w, *extra)

        base = graph_us(cublas) / layers
        plain_x = x[:k].contiguous()

        def gemm_only(x=plain_x, weights=weights):
            for w in weights:
                torch.nn.functional.linear(x[None], w)

        gemm = graph_us(gemm_only) / layers
        best = (float("inf"), None)
        for config in configs:
            got = gemv(prologue, x, weights[0], *extra, config=config).float()
            if (got - expected).norm() / expected.norm() > 2e-2:
                print(name, config, "wrong", float((got - expected).norm() / expected.norm()))
                continue

            def fused(c=config, p=prologue, x=x, extra=extra, weights=weights):
                for w in weights:
                    gemv(p, x, w, *extra, config=c)

            us = graph_us(fused) / layers
            if us < best[0]:
                best = (us, config)
        nbytes = n * k * 2
        results[name] = {"cublas_us": base, "cublas_gemm_only_us": gemm, "triton_us": best[0],
                         "config": best[1],
                         "cublas_TBps": nbytes / base / 1e6, "triton_TBps": nbytes / best[0] / 1e6}
        print(f"{name:<12} cuBLAS(+op) {base:7.2f} us, GEMM alone {gemm:7.2f} us "
              f"{nbytes / gemm / 1e6:5.2f} TB/s | "
              f"Triton fused {best[0]:7.2f} us {nbytes / best[0] / 1e6:5.2f} TB/s {best[1]}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
