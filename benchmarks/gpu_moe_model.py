"""Whole MoE checkpoints on the lent GPU (issue 17): random weights in the gpt-oss-20b shape
(experts stored MXFP4, as released) and the Qwen3-30B-A3B shape (bf16), decoded by noesis (CUDA
graphs) and by transformers on the same files, at batch 1 and 64.

The roofline counts the bytes a decode step reads: every weight but the embedding table (its
rows are gathered), the routed experts only (at batch 1 exactly top-k per layer; at larger
batches the expected number of distinct experts under uniform routing, E (1 - (1 - k/E)^B),
which random routers approximate), and the KV cache at the mean context; over the copy
bandwidth measured in the same run.

    python benchmarks/gpu_moe_model.py --shape gpt-oss-20b --json out.json
    python benchmarks/gpu_moe_model.py --shape qwen3-30b-a3b --layers 24 --json out.json

--old-moe FILE adds rows with the experts kernels of another moe_triton.py (a previous
commit's), the same call's "before" for a kernel change; one from before the fragment layout
(kernels/mxfp4_mma.py) runs on MXFP4 experts left in the stored layout.

--layers keeps the real widths with fewer layers (the full Qwen3-30B-A3B, 61 GB in bf16, does
not fit the lent machine's disk beside anything else); the table says how many ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_decode import (  # noqa: E402
    attributes_set,
    copy_bandwidth,
    guarded,
    library_versions,
    parse_variant,
    prompt_ids,
    release_memory,
    steady_decode,
)
from make_random_checkpoint import random_tensor, write_tokenizer, write_weights  # noqa: E402

SHAPES = {
    "gpt-oss-20b": ("GptOssConfig", True, dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, sliding_window=128)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", False, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True,
        rope_theta=1e6)),
}  # fmt: skip
STEPS = 64  # timed decode steps per run
PROMPT = 128  # prompt tokens (--prompt)


def main() -> None:
    global PROMPT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--layers", type=int, help="fewer layers than the real model")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--unfused", action="store_true",
                        help="also time noesis at batch 1 with the fused one-row blocks off")
    parser.add_argument("--old-moe", type=Path,
                        help="also time noesis at batch 1 with the experts kernels of this "
                        "moe_triton.py (e.g. `git show REV:src/noesis/kernels/moe_triton.py`)")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        metavar="LABEL:module.ATTR=value,...",
                        help="also time noesis with these module attributes set (repeatable; "
                        "e.g. 'prefetch:noesis.kernels.ops.PREFETCH_O=True')")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the default and the variants this many times, interleaved")
    parser.add_argument("--prompt", type=int, default=128,
                        help="prompt tokens before the timed decode (noesis only; long "
                        "contexts time the attention, sliding windows included)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench-moe"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    PROMPT = args.prompt
    bandwidth = copy_bandwidth()
    path = args.workdir / args.shape
    t0 = time.perf_counter()
    config = write_checkpoint(path, args.shape, args.layers)
    print(f"{args.shape}: checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth,
              "torch": torch.__version__, "versions": library_versions(), "shape": args.shape,
              "layers": config.num_hidden_layers}  # fmt: skip
    report["noesis"] = guarded(bench_noesis, path, bandwidth, batches)
    release_memory()
    report["variants"] = []
    for run in range(args.repeat):
        for label, settings in args.variant:
            with attributes_set(settings):
                result = guarded(bench_noesis, path, bandwidth, batches, label=label)
            report["variants"].append(dict(result, label=label, settings=settings))
            release_memory()
        if run + 1 < args.repeat:
            result = guarded(bench_noesis, path, bandwidth, batches, label="default, again")
            report["variants"].append(dict(result, label="default, again"))
            release_memory()
    if args.unfused:
        report["noesis_unfused"] = guarded(bench_noesis, path, bandwidth, [1],
                                           one_row_fusion=False)  # fmt: skip
        release_memory()
    if args.old_moe:
        report["noesis_old_moe"] = guarded(_with_old_experts, args.old_moe, path, bandwidth,
                                           batches)  # fmt: skip
        report["old_moe"] = str(args.old_moe)
        release_memory()
    args.json.write_text(json.dumps(report, indent=1))
    if not args.no_hf:
        report["transformers"] = guarded(bench_transformers, path, batches, SHAPES[args.shape][1])
        args.json.write_text(json.dumps(report, indent=1))
    print_table(report)


def _with_old_experts(module_path: Path, path: Path, bandwidth: float, batches) -> dict:
    """bench_noesis with noesis.kernels.moe_triton swapped for another file's (the
    engine looks the module up on the package at each call)."""
    from moe_gemv_sweep import load_module

    import noesis.kernels as kernels
    from noesis.weights import mxfp4

    saved = kernels.moe_triton, mxfp4.fragment_experts
    kernels.moe_triton = load_module(module_path)
    if not hasattr(kernels.moe_triton, "frag_gemv"):  # from before the fragment layout
        mxfp4.fragment_experts = lambda model: 0  # experts stay in the stored layout
    try:
        return bench_noesis(path, bandwidth, batches)
    finally:
        kernels.moe_triton, mxfp4.fragment_experts = saved


def write_checkpoint(out: Path, shape: str, layers: int | None, device: str = "cuda", **sizes):
    """config.json, a small tokenizer and random weights named as the released checkpoints
    name them; MXFP4 experts as `{name}_blocks` [E, out, in / 32, 16] and `{name}_scales` [E,
    out, in / 32]. `sizes` override the shape's config (tests shrink it)."""
    import transformers

    config_class, mxfp4, overrides = SHAPES[shape]
    overrides = dict(overrides, bos_token_id=0, eos_token_id=1, pad_token_id=0,
                     tie_word_embeddings=False, max_position_embeddings=4096, **sizes)  # fmt: skip
    if layers:
        overrides["num_hidden_layers"] = layers
    config = getattr(transformers, config_class)(**overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in [n for n in shapes if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacked = shapes.pop(name)
        if mxfp4:  # gpt-oss: [E, in, out] as MXFP4 blocks and scales over `in`
            experts, cols, rows = stacked
            shapes[f"{name}_blocks"] = (experts, rows, cols // 32, 16)
            shapes[f"{name}_scales"] = (experts, rows, cols // 32)
        else:  # Qwen3-MoE's released layout: a key per expert and projection, [out, in]
            prefix, _, proj = name.rpartition(".")
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            rows = stacked[1] // len(parts)
            for e in range(stacked[0]):
                for part in parts:
                    shapes[f"{prefix}.{e}.{part}.weight"] = (rows, stacked[2])
    out.mkdir(parents=True, exist_ok=True)
    saved = config.to_dict()
    if mxfp4:
        saved["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    write_tokenizer(out, config.vocab_size)
    write_weights(out, shapes, torch.bfloat16, 0, device, draw=_draw)
    return config


def _draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    """MXFP4 codes uniform and exponents near 2^-6 (gpu_moe.py's), the rest as the dense
    benchmarks draw them."""
    if name.endswith(("_blocks", "_scales")):
        low, high = (0, 256) if name.endswith("_blocks") else (119, 123)
        return torch.randint(low, high, shape, dtype=torch.uint8, generator=gen,
                             device=gen.device).cpu()  # fmt: skip
    return random_tensor(name, shape, dtype, gen)


def bench_noesis(path: Path, bandwidth: float, batches: list[int], label: str = "",
                 **options) -> dict:
    from noesis import LLM

    t0 = time.perf_counter()
    llm = LLM(str(path), device="cuda", dtype="bfloat16",
              max_model_len=max(2048, PROMPT + STEPS + 64),
              max_num_seqs=max(batches), progress=False, **options)  # fmt: skip
    engine = llm.engine
    ready = time.perf_counter() - t0
    config = engine.loaded.config
    moe = config.moe
    dense = expert = 0
    model = engine.loaded.model
    expert_buffers = [(n, b) for n, b in model.named_buffers() if ".experts." in n]
    for name, param in [*model.named_parameters(), *expert_buffers]:  # buffers: MXFP4 fragments
        if ".experts." in name:
            expert += param[0].nbytes  # one expert of each layer's stacked tensors
        elif "embed" not in name:
            dense += param.nbytes
    kv_per_token = 2 * config.num_layers * config.kv_size * 2
    result = {"ready_s": ready, "dense_bytes": dense, "expert_bytes_all_layers": expert,
              "batches": {}}  # fmt: skip
    for batch in batches:
        prompts = [prompt_ids(PROMPT, 100 + i) for i in range(batch)]
        seconds, steps, mean_ctx = steady_decode(engine, prompts, STEPS)
        k, e = moe.top_k, moe.num_experts
        distinct = k if batch == 1 else e * (1 - (1 - k / e) ** batch)
        step_bytes = dense + distinct * expert + batch * mean_ctx * kv_per_token
        tok_s = batch * steps / seconds
        roofline = batch * bandwidth / step_bytes
        result["batches"][batch] = {"tok_s": tok_s, "step_bytes": step_bytes,
                                    "distinct_experts": distinct, "roofline_tok_s": roofline,
                                    "share": tok_s / roofline,
                                    "graph_steps": engine.runner.step_counts["graph"]}  # fmt: skip
        print(f"noesis {label or options or ''} batch {batch}:",
              json.dumps(result["batches"][batch]), flush=True)  # fmt: skip
    return result


def bench_transformers(path: Path, batches: list[int], mxfp4: bool) -> dict:
    """transformers' generate on the same files (MXFP4 experts dequantized to bf16 at load, its
    path without the `kernels` package): decode tok/s from 33-token minus 1-token runs."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config._experts_implementation = "grouped_mm"
    extra = {"quantization_config": transformers.Mxfp4Config(dequantize=True)} if mxfp4 else {}
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.bfloat16, device_map="cuda", **extra).eval()
    result = {"load_s": time.perf_counter() - t0, "batches": {}}

    def run(batch: int, new: int) -> float:
        ids = torch.tensor([prompt_ids(128, 100 + i) for i in range(batch)], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for batch in batches:
        run(batch, 2)  # warm-up
        first, full = run(batch, 1), run(batch, 33)
        result["batches"][batch] = {"tok_s": batch * 32 / (full - first)}
        print(f"transformers batch {batch}:", json.dumps(result["batches"][batch]), flush=True)
    return result


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, copy bandwidth {report['bandwidth'] / 1e12:.2f} TB/s, torch "
          f"{report['torch']}, {report['versions']}; {report['shape']}, "
          f"{report['layers']} layers")  # fmt: skip
    print("| batch | noesis tok/s | transformers tok/s | x transformers | GB read per step "
          "| roofline tok/s | share of roofline |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    ours = report["noesis"].get("batches", {})
    theirs = report.get("transformers", {}).get("batches", {})
    unfused = report.get("noesis_unfused", {}).get("batches", {})
    rows = [(str(b), r) for b, r in ours.items()]
    rows += [(f"{b}, one-row fusion off", r) for b, r in unfused.items()]
    for variant in report.get("variants", []):
        rows += [(f"{b}, {variant['label']}", r) for b, r in variant.get("batches", {}).items()]
    old = report.get("noesis_old_moe", {}).get("batches", {})
    rows += [(f"{b}, experts of {Path(report['old_moe']).name}", r) for b, r in old.items()]
    for label, row in rows:
        hf = theirs.get(int(label.split(",")[0]), {}).get("tok_s")
        ratio = f"{row['tok_s'] / hf:.2f}x" if hf else "-"
        print(f"| {label} | {row['tok_s']:.1f} | {hf or 0:.1f} | {ratio} | "
              f"{row['step_bytes'] / 1e9:.2f} | {row['roofline_tok_s']:.1f} | "
              f"{row['share']:.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
