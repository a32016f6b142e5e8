"""Quantized decode on the GPU: bf16 vs AWQ int4 (group 128) vs int8 (per channel) vs GGUF Q4_K
(kept packed) on the random Llama-3.1-8B shape through the engine (CUDA graphs), an fp8 KV
cache vs bf16 at 8k context, and
the dequantizing kernel alone against torch's bf16 matmul, beside the copy bandwidth measured in
the same run.

    python benchmarks/gpu_quant.py --json .bench/gpu_quant.json      # H100: about 3 minutes
    python benchmarks/gpu_quant.py --smoke --json /tmp/quant.json    # CPU, tiny shape: the script

Per variant and batch (1, 64; 128-token prompts): steady decode tok/s, weight bytes in memory,
bytes read per step (weights without the embedding table, whose rows are gathered, plus the KV
the step reads), the roofline tok/s those bytes allow at the measured bandwidth, the share
reached, and tok/s relative to bf16. The int4 and int8 checkpoints are random bf16 weights
quantized on the device by `noesis quantize`'s round-to-nearest, written in AWQ / GPTQ layout.
The gguf package cannot quantize to Q4_K, so the Q4_K file holds random Q4_K blocks (random
6-bit scales and minimums and 4-bit codes, small float16 super-block scales) for every
projection, float16 embeddings and head, written with the package's GGUFWriter and loaded with
gguf_weights="packed".
A variant that fails is reported with its error; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if "--smoke" in sys.argv:  # the kernel on a CPU runs under Triton's interpreter: set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "scripts"))
from gpu_decode import guarded, library_versions, prompt_ids, release_memory, steady_decode  # noqa: E402,I001
from make_random_checkpoint import (  # noqa: E402
    SHAPES, make_checkpoint, random_tensor, tensor_shapes, write_config, write_tokenizer,
)

# vocab: gpu_decode's prompt ids reach 30,000
# hidden 256: Q4_K's blocks are 256 values along K
SMOKE_SHAPE = dict(hidden=256, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=32000)
# (name, checkpoint, kv_cache_dtype, long-context run)
VARIANTS = (
    ("bf16", "bf16", "auto", True),
    ("bf16 + fp8 KV", "bf16", "fp8", True),
    ("AWQ int4 g128", "int4", "auto", False),
    ("int8 per channel", "int8", "auto", False),
    ("Q4_K GGUF packed", "q4_k", "auto", False),
    # the same packed checkpoints on the fused one-row block (models.layers.PACKED_ONE_ROW)
    ("AWQ int4 g128 packed-row", "int4", "auto", False),
    ("int8 per channel packed-row", "int8", "auto", False),
    # int4 over tensor-core fragments (quant.linear.INT4_FRAGMENTS, the CUDA default); the
    # variants without it keep the stored layout
    ("AWQ int4 g128 fragments", "int4", "auto", False),
)
GGUF_FILE = "model.gguf"  # the Q4_K checkpoint: this file in its directory
PROJECTIONS = {"qkv": lambda s: (s["hidden"] + 2 * s["kv_heads"] * s["hidden"] // s["heads"],
                                 s["hidden"]),
               "o": lambda s: (s["hidden"], s["hidden"]),
               "gate_up": lambda s: (2 * s["intermediate"], s["hidden"]),
               "down": lambda s: (s["hidden"], s["intermediate"])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, a tiny shape, few steps: checks the script, measures nothing")
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                        help="comma list of variant names to run")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--long-context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per run")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench-quant"))
    parser.add_argument("--json", type=Path, default=ROOT.parent / ".bench" / "gpu_quant.json")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.long_context, args.steps = "1,4", 256, 8
    return args


def main() -> None:
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    shape = SMOKE_SHAPE if args.smoke else SHAPES["llama-8b"]
    if args.smoke:  # gpu_decode's helpers wait for CUDA; a CPU has nothing to wait for
        torch.cuda.synchronize = lambda *a, **k: None
    from noesis.telemetry.bench import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device(device))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
              "torch": torch.__version__, "versions": library_versions(),
              "copy_bandwidth_TBps": bandwidth / 1e12, "shape": shape, "kernel": {},
              "variants": {}}
    print(f"{report['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    report["kernel"] = guarded(bench_kernels, shape, device, bandwidth)
    save(args.json, report)
    batches = [int(b) for b in args.batches.split(",") if b]
    wanted = args.variants.split(",")
    checkpoints: dict[str, Path] = {}
    for name, kind, kv_dtype, long in VARIANTS:
        if name not in wanted:
            continue
        for old in [k for k in checkpoints if k != kind]:  # one checkpoint on disk at a time
            shutil.rmtree(checkpoints.pop(old), ignore_errors=True)
        if kind not in checkpoints:
            checkpoints[kind] = args.workdir / kind
            made = guarded(write_checkpoint, checkpoints[kind], shape, kind, device)
            if "error" in made:
                report["variants"][name] = made
                continue
        model = checkpoints[kind] / GGUF_FILE if kind == "q4_k" else checkpoints[kind]
        run = (model, device, kv_dtype, batches, args.long_context if long else 0,
               args.steps, bandwidth, name.endswith("packed-row"), name.endswith("fragments"))
        report["variants"][name] = guarded(bench_variant, *run)
        release_memory()
        print(name, json.dumps(report["variants"][name]), flush=True)
        save(args.json, report)
    shutil.rmtree(args.workdir, ignore_errors=True)
    print_table(report)


def save(path: Path, report: dict) -> None:
    """Written after every part: a run cut off at its time limit keeps what is done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


