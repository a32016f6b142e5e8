"""int4 GEMVs over tensor-core fragments (quant/int4_fragments.py, kernels/frag_gemv.py) against
the stored layout's GEMV (quant/kernel.py `_packed_gemv`, its tuned configs) on the lent GPU:
the 8B (or `--shape llama-1b`) Llama shape's four projections (AWQ-style int4, groups of 128,
bfloat16 by default), one row of x, `--layers` distinct random layers per projection so that
the weights stream from memory, each variant replayed from one CUDA graph and checked against
dequantize-then-matmul first. The roofline is the bytes read (codes, scales, zero points: the
same in both layouts) over the copy bandwidth measured in the same run.

    python benchmarks/int4_fragments.py [--tiles] [--dtype float16] [--json out.json]
    python benchmarks/int4_fragments.py --tiles --save-configs src/noesis/quant/frag_configs.json
    python benchmarks/int4_fragments.py --rows 2,8,16,32,64 [--tiles]

--rows times several rows of x (decode batches, prefill) instead: the stored layout's tuned
launch, the fragment matmul (tl.dot), the fragments dequantized into x's dtype then torch.matmul
(kernel.FRAG_DENSE_ROWS), fragment_rows (x's rows as the mma's columns; --tiles
sweeps its tiles) and bfloat16 weights through torch.matmul (cuBLAS), each share against its
own bytes.

--save-configs merges each projection's fastest fragment variant into the file the GEMV reads
its per-shape tiles from (quant.kernel.fragment_config), keyed by this GPU's name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_moe import copy_bandwidth, time_ms  # noqa: E402

from noesis.quant import kernel  # noqa: E402
from noesis.quant.int4_fragments import Int4Fragments  # noqa: E402
from noesis.quant.linear import dequantize, group_index  # noqa: E402
from noesis.quant.packing import pack  # noqa: E402

SHAPE_SETS = {  # --shape: (out features, in features) of each projection
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336)},
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                 "down": (2048, 8192)},
}  # fmt: skip
SHAPES = dict(SHAPE_SETS["llama-8b"])  # the run's, set by --shape
GROUP = 128
# (tiles a program, warps a tile, chunks a warp's iteration): down and o have 256 tiles only,
# so their programs need more warps along K to fill the GPU than gate_up's 1,792
# fragment_rows: (warps along N, warps along K, chunks, tiles a warp[, most rows a program])
ROWS_SWEEP = [(1, 8, 2, 1), (1, 16, 1, 1), (1, 8, 1, 1), (1, 4, 1, 2), (1, 8, 1, 2),
              (1, 4, 1, 4), (2, 4, 1, 2), (1, 4, 2, 2), (1, 4, 1, 4, 32), (1, 4, 1, 2, 32),
              (1, 8, 1, 4, 16), (1, 4, 2, 4, 16)]
SWEEP = [(1, 4, 2), (1, 4, 4), (1, 8, 1), (1, 8, 2), (1, 8, 4), (1, 16, 1), (1, 16, 2),
         (2, 4, 2), (2, 2, 2), (4, 2, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPE_SETS), default="llama-8b",
                        help="the model shape whose projections are timed")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tiles", action="store_true", help="also sweep FRAG_TILES")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows", help="comma-separated row counts: time several rows of x")
    parser.add_argument("--save-configs", type=Path,
                        help="merge each shape's fastest fragment variant into this file")
    args = parser.parse_args()
    SHAPES.clear()
    SHAPES.update(SHAPE_SETS[args.shape])
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {name: [_projection(gen, n, k, dtype) for _ in range(args.layers)]
              for name, (n, k) in SHAPES.items()}  # fmt: skip
    xs = {k: torch.randn(1, k, device="cuda", generator=gen).to(dtype) for _, k in SHAPES.values()}
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    if args.rows:
        return _rows_table(args, layers, dtype, gen, bandwidth)
    variants = {"stored layout": None}
    for tiles in [kernel.FRAG_TILES] + (SWEEP if args.tiles else []):
        variants[f"fragments {tiles}"] = tiles
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{args.layers} layers of each projection, int4 g{GROUP}, {args.dtype}, one row")
    rows = []
    for label, variant in variants.items():
        row = {"variant": label, "us": {}, "share": {}, "error": {}}
        for name, projections in layers.items():
            x = xs[SHAPES[name][1]]
            row["error"][name] = _error(x, projections[0], variant)
            ms = time_ms(lambda p=projections, x=x, v=variant: [_run(x, q, v) for q in p],
                         args.iters, "cuda", graph=True)  # fmt: skip
            read = sum(q["bytes"] for q in projections)
            row["us"][name] = ms * 1e3 / args.layers
            row["share"][name] = read / bandwidth / (ms / 1e3)
        row["us"]["layer"] = sum(row["us"].values())
        layer_bytes = sum(layers[name][0]["bytes"] for name in SHAPES)
        row["share"]["layer"] = layer_bytes / bandwidth / (row["us"]["layer"] / 1e6)
        rows.append(row)
    names = [*SHAPES, "layer"]
    print("| variant | " + " | ".join(f"{n} us (share)" for n in names) + " | max rel. error |")
    print("|---" * (len(names) + 2) + "|")
    for row in rows:
        cells = " | ".join(f"{row['us'][n]:.1f} ({row['share'][n]:.0%})" for n in names)
        print(f"| {row['variant']} | {cells} | {max(row['error'].values()):.1e} |")
    if args.save_configs:
        from quant_gemv_sweep import _save_configs

        best = {}
        for name in SHAPES:
            row = min((r for r in rows if variants[r["variant"]] is not None),
                      key=lambda r: r["us"][name])  # fmt: skip
            best[kernel.fragment_key(layers[name][0]["frags"])] = list(variants[row["variant"]])
        _save_configs(args.save_configs, torch.cuda.get_device_name(), best)
        print(f"saved {len(best)} configs to {args.save_configs}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "bandwidth": bandwidth, "torch": torch.__version__,
                                         "rows": rows}, indent=1))  # fmt: skip


def _rows_table(args, layers, dtype, gen, bandwidth) -> None:
    variants = {"stored layout": "stored", "fragment matmul": "matmul",
                "fragment matmul, K over 4": "matmul4", "fragments dequantized + matmul": "dense"}
    for tiles in sorted(set(kernel.FRAG_ROWS_TILES.values())) + (ROWS_SWEEP if args.tiles else []):
        variants[f"fragment rows {tiles}"] = tiles
    variants["bf16 cuBLAS"] = "bf16"
    dense = {name: [torch.randn(n, k, device="cuda", generator=gen).to(dtype) * 0.02
                    for _ in range(args.layers)] for name, (n, k) in SHAPES.items()}  # fmt: skip
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{args.layers} layers of each projection, int4 g{GROUP}, {args.dtype}")
    print("| rows | variant | " + " | ".join(f"{n} us (share)" for n in [*SHAPES, "layer"])
          + " | max rel. error |")
    print("|---" * (len(SHAPES) + 4) + "|")
    table = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, device="cuda", generator=gen).to(dtype)
              for _, k in SHAPES.values()}  # fmt: skip
        for label, variant in variants.items():
            us, share, errors = {}, {}, []
            for name, projections in layers.items():
                x = xs[SHAPES[name][1]]
                if variant == "bf16":
                    weights = dense[name]
                    ms = time_ms(lambda w=weights, x=x: [x @ v.T for v in w], args.iters, "cuda",
                                 graph=True)  # fmt: skip
                    read = sum(w.numel() * w.element_size() for w in weights)
                else:
                    errors.append(_error(x, projections[0], ("rows", variant)))
                    ms = time_ms(lambda p=projections, x=x, v=variant:
                                 [_run(x, q, ("rows", v)) for q in p], args.iters, "cuda",
                                 graph=True)  # fmt: skip
                    read = sum(q["bytes"] for q in projections)
                us[name] = ms * 1e3 / args.layers
                share[name] = read / bandwidth / (ms / 1e3)
            us["layer"] = sum(us.values())
            layer_bytes = sum(q["bytes"] for q in (layers[name][0] for name in SHAPES))
            if variant == "bf16":
                layer_bytes = sum(dense[name][0].numel() * 2 for name in SHAPES)
            share["layer"] = layer_bytes / bandwidth / (us["layer"] / 1e6)
            cells = " | ".join(f"{us[n]:.1f} ({share[n]:.0%})" for n in [*SHAPES, "layer"])
            error = f"{max(errors):.1e}" if errors else "-"
            print(f"| {m} | {label} | {cells} | {error} |", flush=True)
            table.append({"rows": m, "variant": label, "us": us, "share": share})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "bandwidth": bandwidth, "torch": torch.__version__,
                                         "rows": table}, indent=1))  # fmt: skip
    if args.save_configs:
        keys = {name: kernel.fragment_key(layers[name][0]["frags"]) for name in SHAPES}
        best = rows_configs(table, keys)
        from quant_gemv_sweep import _save_configs

        _save_configs(args.save_configs, torch.cuda.get_device_name(), best)
        print(f"saved {len(best)} configs to {args.save_configs}")


def rows_configs(table: list[dict], keys: dict[str, str]) -> dict[str, list[int]]:
    """Each projection's fastest fragment_rows tiles per rows bucket of the rows timed
    (kernel.fragment_rows_bucket), keyed as kernel.fragment_rows_config reads them; the
    largest count timed in a bucket decides it."""
    best = {}
    for m in sorted({row["rows"] for row in table}):
        timed = [r for r in table if r["rows"] == m and r["variant"].startswith("fragment rows")]
        for name, key in keys.items():
            fastest = min(timed, key=lambda r: r["us"][name])
            tiles = fastest["variant"].removeprefix("fragment rows ").strip("()").split(", ")
            best[f"{key},{kernel.fragment_rows_bucket(m)}"] = [int(t) for t in tiles]
    return best


def _projection(gen, n: int, k: int, dtype) -> dict:
    groups = k // GROUP
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda", generator=gen)
    scales = (torch.rand(n, groups, device="cuda", generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), device="cuda", generator=gen).to(dtype)
    qweight = pack(codes, 4)
    del codes
    frags = Int4Fragments.pack(qweight, scales, zeros, GROUP)
    read = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 2
    return {"qweight": qweight, "scales": scales, "zeros": zeros, "frags": frags, "bytes": read}


def _run(x, q, variant):
    """variant: None (the stored layout), the GEMV's tiles, passed explicitly (not the saved
    per-shape configs), or ("rows", "stored" | "matmul" | fragment_rows' tiles)."""
    if variant is None or variant == ("rows", "stored"):
        return kernel.packed_matmul(x, q["qweight"], q["scales"], q["zeros"], None, 4, GROUP)
    if variant in (("rows", "matmul"), ("rows", "matmul4")):
        return kernel.fragment_matmul(x, q["frags"], 4 if variant[1] == "matmul4" else 1)
    if variant == ("rows", "dense"):
        return x @ kernel.fragment_dequantize(q["frags"], x.dtype).T
    if variant[0] == "rows":
        return kernel.fragment_rows(x, q["frags"], variant[1])
    return kernel.fragment_gemv(x, q["frags"], variant)


def _error(x, q, variant) -> float:
    index = group_index(None, x.shape[1], GROUP, x.device)
    weight = dequantize(q["qweight"], q["scales"].float(), q["zeros"].float(), index, 4)
    ref = x.float() @ weight.T
    ours = _run(x, q, variant).float()
    return ((ours - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    main()
