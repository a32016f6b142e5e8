"""The batch-1 MoE layers (issue 17), variants side by side on the lent GPU: a previous
moe_triton.py's experts (--old) and the committed ones, with torch's routing ops and with the
fused routing kernel, and (--tiles) the GEMV tiles (columns per program, K tile, warps), on 8
distinct random layers of the gpt-oss-20b
(MXFP4) and Qwen3-30B-A3B shapes replayed from one CUDA graph. Each variant's output is checked
against dequantize-then-matmul first (relative error); the share is of the roofline from the
distinct routed experts' bytes over the copy bandwidth measured in the same run.

    python benchmarks/moe_gemv_sweep.py --old path/to/moe_triton_at_HEAD.py --json sweep.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_moe import (  # noqa: E402
    SHAPES,
    _forward,
    build_layer,
    copy_bandwidth,
    expert_bytes_read,
    time_ms,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="a moe_triton.py to time as 'old' (one that "
                        "reads MXFP4 as fragments, as the layers hold them)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--tiles", choices=["gemv", "sorted"],
                        help="also sweep GEMV_TILES (batch 1) or SORTED (larger batches)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    bandwidth = copy_bandwidth("cuda", 1 << 30)
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    old = load_module(args.old) if args.old else None
    rows = []
    print("| shape | batch | variant | ms | share of roofline | rel. error |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        layers = [build_layer(shape, "cuda")[0] for _ in range(args.layers)]
        for batch in args.batches:
            x = torch.randn(batch, shape.hidden, device="cuda", dtype=torch.bfloat16)
            read = sum(expert_bytes_read(block, x) for block in layers)
            roofline_ms = read / bandwidth * 1e3
            reference = [_reference(block, x) for block in layers]
            for variant, setup in _variants(shape.mxfp4, old, args.tiles):
                restore = setup()
                try:
                    err = max(_rel(_forward(b, x), r)
                              for b, r in zip(layers, reference, strict=True))  # fmt: skip

                    def step(x=x, layers=layers):
                        return [_forward(b, x) for b in layers]

                    ms = time_ms(step, args.iters, "cuda", graph=True)
                except Exception as exc:  # a tile that does not compile is a row, not a crash
                    print(f"| {name} | {batch} | {variant} | failed: {type(exc).__name__}: "
                          f"{str(exc)[:200]} | | |")  # fmt: skip
                    continue
                finally:
                    restore()
                share = roofline_ms / ms
                rows.append(dict(shape=name, batch=batch, variant=variant, ms=ms, share=share,
                                 error=err, read_mb=read / 1e6))  # fmt: skip
                print(f"| {name} | {batch} | {variant} | {ms:.3f} | {share:.0%} | {err:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(dict(bandwidth=bandwidth, rows=rows), indent=1))


def _variants(mxfp4: bool, old, sweep_tiles: str | None):
    """(name, setup() -> restore) pairs: an older moe_triton module's experts with torch's
    routing, the committed experts with torch's routing and with the fused one (the default),
    then GEMV_TILES or SORTED choices. gpu_moe._forward reads noesis.kernels.moe.route
    and the package attribute noesis.kernels.moe_triton when it runs, so patching those swaps
    the variant."""
    import noesis.kernels as kernels
    from noesis.kernels import moe as moe_ops
    from noesis.kernels import moe_triton
    from noesis.kernels.moe_triton import Tiles

    def patch(experts=moe_triton, route=moe_ops.route, tiles=None, sorted_tiles=None,
              route_warps=1):
        def setup():
            saved = (kernels.moe_triton, moe_ops.route, moe_triton.GEMV_TILES,
                     moe_triton.SORTED, moe_triton.ROUTE_WARPS)  # fmt: skip
            kernels.moe_triton, moe_ops.route = experts, route
            moe_triton.ROUTE_WARPS = route_warps
            if tiles is not None:
                moe_triton.GEMV_TILES = (Tiles(*tiles[0]), Tiles(*tiles[1]))
            if sorted_tiles is not None:
                moe_triton.SORTED = Tiles(*sorted_tiles)

            def restore():
                kernels.moe_triton, moe_ops.route = saved[:2]
                moe_triton.GEMV_TILES, moe_triton.SORTED, moe_triton.ROUTE_WARPS = saved[2:]

            return restore

        return setup

    if old is not None:
        yield "old experts, torch routing", patch(experts=old, route=moe_ops.torch_route)
    yield "torch routing", patch(route=moe_ops.torch_route)
    yield "fused routing (default)", patch()
    yield "fused routing on 2 warps", patch(route_warps=2)
    yield "fused routing on 4 warps (Triton's default)", patch(route_warps=4)
    if sweep_tiles == "sorted":
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                for warps in (4, 8):
                    tiles = (block_n, block_k, warps)
                    yield f"sorted tiles {tiles}", patch(sorted_tiles=tiles)
    if sweep_tiles != "gemv" or mxfp4:  # MXFP4's FRAG_TILES: mxfp4_fragments.py --tiles
        return
    ups = [(16, 256, 4), (8, 256, 4), (16, 256, 2), (16, 512, 4)]
    downs = [(8, 256, 4), (16, 256, 4), (8, 256, 2), (8, 512, 4)]
    for up in ups:
        for down in downs:
            yield f"tiles gate_up {up}, down {down}", patch(tiles=(up, down))


def _reference(block, x):
    """Dequantize-then-matmul in float32 (noesis.kernels.moe.grouped)."""
    from noesis.kernels import moe as moe_ops
    from noesis.weights.mxfp4 import Mxfp4Weight

    with torch.no_grad():
        weights, ids = moe_ops.torch_route(block.router(x), block.top_k, block.routing,
                                           block.renormalize)  # fmt: skip
        experts = block.experts
        dense = []
        for name in ("gate_up_proj", "down_proj"):
            w = experts._projection(name)
            dense.append(w.dequantize(torch.float32) if isinstance(w, Mxfp4Weight) else w.float())
        biases = [None if b is None else b.float()
                  for b in (experts.gate_up_proj_bias, experts.down_proj_bias)]  # fmt: skip
        return moe_ops.grouped(x.float(), ids, weights.float(), *dense, experts.activation,
                               *biases)  # fmt: skip


def _rel(ours, ref) -> float:
    return ((ours.float() - ref).norm() / ref.norm()).item()


def load_module(path: Path):
    """A moe_triton.py from elsewhere (a previous commit's) as its own module."""
    spec = importlib.util.spec_from_file_location("moe_triton_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
