"""GPU decode benchmark: noesis vs transformers on random bf16 checkpoints shaped like
Llama-3.2-1B and Llama-3.1-8B, against the copy-bandwidth roofline measured in the same run.

    python benchmarks/gpu_decode.py --shapes llama-1b,llama-8b --json out.json [--hf-compile]
    python benchmarks/gpu_decode.py --full --json out.json   # every column the issue asks for

Per shape: cold load and graph-capture time; batch-1 decode tok/s (128-token prompt, 256 new
tokens, greedy); time to first token for 128- and 2048-token prompts; GPU time and host overhead
per decode step; throughput at batch 8/32/64/128 against a roofline that counts weights plus KV
read per step; transformers eager (and, with --hf-compile, static cache + torch.compile).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import importlib.metadata
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_random_checkpoint import make_checkpoint  # noqa: E402

TIED = {"llama-1b": True, "llama-8b": False}
NEW_TOKENS = 256


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (the
    measurement `noesis bench` puts beside its table)."""
    from noesis.telemetry.bench import copy_bandwidth as measure

    return measure(torch.device("cuda"))


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (length,), generator=gen).tolist()


def bench_noesis(path: Path, bandwidth: float, batches: list[int]) -> dict:
    from noesis import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=128,
              progress=False)
    ready = time.perf_counter() - t0
    engine = llm.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())

    def run(prompts, new):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == new for o in outs)
        return elapsed

    p128, p2048 = prompt_ids(128), prompt_ids(2048, 1)
    run([p128], 8)
    ttft128 = statistics.median(run([p128], 1) for _ in range(5))
    ttft2048 = statistics.median(run([p2048], 1) for _ in range(3))
    total = statistics.median(run([p128], NEW_TOKENS) for _ in range(3))
    step_s = (total - ttft128) / (NEW_TOKENS - 1)
    engine.overlap = False  # the same, every step read back before the next is planned
    total_sync = statistics.median(run([p128], NEW_TOKENS) for _ in range(3))
    engine.overlap = True
    gpu_step_s = graph_step_seconds(engine)
    result = {
        "weight_bytes": weight_bytes,
        "ready_s": ready, "load_s": engine.timings["load_s"],
        "capture_s": engine.timings["capture_s"],
        "ttft_128_ms": ttft128 * 1e3, "ttft_2048_ms": ttft2048 * 1e3,
        "decode_tok_s": 1 / step_s, "step_ms": step_s * 1e3,
        "decode_tok_s_sync": (NEW_TOKENS - 1) / (total_sync - ttft128),
        "gpu_step_ms": gpu_step_s * 1e3, "host_overhead_ms": (step_s - gpu_step_s) * 1e3,
        "roofline_tok_s": bandwidth / weight_bytes,
        "buckets": bucket_profile(engine),
        "batches": {},
    }
    kv_per_token = 2 * engine.loaded.config.num_layers * engine.loaded.config.kv_size * 2
    for batch in batches:
        prompts = [prompt_ids(128, 100 + i) for i in range(batch)]
        first = run(prompts, 1)
        counts = dict(engine.runner.step_counts)
        full = run(prompts, NEW_TOKENS)
        graph_steps = engine.runner.step_counts["graph"] - counts["graph"]
        eager_steps = engine.runner.step_counts["eager"] - counts["eager"]
        entry = {"total_tok_s": batch * NEW_TOKENS / full,
                 "decode_tok_s_whole_runs": batch * (NEW_TOKENS - 1) / (full - first),
                 "graph_steps": graph_steps, "eager_steps": eager_steps}
        for overlap, key in ((True, ""), (False, "_sync")):
            engine.overlap = overlap
            seconds, steps, mean_ctx = steady_decode(engine, prompts)
            step_bytes = weight_bytes + batch * mean_ctx * kv_per_token
            roofline = batch * bandwidth / step_bytes
            entry[f"decode_tok_s{key}"] = batch * steps / seconds
            entry[f"share_of_roofline{key}"] = batch * steps / seconds / roofline
            entry["roofline_tok_s"], entry["mean_ctx"] = roofline, mean_ctx
        engine.overlap = True
        result["batches"][batch] = entry
    return result


def steady_decode(engine, prompts: list[list[int]], steps: int = 192) -> tuple[float, int, float]:
    """Decode throughput once every sequence is decoding: (seconds, steps, mean context) over
    `steps` engine steps after all prefills are done, each step one token per sequence."""
    from noesis import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in running):
        engine.step()
    for _ in range(3):  # past the steps that still mix in the last prefill chunk
        engine.step()
    start_ctx = statistics.mean(s.num_computed for s in running)
    assert len(running) == len(prompts) and min(s.max_len - s.num_tokens for s in running) > steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds, steps, start_ctx + steps / 2


def bucket_profile(engine) -> dict:
    """GPU ms of one graph replay and of greedy sampling, per captured batch bucket."""
    from noesis.sampling.sampler import SamplingTensors, sample

    graphs = engine.runner.graphs
    profile = {}
    for batch, graph in sorted(graphs.graphs.items()):
        replay = event_time(graph.replay)
        logits = graphs.logits[batch]
        sampling = event_time(lambda logits=logits: sample(logits, SamplingTensors.greedy()))
        profile[batch] = {"replay_ms": replay * 1e3, "greedy_sample_ms": sampling * 1e3}
    return profile


