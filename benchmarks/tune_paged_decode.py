"""Launch parameters of the paged decode attention kernel, timed on shapes the engine meets
(Llama-3.1-8B heads: 32 query / 8 KV heads of 128, 16-token pages): partition (context tokens per
split), BLOCK_N, pipeline stages, and whether the splits merge in the same launch. Prints
microseconds and effective KV bandwidth.

    python benchmarks/tune_paged_decode.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from graph_timing import graph_us  # benchmarks/ is on sys.path when run as a script

from noesis.kernels import paged_decode

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
CASES = [(1, 128), (1, 384), (1, 1024), (1, 2048), (1, 4000), (8, 1024), (64, 700),
         (128, 600)]  # (batch, context)
MAX_CTX = 8192


def setup(batch: int, ctx: int):
    pages_per = -(-ctx // PAGE)
    num_pages = batch * pages_per + 1
    kv = torch.randn(2, num_pages, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_pages - 1, device="cuda") + 1
    tables = torch.zeros(batch, -(-MAX_CTX // PAGE), dtype=torch.int64, device="cuda")
    tables[:, :pages_per] = order[: batch * pages_per].view(batch, pages_per)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
    return q, kv, tables, lens


def tune_case(batch: int, ctx: int, grid) -> dict:
    q, kv, tables, lens = setup(batch, ctx)
    kv_bytes = batch * ctx * KV_HEADS * DIM * 2 * 2

    def run(tuning=None):
        return paged_decode.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.088,
                                                     MAX_CTX, tuning=tuning)

    reference = run()
    default = graph_us(run)
    two_launches = graph_us(lambda: run({"fused_reduce": False}))
    one_launch = graph_us(lambda: run({"fused_reduce": True}))
    best = (default, None)
    for partition, block_n, warps, stages, fused in grid:
        if block_n and partition and block_n > partition:
            continue
        tuning = {"partition": partition, "block_n": block_n, "num_warps": warps,
                  "num_stages": stages, "fused_reduce": fused}
        try:
            if (run(tuning).float() - reference.float()).abs().max().item() > 2e-2:
                continue
            us = graph_us(lambda t=tuning: run(t))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print("skip", tuning, type(exc).__name__)
            continue
        if us < best[0]:
            best = (us, tuning)
    return {"batch": batch, "ctx": ctx, "default_us": default,
            "default_two_launches_us": two_launches, "default_one_launch_us": one_launch,
            "best_us": best[0],
            "best": best[1], "default_TBps": kv_bytes / default / 1e6,
            "best_TBps": kv_bytes / best[0] / 1e6}


def main() -> None:
    global HEADS, KV_HEADS, DIM, MAX_CTX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--heads", help="query,kv,dim heads (default 32,8,128: Llama-3.1-8B)")
    parser.add_argument("--cases", help="batch:context,... (default: the list above)")
    parser.add_argument("--max-ctx", type=int, help=f"max_model_len (default {MAX_CTX})")
    parser.add_argument("--defaults-only", action="store_true",
                        help="time the default launch and the two merges only, no grid")
    args = parser.parse_args()
    if args.heads:
        HEADS, KV_HEADS, DIM = (int(v) for v in args.heads.split(","))
    MAX_CTX = args.max_ctx or MAX_CTX
    cases = CASES
    if args.cases:
        cases = [tuple(int(v) for v in case.split(":")) for case in args.cases.split(",")]
    grid = list(itertools.product((64, 128, 256, 512), (32, 64), (1, 2, 4), (2, 3), (True, False)))
    if args.defaults_only:
        grid = [(None, None, 4, None, True)]
    results = []
    for batch, ctx in cases:
        row = tune_case(batch, ctx, grid)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
