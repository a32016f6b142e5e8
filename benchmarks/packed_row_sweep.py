"""Sweep the packed one-row block's launch configs (noesis.quant.packed_row: norm_qkv_rope_store,
norm_glu, gemv with the residual) on the 8B Llama shapes in AWQ int4 g128, beside the unfused
steps they replace, and write the best per kernel where packed_row_config reads it
(packed_row_configs.json, per GPU name and "mode,bits,N,K").

    python benchmarks/packed_row_sweep.py --json $OUT/packed_row.json \
        --save-configs src/noesis/quant/packed_row_configs.json
    python benchmarks/packed_row_sweep.py --smoke --json /tmp/packed_row.json   # CPU

Unfused is what the engine runs without the block: the packed GEMV (its tuned config) plus the
separate add+RMSNorm, RoPE+KV store, SiLU-mul and residual kernels. Every candidate is checked
first against the unfused result (relative error under 1e-2, output poisoned with NaN), then
timed; times are medians of graph replays over enough weight copies to be read from HBM. The
sweep stops trying candidates at --budget seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_gemv_sweep import L2_FLUSH_BYTES, _save_configs, time_us  # noqa: E402

SHAPES = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}
SMOKE_SHAPES = {"hidden": 256, "inter": 256, "heads": 4, "kv_heads": 2, "head_dim": 64}
GRID = [(rows, block_k, warps, 3) for rows in (8, 16, 32) for block_k in (256, 512)
        for warps in (1, 4)]
SMOKE_GRID = [(16, 256, 1, 3), (8, 256, 4, 3)]
BITS, GROUP = 4, 128


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--json", type=Path, default=Path(".bench/packed_row_sweep.json"))
    parser.add_argument("--save-configs", type=Path,
                        help="merge the best config per kernel into this JSON table")
    parser.add_argument("--budget", type=float, default=110.0,
                        help="seconds after which no further candidate is tried")
    return parser.parse_args()


def packed(n: int, k: int, device: str, gen) -> SimpleNamespace:
    """Random AWQ-style int4 codes, group 128, bf16 scales and zero points."""
    from noesis.quant.packing import pack

    groups = k // GROUP
    codes = torch.randint(0, 1 << BITS, (n, k), device=device, generator=gen)
    zeros = torch.randint(0, 1 << BITS, (n, groups), device=device, generator=gen)
    scales = torch.rand(n, groups, device=device, generator=gen) * 0.02 + 0.001
    return SimpleNamespace(qweight=pack(codes, BITS), scales=scales.to(DTYPE),
                           qzeros=zeros.to(DTYPE), bits=BITS, group_size=GROUP)


def cases(shape: dict, device: str) -> dict:
    """Per fused kernel: (fused call(config, weight), unfused call(weight), weight copies)."""
    from noesis.kernels import pointwise
    from noesis.models.rope import apply_rotary
    from noesis.quant import kernel, packed_row

    gen = torch.Generator(device=device).manual_seed(0)
    hidden, inter, heads, kv_heads, dim = (shape[k] for k in
                                           ("hidden", "inter", "heads", "kv_heads", "head_dim"))

    def rand(*dims):
        return torch.randn(*dims, device=device, generator=gen).to(DTYPE)

    x, stream, norm = rand(1, hidden), rand(1, hidden), rand(hidden).abs() + 0.5
    act_in = rand(1, inter)
    angles = torch.rand(1, dim // 2, device=device, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(DTYPE)
    sin = torch.cat([angles.sin()] * 2, -1).to(DTYPE)
    pages = torch.zeros(2, 64, 16, kv_heads, dim, device=device, dtype=DTYPE)
    slot = torch.tensor([37], device=device)
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]

    def matmul(w, inputs):
        return kernel.packed_matmul(inputs, w.qweight, w.scales, w.qzeros, None, BITS, GROUP)

    def unfused_qkv(w):
        normed = pointwise.add_rms_norm(x, None, norm, 1e-5)[0]
        q, k, v = (t.view(1, -1, dim) for t in matmul(w, normed).split(sizes, -1))
        return torch.cat([apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v], 1).view(1, -1)

    def fused_qkv(config, w):
        return packed_row.norm_qkv_rope_store(x, norm, 1e-5, w, heads, kv_heads, cos, sin, slot,
                                              pages[0], pages[1], config=config).view(1, -1)

    return {
        "qkv": (fused_qkv, unfused_qkv, (sum(sizes), hidden)),
        "o": (lambda config, w: packed_row.gemv(x, w, stream, config=config),
              lambda w: matmul(w, x) + stream, (hidden, hidden)),
        "gate_up": (lambda config, w: packed_row.norm_glu(x, norm, 1e-5, w, config=config),
                    lambda w: pointwise.silu_mul(matmul(w, pointwise.add_rms_norm(
                        x, None, norm, 1e-5)[0])), (2 * inter, hidden)),
        "down": (lambda config, w: packed_row.gemv(act_in, w, stream, config=config),
                 lambda w: matmul(w, act_in) + stream, (hidden, inter)),
    }, gen


def sweep(name, fused, unfused, dims, grid, device, gen, deadline) -> dict:
    from noesis.quant import packed_row

    n, k = dims
    copies = 1 if device == "cpu" else max(1, -(-L2_FLUSH_BYTES // (n * k // 2)))
    weights = [packed(n, k, device, gen) for _ in range(copies)]
    want = unfused(weights[0]).float()
    mode = {"qkv": packed_row.QKV, "gate_up": packed_row.GLU}.get(name, packed_row.PLAIN)
    result = {"mode": mode, "N": n, "K": k,
              "unfused_us": time_us([lambda w=w: unfused(w) for w in weights], device),
              "default": list(packed_row.packed_row_config(mode, weights[0], n, k,
                                                           torch.device(device))),
              "configs": []}
    for config in dict.fromkeys([tuple(result["default"]), *grid]):
        if time.perf_counter() > deadline:
            result["cut_off"] = True
            break
        result["configs"].append(measure(fused, config, weights, want, device))
    timed = [c for c in result["configs"] if "us" in c]
    if timed:
        result["best"] = min(timed, key=lambda c: c["us"])
    return result


def measure(fused, config, weights, want, device) -> dict:
    """One config: its error against the unfused result (the output allocated full of NaN, so
    an unwritten element fails), then its time."""
    entry = {"config": list(config)}
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    try:
        got = fused(config, weights[0]).float()
    except Exception as exc:  # registers or shared memory over the limit
        entry["why"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return entry
    finally:
        torch.empty = empty
    error = float((got - want).norm() / want.norm())
    if not error < 1e-2:  # NaN fails too
        entry["why"] = f"error {error:.2e}"
        return entry
    entry["error"] = error
    entry["us"] = time_us([lambda w=w: fused(config, w) for w in weights], device)
    return entry


def main() -> None:
    global DTYPE
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    DTYPE = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 dot is off
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    deadline = time.perf_counter() + args.budget
    found, gen = cases(SMOKE_SHAPES if args.smoke else SHAPES, device)
    grid = SMOKE_GRID if args.smoke else GRID
    results = {}
    for name, (fused, unfused, dims) in found.items():
        results[name] = sweep(name, fused, unfused, dims, grid, device, gen, deadline)
        print_kernel(name, results[name])
    best = {f"{r['mode']},{BITS},{r['N']},{r['K']}": r["best"]["config"]
            for r in results.values() if "best" in r}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": gpu, "results": results, "best": best}, indent=1))
    if args.save_configs:
        _save_configs(args.save_configs, gpu, best)
    total = {kind: sum(r[kind] for r in results.values() if r.get(kind) is not None)
             for kind in ("unfused_us",)}
    fused_total = sum(r["best"]["us"] for r in results.values() if "best" in r)
    print(f"\n{gpu}: one layer's four kernels, best fused {fused_total:.1f} us against unfused "
          f"{total['unfused_us']:.1f} us (the unfused column includes the norm, RoPE, SiLU and "
          "residual kernels the block replaces)")


def print_kernel(name: str, result: dict) -> None:
    best = result.get("best")
    best_text = f"best {best['config']} {best['us']:.1f} us" if best else "no config ran"
    print(f"{name} [{result['N']}, {result['K']}] unfused {result['unfused_us']:.1f} us, "
          f"default {result['default']}, {best_text}", flush=True)
    for entry in result["configs"]:
        timing = f"{entry['us']:.1f} us" if "us" in entry else f"skipped: {entry['why']}"
        print(f"  {entry['config']}  {timing}", flush=True)


DTYPE = torch.bfloat16

if __name__ == "__main__":
    main()