def event_time(fn, repeats: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_step_seconds(engine) -> float:
    """GPU time of one batch-1 decode graph replay (median over many, timed with events)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return float("nan")
    graph = graphs.graphs[1]
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[5:])


def bench_transformers(path: Path, compile_: bool, batches: list[int] = (),
                       device: str = "cuda") -> dict:
    """transformers' own generate on the same checkpoint: batch-1 decode tok/s, TTFT at 128 and
    2,048 prompt tokens, decode throughput at `batches` (128-token prompts, 256 new tokens)."""
    import transformers

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device).eval()
    load = time.perf_counter() - t0
    kwargs = {"do_sample": False, "pad_token_id": 0}
    if compile_:  # a static cache makes transformers compile the forward itself
        kwargs["cache_implementation"] = "static"

    def run(prompts, new):
        ids = torch.tensor(prompts, device=device)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync()
        assert out.shape == (len(prompts), len(prompts[0]) + new)
        return time.perf_counter() - start

    def timed(prompts, new, repeats=1):
        # A static cache is sized by the batch and the generation's length, so each new shape
        # compiles again (the first session's 10.6 tok/s "static+compile" figure timed such a
        # recompilation): every shape runs once untimed first.
        run(prompts, new)
        return statistics.median(run(prompts, new) for _ in range(repeats))

    p128, p2048 = [prompt_ids(128)], [prompt_ids(2048, 1)]
    t0 = time.perf_counter()
    run(p128, 8)
    first_result = time.perf_counter() - t0
    ttft = timed(p128, 1, 3)
    result = {"load_s": load, "first_result_s": first_result, "ttft_128_ms": ttft * 1e3,
              "decode_tok_s": (NEW_TOKENS - 1) / (timed(p128, NEW_TOKENS) - ttft),
              "batches": {}}
    print(f"transformers {'static+compile' if compile_ else 'eager'} batch 1:",
          json.dumps(result), flush=True)  # a call cut off at its time limit keeps what is done
    for batch in batches:
        prompts = [prompt_ids(128, 100 + i) for i in range(batch)]
        first, full = timed(prompts, 1), timed(prompts, NEW_TOKENS)
        result["batches"][batch] = {"decode_tok_s": batch * (NEW_TOKENS - 1) / (full - first),
                                    "total_tok_s": batch * NEW_TOKENS / full}
        print(f"  batch {batch}:", json.dumps(result["batches"][batch]), flush=True)
    # Last: transformers sizes a static cache for the longest generation it has run (sparing a
    # recompile), so every run after this one would attend over 2,049 slots instead of 384. The
    # fifth session's (2026-11-23) static+compile decode figures were taken that way, after it.
    result["ttft_2048_ms"] = timed(p2048, 1, 3) * 1e3
    print("  TTFT 2048:", result["ttft_2048_ms"], flush=True)
    return result


def library_versions() -> dict:
    """The versions a reader needs to compare figures across runs (None: not installed)."""
    versions = {}
    for name in ("triton", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def guarded(fn, *args, **kwargs) -> dict:
    """A reference engine that fails is reported as failed; the rest of the run goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the reference is data
        print(f"{fn.__name__}{args}: {type(exc).__name__}: {exc}"[:500], flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'LABEL:module.ATTR=value,...' (a --variant) -> (LABEL, {"module.ATTR": "value"})."""
    label, _, settings = text.partition(":")
    # split at each comma that starts the next "module.ATTR=" (values may hold commas)
    pairs = [item.split("=", 1) for item in re.split(r",(?=[\w.]+=)", settings) if item]
    if not label or not pairs or any(len(pair) != 2 or "." not in pair[0] for pair in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: want LABEL:module.ATTR=value,...")
    return label, dict(pairs)


@contextlib.contextmanager
def attributes_set(settings: dict[str, str]):
    """Module attributes set for the duration (values are Python literals), then restored: the
    same call's A/B of a switch such as noesis.kernels.ops.PREFETCH_O."""
    saved = []
    try:
        for target, value in settings.items():
            module_name, _, attr = target.rpartition(".")
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, ast.literal_eval(value))
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def release_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


FULL_BATCHES = "8,32,64,128"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="the whole comparison: noesis and transformers (eager and static "
                        f"+ compile) at batch 1 and {FULL_BATCHES}, on every shape (on an H200 "
                        "about 15 minutes for both shapes, most of it transformers compiling)")
    parser.add_argument("--shapes", default="llama-1b,llama-8b")
    parser.add_argument("--batches", default="8,32,64,128", help="comma list; empty for none")
    parser.add_argument("--hf-compile", default="", help="shapes to also run with torch.compile")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-hf-eager", action="store_true",
                        help="run transformers only with static cache + compile (--hf-compile)")
    parser.add_argument("--hf-batches", default="",
                        help="batches to also run through transformers (each compiles again)")
    parser.add_argument("--blas", choices=["cublas", "cublaslt"],
                        help="torch's preferred BLAS library for the projections (experiment)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench"))
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "gpu_decode.json")
    args = parser.parse_args(argv)
    if args.full:
        if args.no_hf or args.no_hf_eager:
            parser.error("--full runs transformers eager and compiled; drop --no-hf*")
        args.batches = args.hf_batches = FULL_BATCHES
        args.hf_compile = args.shapes
    return args


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    bandwidth = copy_bandwidth()
    from noesis.kernels import ops, pdl

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "versions": library_versions(),
              "copy_bandwidth_TBps": bandwidth / 1e12,
              # the batch-1 kernel paths in use (NOESIS_ONE_ROW_FUSION, NOESIS_PDL)
              "kernels": {"one_row_gemv": ops.ONE_ROW_GEMV, "one_row_fusion": ops.ONE_ROW_FUSION,
                          "pdl": pdl.PDL},
              "shapes": {}}
    print(f"{report['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        path = make_checkpoint(args.workdir / shape, shape, "bfloat16", 8192, 0, TIED[shape],
                               "cuda")
        print(f"{shape}: checkpoint written in {time.perf_counter() - t0:.1f}s", flush=True)
        entry = {"noesis": bench_noesis(path, bandwidth, batches)}
        release_memory()
        print(json.dumps(entry["noesis"], indent=1), flush=True)
        if not args.no_hf and not args.no_hf_eager:
            entry["transformers eager"] = guarded(bench_transformers, path, False, hf_batches)
            print("transformers eager", json.dumps(entry["transformers eager"]), flush=True)
            release_memory()
        if not args.no_hf and shape in args.hf_compile.split(","):
            entry["transformers static+compile"] = guarded(bench_transformers, path, True,
                                                           hf_batches)
            print("transformers static+compile",
                  json.dumps(entry["transformers static+compile"]), flush=True)
            release_memory()
        report["shapes"][shape] = entry
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print_table(report)


