"""Batch-1 decode blocks, unfused against fused, on the Llama-3.1-8B and Llama-3.2-1B shapes, and
the attention, router and LM head of the gpt-oss-20b (q/k/v, o and router biases) and
Qwen3-30B-A3B (per-head q/k norms) shapes.

Unfused is what the engine runs with `ops.ONE_ROW_FUSION` off: add+RMSNorm, cuBLAS qkv, RoPE+KV
write, the one-row o_proj GEMV, add+RMSNorm, cuBLAS gate_up, SiLU-mul, cuBLAS down (with its
split-K reduction). Fused is DecoderLayer.forward_one_row: `norm_qkv_rope_store`, `gemv` with the
residual, `norm_glu`, `gemv` with the residual. Each fused kernel is swept over (rows per
program, K tile, warps, stages); then a whole layer less its attention is timed both ways with
the best configs. Every figure is timed inside a CUDA graph over 4 layers' weights in turn, so
no weight stays in L2 (timed from Python, a Triton launch costs tens of microseconds and hides
the kernel). The final norm with the LM head (`norm_logits`) is swept too, once per step. The
fused layer is also timed with programmatic dependent launch (`pdl.PDL`).

    python benchmarks/gemv_fused.py [--shapes llama-8b,llama-1b,gpt-oss-20b,qwen3-30b-a3b]
        [--quick] [--json out.json]
        [--save-configs row_gemv_configs.json]

The JSON's best configs load into the engine with `graph_ab.py --what fusion --tuned out.json`;
`--save-configs` writes the package's config table (src/noesis/kernels/row_gemv_configs.json)
with this GPU's best configs merged in, to be copied over it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from graph_timing import graph_us  # benchmarks/ is on sys.path when run as a script

from noesis.kernels import pdl, pointwise, rope, row_gemv

SHAPES = {
    "llama-8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128),
    "llama-1b": dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64),
    # MoE families: their experts are kernels/moe_triton.py's (benchmarks/moe_gemv_sweep.py)
    "gpt-oss-20b": dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
                        experts=32, bias=True),
    "qwen3-30b-a3b": dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                          experts=128, qk_norm=True),
}  # fmt: skip
LAYERS = 4
VOCAB = 128256
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU smoke run (TRITON_INTERPRET=1): cpu, float32
EPS = 1e-5


class Layers:
    """Random bf16 weights of LAYERS decoder layers, one token's inputs, and a paged cache."""

    def __init__(self, hidden, heads, kv_heads, head_dim, inter=None, vocab=None, experts=None,
                 bias=False, qk_norm=False) -> None:
        def rand(*shape, scale=0.02):
            return torch.randn(*shape, device=DEVICE, dtype=DTYPE) * scale

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        self.weights = []
        for _ in range(LAYERS):
            w = dict(qkv=rand(qkv_rows, hidden), o=rand(hidden, heads * head_dim),
                     norm1=rand(hidden, scale=0.1) + 1, norm2=rand(hidden, scale=0.1) + 1,
                     lm_head=rand(vocab or VOCAB, hidden))
            if inter:
                w.update(gate_up=rand(2 * inter, hidden), down=rand(hidden, inter))
            if experts:
                w.update(router=rand(experts, hidden), router_bias=rand(experts) if bias else None)
            w["qkv_bias"] = rand(qkv_rows) if bias else None
            w["o_bias"] = rand(hidden) if bias else None
            if qk_norm:
                w["qk_norm"] = (rand(head_dim, scale=0.1) + 1, rand(head_dim, scale=0.1) + 1, EPS)
            self.weights.append(w)
        # with q/k norms the qkv projection is a plain one; the RoPE kernel normalizes the heads
        qkv_mode = row_gemv.PLAIN if qk_norm else row_gemv.QKV
        self.modes = ({"qkv": qkv_mode, "o": row_gemv.PLAIN, "router": row_gemv.PLAIN,
                       "lm_head": row_gemv.PLAIN} if experts else MODES)  # fmt: skip
        self.hidden, self.residual = rand(1, hidden, scale=1.0), rand(1, hidden, scale=1.0)
        self.stream = self.hidden + self.residual  # what the fused path carries between blocks
        self.attn = rand(1, heads * head_dim, scale=1.0)
        self.act = rand(1, inter, scale=1.0) if inter else None
        angles = torch.rand(1, head_dim // 2, device=DEVICE) * 6
        self.cos = torch.cat([angles.cos()] * 2, -1)
        self.sin = torch.cat([angles.sin()] * 2, -1)
        self.slots = torch.tensor([37], device=DEVICE)
        self.kv = torch.zeros(2, 8, 16, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
        self.split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    # the unfused kernels, as the engine runs them at batch 1 (o and down leave the residual add
    # to the next add+RMSNorm)
    def qkv_unfused(self, w, hidden=None, residual=None):
        normed, _ = pointwise.add_rms_norm(self.hidden if hidden is None else hidden,
                                    self.residual if residual is None else residual,
                                    w["norm1"], EPS)
        qkv = F.linear(normed, w["qkv"], w["qkv_bias"])
        d = self.head_dim
        q, k, v = (t.view(1, -1, d) for t in qkv.split(self.split, -1))
        if w.get("qk_norm"):
            q_norm, k_norm, eps = w["qk_norm"]
            q.copy_(pointwise.add_rms_norm(q[0], None, q_norm, eps)[0])
            k.copy_(pointwise.add_rms_norm(k[0], None, k_norm, eps)[0])
        rope.rope_write_kv(q, k, v, self.cos, self.sin, self.slots, self.kv[0], self.kv[1])
        return qkv  # rotated in place

    def o_unfused(self, w):
        if w["o_bias"] is not None:  # cuBLAS, as nn.Linear runs it
            return F.linear(self.attn, w["o"], w["o_bias"])
        return row_gemv.gemv(self.attn, w["o"])

    def router_unfused(self, w):
        normed, _ = pointwise.add_rms_norm(self.hidden, self.residual, w["norm2"], EPS)
        return F.linear(normed, w["router"], w["router_bias"])

    def gate_up_unfused(self, w):
        normed, _ = pointwise.add_rms_norm(self.hidden, self.residual, w["norm2"], EPS)
        return pointwise.silu_mul(F.linear(normed, w["gate_up"]))

    def down_unfused(self, w):
        return F.linear(self.act, w["down"])

    def lm_head_unfused(self, w):
        normed, _ = pointwise.add_rms_norm(self.hidden, self.residual, w["norm1"], EPS)
        return F.linear(normed, w["lm_head"]).float()

    # the fused kernels; config None takes row_gemv.ROW_GEMV_CONFIGS
    def qkv_fused(self, w, config=None, stream=None):
        stream = self.stream if stream is None else stream
        if w.get("qk_norm"):  # as ops.norm_qkv_rope_store runs it: the projection, then RoPE
            qkv = row_gemv.norm_logits(stream, w["norm1"], EPS, w["qkv"], config=config,
                                       bias=w["qkv_bias"], dtype=DTYPE)
            d = self.head_dim
            q, k, v = (t.view(1, -1, d) for t in qkv.split(self.split, -1))
            rope.rope_write_kv(q, k, v, self.cos, self.sin, self.slots, self.kv[0], self.kv[1],
                               qk_norm=w["qk_norm"])  # fmt: skip
            return qkv
        return row_gemv.norm_qkv_rope_store(stream, w["norm1"], EPS, w["qkv"], self.heads,
                                            self.kv_heads, self.cos, self.sin, self.slots,
                                            self.kv[0], self.kv[1], config=config,
                                            bias=w["qkv_bias"])  # fmt: skip

    def o_fused(self, w, config=None, stream=None):
        return row_gemv.gemv(self.attn, w["o"], self.residual if stream is None else stream,
                       config=config, bias=w["o_bias"])

    def router_fused(self, w, config=None):
        normed = torch.empty_like(self.stream)
        return row_gemv.norm_logits(self.stream, w["norm2"], EPS, w["router"], config=config,
                                    bias=w["router_bias"], normed=normed, dtype=DTYPE)

    def gate_up_fused(self, w, config=None, stream=None):
        return row_gemv.norm_glu(self.stream if stream is None else stream, w["norm2"], EPS,
                           w["gate_up"], config=config)

    def down_fused(self, w, config=None, stream=None, act=None):
        return row_gemv.gemv(self.act if act is None else act, w["down"],
                       self.residual if stream is None else stream, config=config)

    def lm_head_fused(self, w, config=None):
        return row_gemv.norm_logits(self.stream, w["norm1"], EPS, w["lm_head"], config=config)

    def layer(self, fused: bool, configs: dict) -> None:
        """LAYERS layers less their attention: the four projections and what surrounds them."""
        hidden, residual, stream = self.hidden, self.residual, self.stream
        for w in self.weights:
            if fused:
                self.qkv_fused(w, configs["qkv"], stream)
                stream = self.o_fused(w, configs["o"], stream)
                act = self.gate_up_fused(w, configs["gate_up"], stream)
                stream = self.down_fused(w, configs["down"], stream, act)
            else:
                self.qkv_unfused(w, hidden, residual)
                normed, residual = pointwise.add_rms_norm(row_gemv.gemv(self.attn, w["o"]),
                                                          residual, w["norm2"], EPS)
                act = pointwise.silu_mul(F.linear(normed, w["gate_up"]))
                hidden = F.linear(act, w["down"])


def reference_error(layers: Layers, name: str, config) -> float:
    """Relative error of the fused kernel against the unfused steps (residual added back)."""
    w = layers.weights[0]
    want = getattr(layers, f"{name}_unfused")(w).float()
    if name in ("o", "down"):
        want = (want.to(DTYPE) + layers.residual).float()
    got = getattr(layers, f"{name}_fused")(w, config).float()
    return float((got - want).norm() / want.norm())


MODES = {"qkv": row_gemv.QKV, "o": row_gemv.PLAIN, "gate_up": row_gemv.GLU,
         "down": row_gemv.PLAIN, "lm_head": row_gemv.PLAIN}


def sweep(layers: Layers, name: str, quick: bool) -> dict:
    # Unpipelined (1 stage), the loads in flight are one tile's, so small matrices want wide
    # K tiles or few rows per program (more programs); pipelined (3), cp.async keeps more.
    rows = (4, 8) if quick else (2, 4, 8, 16)
    tiles = (512, 1024) if quick else (512, 1024, 2048)
    if name == "router":  # few rows: a program per row or two
        rows = (1, 2, 4)
    paired = 2 if name in ("qkv", "gate_up") else 1
    # at most 64 weights per thread per tile (more spills registers: ptxas, sm_90), and at
    # most 96 KB of shared memory for the pipeline's tiles
    grid = [(r, t, w, s) for r, t, w, s in itertools.product(rows, tiles, (4, 8), (1, 3))
            if r * t <= 64 * 32 * w and (s == 1 or s * paired * r * t * 2 <= 96 * 1024)]
    unfused = getattr(layers, f"{name}_unfused")
    fused = getattr(layers, f"{name}_fused")
    base = graph_us(lambda: [unfused(w) for w in layers.weights]) / LAYERS
    best = {"us": float("inf")}
    for config in grid:
        if layers.modes[name] == row_gemv.QKV and (layers.head_dim // 2) % config[0]:
            continue
        try:
            error = reference_error(layers, name, config)
        except Exception as exc:  # noqa: BLE001 - e.g. more shared memory than the device has
            print(f"  {name} {config}: skipped ({type(exc).__name__})")
            continue
        if error > 2e-2:
            print(f"  {name} {config}: wrong (relative error {error:.3g})")
            continue
        us = graph_us(lambda c=config: [fused(w, c) for w in layers.weights]) / LAYERS
        if us < best["us"]:
            best = {"us": us, "config": list(config), "error": error}
    n, k = layers.weights[0][name].shape
    return {"mode": layers.modes[name], "n": n, "k": k, "unfused_us": base, "fused_us": best["us"],
            "config": best.get("config"), "error": best.get("error")}


def best_configs(report: dict) -> dict[str, list[int]]:
    """The best config of every swept kernel in a report, keyed "mode,N,K" as the package's
    config table is."""
    return {f"{r['mode']},{r['n']},{r['k']}": r["config"]
            for kernels in report.values() for r in kernels.values()
            if isinstance(r, dict) and r.get("config")}


def format_table(table: dict) -> str:
    """The config table as JSON, one kernel's config per line."""
    gpus = []
    for gpu, configs in sorted(table.items()):
        lines = ",\n".join(f"  {json.dumps(key)}: {json.dumps(config)}"
                           for key, config in sorted(configs.items()))
        gpus.append(f" {json.dumps(gpu)}: {{\n{lines}\n }}")
    return "{\n" + ",\n".join(gpus) + "\n}\n" if gpus else "{}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-8b,llama-1b")
    parser.add_argument("--quick", action="store_true", help="a smaller config grid")
    parser.add_argument("--json")
    parser.add_argument("--save-configs", metavar="PATH",
                        help="write the config table (PATH's if it exists, else the package's) "
                        "with this GPU's best configs merged in")
    args = parser.parse_args()
    report = {}
    for shape in args.shapes.split(","):
        layers = Layers(**SHAPES[shape])
        entry = report[shape] = {}
        for name in layers.modes:
            entry[name] = result = sweep(layers, name, args.quick)
            print(f"{shape} {name:<8} unfused {result['unfused_us']:7.2f} us | fused "
                  f"{result['fused_us']:7.2f} us {result['config']}", flush=True)
        if "gate_up" not in layers.modes:  # a MoE shape: its experts are not these kernels
            del layers
            torch.cuda.empty_cache()
            continue
        best = {name: tuple(entry[name]["config"]) for name in ("qkv", "o", "gate_up", "down")}
        variants = {"layer_unfused_us": (False, False), "layer_fused_us": (True, False),
                    "layer_fused_pdl_us": (True, True)}
        pdl_setting = pdl.PDL
        for key, (fused, with_pdl) in [*variants.items()] * 2:  # alternating, to show the noise
            pdl.PDL = with_pdl
            us = graph_us(lambda f=fused, ls=layers, c=best: ls.layer(f, c), reps=5) / LAYERS
            entry.setdefault(key, []).append(us)
        pdl.PDL = pdl_setting
        print(f"{shape} layer less attention (best configs), us: "
              + ", ".join(f"{key[6:-3]} {entry[key]}" for key in variants), flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.save_configs:  # merged into the file when it exists (one per sweep), else the package's
        base = Path(args.save_configs) if Path(args.save_configs).exists() else row_gemv.CONFIG_FILE
        table = json.loads(base.read_text())
        table.setdefault(torch.cuda.get_device_name(), {}).update(best_configs(report))
        with open(args.save_configs, "w") as f:
            f.write(format_table(table))


if __name__ == "__main__":
    main()