# ---- checkpoints ---------------------------------------------------------------------------------


def write_checkpoint(out: Path, shape: dict, kind: str, device: str) -> dict:
    """A random bf16 checkpoint, or its int4 / int8 quantization, at `out`."""
    t0 = time.perf_counter()
    max_len = 16384
    if kind == "bf16" and shape is SHAPES["llama-8b"]:
        make_checkpoint(out, "llama-8b", "bfloat16", max_len, 0, False, device)
    elif kind == "q4_k":
        out.mkdir(parents=True, exist_ok=True)
        write_q4_k_gguf(out / GGUF_FILE, shape, max_len)
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_config(out, shape, "bfloat16", max_len)
        write_tokenizer(out, shape["vocab"])
        write_quantized_weights(out, shape, kind, device)
    seconds = time.perf_counter() - t0
    print(f"{kind} checkpoint written in {seconds:.1f}s", flush=True)
    return {"seconds": seconds}


def write_quantized_weights(out: Path, shape: dict, kind: str, device: str) -> None:
    """Random bf16 weights, each projection quantized on `device` as `noesis quantize` does
    (kind "int4": AWQ group 128; "int8": GPTQ per channel; "bf16": as drawn), one file per
    decoder layer plus one for the rest, and the shard index."""
    from safetensors.torch import save_file

    from noesis.quant.scheme import awq_config, gptq_config

    gen = torch.Generator(device=device).manual_seed(0)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, dims in tensor_shapes(shape).items():
        layer = name.split(".")[2] if ".layers." in name else "rest"
        files.setdefault(f"model-{layer}.safetensors", {}).update(
            quantized_tensors(name, dims, kind, gen))
    weight_map = {}
    for filename, tensors in files.items():
        save_file(tensors, out / filename, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, filename)
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    if kind != "bf16":
        config = json.loads((out / "config.json").read_text())
        scheme = awq_config(128) if kind == "int4" else gptq_config(8, -1)
        (out / "config.json").write_text(json.dumps(config | {"quantization_config": scheme}))


def quantized_tensors(name: str, dims: tuple[int, ...], kind: str, gen) -> dict:
    """One checkpoint tensor, or a projection's AWQ / GPTQ tensors."""
    from noesis.quant.packing import awq_checkpoint, gptq_checkpoint
    from noesis.quant.quantize import quantize_int4, quantize_int8

    if kind == "bf16" or not name.endswith("_proj.weight"):
        return {name: random_tensor(name, dims, torch.bfloat16, gen)}
    # drawn as random_tensor draws a projection, but left on the device to be quantized there
    weight = (torch.randn(dims, generator=gen, device=gen.device) / dims[1] ** 0.5).bfloat16()
    base = name.removesuffix(".weight")
    if kind == "int4":
        parts = awq_checkpoint(*quantize_int4(weight, 128))
        extra = {}
    else:
        codes, zeros, scales = quantize_int8(weight, -1)
        parts = gptq_checkpoint(codes, zeros.to(codes.device), scales, bits=8)
        extra = {f"{base}.g_idx": torch.zeros(dims[1], dtype=torch.int32)}
    leaves = dict(zip(("qweight", "qzeros", "scales"), parts, strict=True))
    return {f"{base}.{leaf}": t.cpu().contiguous() for leaf, t in leaves.items()} | extra