def print_table(report: dict) -> None:
    bw = report["copy_bandwidth_TBps"]
    versions = "".join(f", {name} {v}" for name, v in report.get("versions", {}).items() if v)
    print(f"\n{report['device']}, copy bandwidth {bw:.2f} TB/s, torch {report['torch']}"
          f"{versions}, batch-1 kernels {report.get('kernels')}")
    print(f"{'shape':<10}{'engine':<30}{'tok/s b1':>10}{'roofline':>10}{'share':>7}"
          f"{'TTFT128':>9}{'TTFT2048':>10}{'load+cap s':>11}")
    for shape, entry in report["shapes"].items():
        roof = entry["noesis"]["roofline_tok_s"]
        for name, r in entry.items():
            if "error" in r:
                print(f"{shape:<10}{name:<30}failed: {r['error'][:60]}")
                continue
            ttft2k = f"{r['ttft_2048_ms']:.1f}" if "ttft_2048_ms" in r else "-"
            setup = r.get("ready_s", r.get("first_result_s", r["load_s"]))
            print(f"{shape:<10}{name:<30}{r['decode_tok_s']:>10.1f}{roof:>10.0f}"
                  f"{r['decode_tok_s'] / roof:>7.0%}{r['ttft_128_ms']:>9.1f}{ttft2k:>10}"
                  f"{setup:>11.1f}")
        n = entry["noesis"]
        print(f"{'':<10}noesis step: {n['step_ms']:.3f} ms = GPU {n['gpu_step_ms']:.3f} + host "
              f"{n['host_overhead_ms']:.3f}; load {n['load_s']:.1f}s, "
              f"capture {n['capture_s']:.1f}s; without overlapped steps "
              f"{n['decode_tok_s_sync']:.1f} tok/s")
        buckets = n.get("buckets", {})
        print(f"{'':<10}graph replay ms by bucket: " + ", ".join(
            f"{b}: {v['replay_ms']:.2f}+{v['greedy_sample_ms']:.2f}" for b, v in buckets.items()))
        for batch, b in n["batches"].items():
            print(f"{'':<10}batch {batch:>3}: decode {b['decode_tok_s']:>8.0f} tok/s "
                  f"({b['share_of_roofline']:.0%} of {b['roofline_tok_s']:.0f} at "
                  f"{b['mean_ctx']:.0f} tokens), without overlap {b['decode_tok_s_sync']:.0f} "
                  f"({b['share_of_roofline_sync']:.0%}); whole 256-token runs: decode "
                  f"{b['decode_tok_s_whole_runs']:.0f}, end-to-end {b['total_tok_s']:.0f} "
                  f"tok/s, steps graph/eager "
                  f"{b.get('graph_steps', '?')}/{b.get('eager_steps', '?')}")
        for name, r in entry.items():
            for batch, b in r.get("batches", {}).items() if name != "noesis" else ():
                print(f"{'':<10}{name} batch {batch:>3}: decode {b['decode_tok_s']:>8.0f} "
                      f"tok/s (whole 256-token runs), end-to-end {b['total_tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
