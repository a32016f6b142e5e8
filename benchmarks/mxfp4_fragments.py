"""MXFP4 experts as tensor-core fragments (kernels/mxfp4_mma.py) against the committed
bfloat16x2 GEMV, side by side on the lent GPU: gpt-oss-20b's expert shapes (32 experts, top 4,
hidden and inner 2880, biases, the clamped SwiGLU), 8 distinct random layers at batch 1, each
variant replayed from one CUDA graph, checked against dequantize-then-matmul first. The
roofline is the routed experts' bytes (codes, scales, biases) over the copy bandwidth measured
in the same run.

    python benchmarks/mxfp4_fragments.py [--tiles]   # --tiles: also sweep FRAG_TILES
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_moe import copy_bandwidth, time_ms  # noqa: E402

from noesis.kernels import moe_triton  # noqa: E402
from noesis.kernels.mxfp4_mma import Mxfp4Fragments  # noqa: E402
from noesis.weights.mxfp4 import Mxfp4Weight  # noqa: E402

EXPERTS, HIDDEN, INNER, TOP_K, LIMIT, ALPHA = 32, 2880, 2880, 4, 7.0, 1.702
SWEEP = [((1, 4, 4), (2, 4, 2)), ((1, 8, 1), (2, 4, 2)), ((1, 4, 2), (1, 4, 2)),
         ((2, 2, 4), (1, 4, 4)), ((1, 2, 4), (2, 4, 2)), ((1, 4, 4), (1, 4, 4))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tiles", action="store_true", help="also sweep FRAG_TILES")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [_layer(gen) for _ in range(args.layers)]
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen).bfloat16()
    first = layers[0]
    ref = _reference(x, first)
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    roofline_ms = sum(_bytes_read(layer) for layer in layers) / bandwidth * 1e3
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"roofline {roofline_ms * 1e3:.1f} us for {args.layers} layers")  # fmt: skip
    print("| variant | us, all layers | share of roofline | rel. error |")
    print("|---|---|---|---|")
    default = moe_triton.FRAG_TILES
    variants = [("bfloat16x2 GEMV (stored layout)", False, default),
                (f"fragments, FRAG_TILES {default}", True, default)]  # fmt: skip
    if args.tiles:
        variants += [(f"fragments, FRAG_TILES {t}", True, t) for t in SWEEP if t != default]
    variants.append(("bfloat16x2 GEMV (stored layout), again", False, default))
    for name, fragments, tiles in variants:
        moe_triton.FRAG_TILES = tiles
        out = _experts(x, first, fragments)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = time_ms(lambda f=fragments: [_experts(x, layer, f) for layer in layers], args.iters,
                     "cuda", graph=True)  # fmt: skip
        print(f"| {name} | {ms * 1e3:.1f} | {roofline_ms / ms:.0%} | {err:.1e} |", flush=True)
    moe_triton.FRAG_TILES = default


def _layer(gen):
    def mx(rows, cols):
        blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        scales = torch.randint(118, 124, (EXPERTS, rows, cols // 32), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        return Mxfp4Weight(blocks, scales)

    gate_up, down = mx(2 * INNER, HIDDEN), mx(HIDDEN, INNER)
    biases = [torch.randn(EXPERTS, n, device="cuda", generator=gen).bfloat16() * 0.1
              for n in (2 * INNER, HIDDEN)]  # fmt: skip
    ids = torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K][None]
    weights = torch.softmax(torch.randn(1, TOP_K, device="cuda", generator=gen), -1)
    frags = (Mxfp4Fragments.pack(gate_up.blocks, gate_up.scales, gate_up=True),
             Mxfp4Fragments.pack(down.blocks, down.scales))  # fmt: skip
    return dict(stored=(gate_up, down), frags=frags, biases=biases, ids=ids, weights=weights)


def _experts(x, layer, fragments: bool):
    gate_up, down = layer["frags" if fragments else "stored"]
    return moe_triton.experts(x, layer["ids"], layer["weights"], gate_up, down, LIMIT, ALPHA,
                              *layer["biases"], residual=x)  # fmt: skip


def _reference(x, layer):
    gate_up, down = (w.dequantize() for w in layer["stored"])
    gate_bias, down_bias = (b.float() for b in layer["biases"])
    out = torch.zeros(HIDDEN, device="cuda")
    for slot in range(TOP_K):
        e = int(layer["ids"][0, slot])
        h = (x[0].float() @ gate_up[e].T + gate_bias[e]).bfloat16().float()
        gate, up = h[:INNER].clamp(max=LIMIT), h[INNER:].clamp(-LIMIT, LIMIT)
        act = ((up + 1) * gate * torch.sigmoid(gate * ALPHA)).bfloat16().float()
        out += layer["weights"][0, slot] * (act @ down[e].T + down_bias[e]).bfloat16().float()
    return (out.bfloat16() + x[0]).float()[None]


def _bytes_read(layer) -> int:
    gate_up, down = layer["stored"]
    per_expert = sum(t[0].nbytes for t in (gate_up.blocks, gate_up.scales, down.blocks,
                                           down.scales, *layer["biases"]))  # fmt: skip
    return TOP_K * per_expert


if __name__ == "__main__":
    main()