Q4_K_BLOCK = (256, 144)  # values, bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
# minimums, 128 bytes of 4-bit codes
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_q4_k_gguf(path: Path, shape: dict, max_len: int) -> None:
    """A Llama GGUF file of `shape`: random Q4_K projections, float16 embeddings and head,
    float32 norms, and a byte-level vocabulary of shape["vocab"] tokens without merges."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = shape["hidden"] // shape["heads"]
    for add, value in ((writer.add_context_length, max_len),
                       (writer.add_embedding_length, shape["hidden"]),
                       (writer.add_block_count, shape["layers"]),
                       (writer.add_feed_forward_length, shape["intermediate"]),
                       (writer.add_head_count, shape["heads"]),
                       (writer.add_head_count_kv, shape["kv_heads"]),
                       (writer.add_layer_norm_rms_eps, 1e-5),
                       (writer.add_rope_freq_base, 500000.0),
                       (writer.add_rope_dimension_count, head_dim)):
        add(value)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = (f"<t{i}>" for i in range(shape["vocab"] - 2 - len(alphabet)))
    tokens = ["<s>", "</s>", *alphabet, *fillers]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))  # two control tokens
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, dims in tensor_shapes(shape).items():
        gguf_name, data, raw_dtype = gguf_tensor(name, dims, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_tensor(name: str, dims: tuple[int, ...], rng) -> tuple:
    """(GGUF name, data, raw_dtype) of one checkpoint tensor: projections as random Q4_K
    blocks, the embedding and head float16, norms float32 ones."""
    import gguf
    import numpy as np

    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        data = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)
        return ("token_embd" if "embed" in name else "output") + ".weight", data, None
    if name == "model.norm.weight":
        return "output_norm.weight", np.ones(dims, np.float32), None
    layer, leaf = name.split(".")[2], name.split(".")[-2]
    gguf_name = f"blk.{layer}.{GGUF_NAMES[leaf]}.weight"
    if len(dims) == 1:
        return gguf_name, np.ones(dims, np.float32), None
    values, size = Q4_K_BLOCK
    rows = rng.integers(0, 256, (dims[0], dims[1] // values * size), dtype=np.uint8)
    blocks = rows.reshape(-1, size)
    # weights about (scale * code - min * m) with 6-bit scale, min and 4-bit code: d near
    # 0.02 / (32 * 8), the spread of a 1 / sqrt(K) weight
    d = (rng.random(len(blocks), dtype=np.float32) * 1.6e-4).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = (d * 7.5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return gguf_name, rows, gguf.GGMLQuantizationType.Q4_K


# ---- the engine ----------------------------------------------------------------------------------


def bench_variant(path: Path, device: str, kv_dtype: str, batches: list[int], long_ctx: int,
                  steps: int, bandwidth: float, packed_row: bool = False,
                  fragments: bool = False) -> dict:
    """Steady decode tok/s at each batch (128-token prompts) and, with long_ctx, at batch 1
    after a long_ctx-token prompt; bytes per step and the roofline they allow."""
    from noesis import LLM
    from noesis.kv.cache import page_bytes
    from noesis.models import layers
    from noesis.quant import linear

    layers.PACKED_ONE_ROW = packed_row
    linear.INT4_FRAGMENTS = fragments
    t0 = time.perf_counter()
    gguf = {"gguf_weights": "packed"} if path.suffix == ".gguf" else {}
    llm = LLM(str(path), device=device, dtype="bfloat16", max_model_len=max(long_ctx, 128) + 512,
              max_num_seqs=max(batches), kv_cache_dtype=kv_dtype, progress=False, **gguf)
    engine = llm.engine
    model = engine.loaded.model
    # int4 fragments live in buffers (the stored parameters are freed once packed)
    weights = [*model.parameters(), *(b for name, b in model.named_buffers()
                                      if name.rsplit(".", 1)[-1].startswith("fragment_"))]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    embed = model.model.embed_tokens.weight
    read_bytes = weight_bytes - (embed.numel() * embed.element_size() if model.lm_head else 0)
    kv_per_token = page_bytes(engine.loaded.config, 1, engine.kv_dtype)
    result = {"ready_s": time.perf_counter() - t0, "capture_s": engine.timings["capture_s"],
              "attention": engine.runner.attention.name, "weight_bytes": weight_bytes,
              "step_weight_bytes": read_bytes, "kv_bytes_per_token": kv_per_token,
              "kv_pages": engine.kv.num_pages, "runs": {}}
    runs = [(f"batch {b}", b, 128) for b in batches] + ([("long", 1, long_ctx)] if long_ctx else [])
    for label, batch, prompt_len in runs:
        prompts = [prompt_ids(prompt_len, 100 + i) for i in range(batch)]
        graph_steps = engine.runner.step_counts["graph"]
        seconds, done, mean_ctx = steady_decode(engine, prompts, steps)
        graph_steps = engine.runner.step_counts["graph"] - graph_steps
        tok_s = batch * done / seconds
        step_bytes = read_bytes + batch * mean_ctx * kv_per_token
        roofline = batch * bandwidth / step_bytes
        result["runs"][label] = {"batch": batch, "prompt": prompt_len, "tok_s": tok_s,
                                 "mean_ctx": mean_ctx, "step_bytes": step_bytes,
                                 "roofline_tok_s": roofline, "share": tok_s / roofline,
                                 "graph_steps": graph_steps}
    return result


# ---- the kernel alone ----------------------------------------------------------------------------


def bench_kernels(shape: dict, device: str, bandwidth: float) -> dict:
    """M = 1 on the four projection shapes: torch's bf16 matmul vs the packed kernel (int4 AWQ
    group 128, int8 per channel), microseconds, bytes read and their share of the bandwidth,
    and the kernel's error against dequantize-then-matmul."""
    import torch.nn.functional as F

    from noesis.quant import kernel
    from noesis.quant.linear import dequantized_matmul

    # Triton 3.6's interpreter (the CPU smoke run) miscomputes this kernel in bf16; float16 is
    # the same code path there
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    results = {}
    for proj, dims in PROJECTIONS.items():
        n, k = dims(shape)
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, k, device=device, generator=gen).to(dtype)
        weight = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype)
        dense = timing(lambda x=x, w=weight: F.linear(x, w), weight.nbytes, device, bandwidth)
        row = {"bf16": dense}
        for label, bits, group in (("int4", 4, 128), ("int8", 8, k)):
            packed = random_packed(n, k, bits, group, device, gen, dtype)
            args = (*packed, None, bits, group)
            entry = timing(lambda x=x, a=args: kernel.packed_matmul(x, *a), packed_bytes(packed),
                           device, bandwidth)
            want = dequantized_matmul(x.float(), *(t.float() if t.is_floating_point() else t
                                                   for t in packed), None, bits, group)
            got = kernel.packed_matmul(x, *args).float()
            entry["rel_err"] = float((got - want).norm() / want.norm())
            entry["speedup_vs_bf16"] = row["bf16"]["us"] / entry["us"]
            row[label] = entry
        results[f"{proj} [{n}, {k}]"] = row
    return results


