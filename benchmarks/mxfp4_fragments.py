"""MXFP4 experts as tensor-core fragments (kernels/mxfp4_mma.py), and (--old) a moe_triton.py
from before them on the stored layout, side by side on the lent GPU: gpt-oss-20b's expert
shapes (32 experts, top 4, hidden and inner 2880, biases, the clamped SwiGLU), 8 distinct random
layers at batch 1 (the GEMV layout) or larger (the sorted one), each variant replayed from one
CUDA graph, checked against dequantize-then-matmul first. The roofline is the routed experts'
bytes (codes, scales, biases) over the copy bandwidth measured in the same run.

    python benchmarks/mxfp4_fragments.py [--tiles]   # --tiles: also sweep FRAG_TILES
    python benchmarks/mxfp4_fragments.py --batch 64 --tiles   # FRAG_SORTED_TILES
    git show ed6ef81:src/noesis/kernels/moe_triton.py > old.py   # the stored layout's kernels
    python benchmarks/mxfp4_fragments.py --old old.py   # (it calls asm.bf16_pairs with the
                                                        # SCALED flag of its time: restore it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_moe import copy_bandwidth, time_ms  # noqa: E402

from noesis.kernels import moe_triton  # noqa: E402
from noesis.weights.mxfp4 import (
    Mxfp4Fragments,  # noqa: E402
    Mxfp4Weight,  # noqa: E402
)

EXPERTS, HIDDEN, INNER, TOP_K, LIMIT, ALPHA = 32, 2880, 2880, 4, 7.0, 1.702
# (gate_up, down) tiles: tiles a program, warps along K, chunks a warp's iteration. The int4
# sweep of the nineteenth session found 8-16 warps along K best on its small projections.
SWEEP = [((1, 4, 4), (2, 4, 2)), ((1, 8, 1), (2, 4, 2)), ((1, 4, 2), (1, 4, 2)),
         ((2, 2, 4), (1, 4, 4)), ((1, 2, 4), (2, 4, 2)), ((1, 4, 4), (1, 4, 4)),
         ((1, 8, 2), (1, 8, 2)), ((1, 4, 2), (1, 8, 2)), ((1, 8, 2), (1, 16, 1)),
         ((1, 16, 1), (1, 16, 1)), ((1, 4, 2), (1, 16, 2)), ((1, 8, 1), (1, 8, 2))]  # fmt: skip
SORTED_SWEEP = [(8, 8), (8, 4), (4, 4), (16, 8), (16, 16), (4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tiles", action="store_true", help="also sweep the fragment tiles")
    parser.add_argument("--old", type=Path, help="a moe_triton.py reading the stored layout")
    args = parser.parse_args()
    old = None
    if args.old:
        from moe_gemv_sweep import load_module

        old = load_module(args.old)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer(gen, args.batch) for _ in range(args.layers)]
    x = torch.randn(args.batch, HIDDEN, device="cuda", generator=gen).bfloat16()
    first = layers[0]
    ref = _reference(x, first)
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    roofline_ms = sum(_bytes_read(layer) for layer in layers) / bandwidth * 1e3
    knob = "FRAG_TILES" if args.batch == 1 else "FRAG_SORTED_TILES"
    sweep = SWEEP if args.batch == 1 else SORTED_SWEEP
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"roofline {roofline_ms * 1e3:.1f} us for {args.layers} layers")  # fmt: skip
    print("| variant | us, all layers | share of roofline | rel. error |")
    print("|---|---|---|---|")
    default = getattr(moe_triton, knob)
    variants = [(f"fragments, {knob} {default}", None, default)]
    if args.tiles:
        variants += [(f"fragments, {knob} {t}", None, t) for t in sweep if t != default]
    if old is not None:
        variants = [(f"stored layout ({args.old.name})", old, default), *variants,
                    (f"stored layout ({args.old.name}), again", old, default)]  # fmt: skip
    for name, module, tiles in variants:
        setattr(moe_triton, knob, tiles)
        out = _experts(x, first, module)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = time_ms(lambda m=module: [_experts(x, layer, m) for layer in layers], args.iters,
                     "cuda", graph=True)  # fmt: skip
        print(f"| {name} | {ms * 1e3:.1f} | {roofline_ms / ms:.0%} | {err:.1e} |", flush=True)
    setattr(moe_triton, knob, default)


def _layer(gen, batch: int):
    def mx(rows, cols):
        blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        scales = torch.randint(118, 124, (EXPERTS, rows, cols // 32), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        return Mxfp4Weight(blocks, scales)

    gate_up, down = mx(2 * INNER, HIDDEN), mx(HIDDEN, INNER)
    biases = [torch.randn(EXPERTS, n, device="cuda", generator=gen).bfloat16() * 0.1
              for n in (2 * INNER, HIDDEN)]  # fmt: skip
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K]
                       for _ in range(batch)])  # fmt: skip
    weights = torch.softmax(torch.randn(batch, TOP_K, device="cuda", generator=gen), -1)
    frags = (Mxfp4Fragments.pack(gate_up.blocks, gate_up.scales, gate_up=True),
             Mxfp4Fragments.pack(down.blocks, down.scales))  # fmt: skip
    return dict(stored=(gate_up, down), frags=frags, biases=biases, ids=ids, weights=weights)


def _experts(x, layer, old):
    """The fragments through moe_triton, or with `old` (a module) the stored layout through it."""
    gate_up, down = layer["frags" if old is None else "stored"]
    return (old or moe_triton).experts(x, layer["ids"], layer["weights"], gate_up, down, LIMIT,
                                       ALPHA, *layer["biases"], residual=x)  # fmt: skip


def _reference(x, layer):
    gate_up, down = (w.dequantize() for w in layer["stored"])
    gate_bias, down_bias = (b.float() for b in layer["biases"])
    out = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    for token in range(x.shape[0]):
        for slot in range(TOP_K):
            e = int(layer["ids"][token, slot])
            h = (x[token].float() @ gate_up[e].T + gate_bias[e]).bfloat16().float()
            gate, up = h[:INNER].clamp(max=LIMIT), h[INNER:].clamp(-LIMIT, LIMIT)
            act = ((up + 1) * gate * torch.sigmoid(gate * ALPHA)).bfloat16().float()
            y = (act @ down[e].T + down_bias[e]).bfloat16().float()
            out[token] += layer["weights"][token, slot] * y
    return (out.bfloat16() + x).float()


def _bytes_read(layer) -> int:
    gate_up, down = layer["stored"]
    per_expert = sum(t[0].nbytes for t in (gate_up.blocks, gate_up.scales, down.blocks,
                                           down.scales, *layer["biases"]))  # fmt: skip
    return int(layer["ids"].unique().numel()) * per_expert


if __name__ == "__main__":
    main()