def random_packed(n: int, k: int, bits: int, group: int, device: str, gen, dtype):
    """(qweight [N, K/pack] int32, scales [N, G], zeros [N, G] in dtype) with random codes."""
    from noesis.quant.packing import pack

    codes = torch.randint(0, 1 << bits, (n, k), device=device, generator=gen)
    scales = torch.rand(n, k // group, device=device, generator=gen) * 0.02 / k**0.5
    zeros = torch.full((n, k // group), float(1 << (bits - 1)), device=device)
    return pack(codes, bits), scales.to(dtype), zeros.to(dtype)


def packed_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def timing(fn, num_bytes: int, device: str, bandwidth: float, repeats: int = 50) -> dict:
    """Microseconds per call, on CUDA replayed from a graph of `repeats` calls (no launch
    overhead, as inside the engine's graphs); bytes read per call and their share of the copy
    bandwidth."""
    fn()
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
    else:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        seconds = (time.perf_counter() - t0) / 3
    return {"us": seconds * 1e6, "bytes": num_bytes, "GBps": num_bytes / seconds / 1e9,
            "share_of_bandwidth": num_bytes / seconds / bandwidth}


# ---- the table -----------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, copy bandwidth {report['copy_bandwidth_TBps']:.2f} TB/s, "
          f"torch {report['torch']}, {report['versions']}")
    variants = report["variants"]
    base = variants.get("bf16", {}).get("runs", {})
    print(f"{'variant':<20}{'run':<10}{'tok/s':>9}{'x bf16':>8}{'weights GiB':>12}"
          f"{'read/step GiB':>14}{'roofline':>10}{'share':>7}")
    for name, r in variants.items():
        if "error" in r:
            print(f"{name:<20}failed: {r['error'][:90]}")
            continue
        for label, run in r["runs"].items():
            ref = base.get(label, {}).get("tok_s")
            ratio = f"{run['tok_s'] / ref:.2f}" if ref else "-"
            print(f"{name:<20}{label:<10}{run['tok_s']:>9.1f}{ratio:>8}"
                  f"{r['weight_bytes'] / 2**30:>12.2f}{run['step_bytes'] / 2**30:>14.2f}"
                  f"{run['roofline_tok_s']:>10.1f}{run['share']:>7.0%}")
    kernel = report["kernel"]
    if "error" in kernel:
        print(f"kernel: failed: {kernel['error'][:120]}")
        return
    print(f"\n{'kernel, M=1':<24}{'bf16 us':>9}{'int4 us':>9}{'x':>6}{'share':>7}"
          f"{'int8 us':>9}{'x':>6}{'share':>7}{'err4':>9}{'err8':>9}")
    for proj, row in kernel.items():
        b, i4, i8 = row["bf16"], row["int4"], row["int8"]
        print(f"{proj:<24}{b['us']:>9.1f}{i4['us']:>9.1f}{i4['speedup_vs_bf16']:>6.2f}"
              f"{i4['share_of_bandwidth']:>7.0%}{i8['us']:>9.1f}{i8['speedup_vs_bf16']:>6.2f}"
              f"{i8['share_of_bandwidth']:>7.0%}{i4['rel_err']:>9.1e}{i8['rel_err']:>9.1e}")


if __name__ == "__main__":
    main()
