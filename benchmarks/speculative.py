"""Speculative decoding benchmark: the draft and n-gram proposers against plain decoding, measured
in the same run, at batch 1 and 8, on the bundled pair (real acceptance) or any target/draft pair
that shares a tokenizer.

    python benchmarks/speculative.py --json spec.json                 # bundled pair, CUDA
    python benchmarks/speculative.py --model PATH --draft DRAFT --json spec.json
    python benchmarks/speculative.py --device cpu --new-tokens 12 --batches 1,2 --repeats 1

Per (method, batch): greedy tokens/s over `--new-tokens` new tokens per request (EOS ignored), the
speedup over plain decoding at that batch, the acceptance rate (accepted / proposed tokens), the
tokens each verify row emitted, and how many requests came out token-identical to plain decoding
(always all of them in float32; in half precision a near-tie may flip where the verify and decode
kernels round differently). The workloads: `text` (prose prompts) and `edit` (a passage given
twice, so the continuation repeats it: prompt lookup's case). On CUDA verify steps replay the
target's decode graphs (one graph row per verified position) and the draft's proposal steps its
own graphs; `graph` counts the timed steps with verify rows that replayed / ran eagerly. Unless
--max-batch is given, speculation pauses while a verify step would not fit the graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLED, BUNDLED_DRAFT = ROOT / "models" / "noesis-tiny", ROOT / "models" / "noesis-tiny-draft"
TEXT = [
    "Once upon a time, the little robot",
    "A week has seven days. A year",
    "The ocean is salty, but most rivers",
    "To convert miles to kilometres,",
    "The capital of France is",
    "A square has four equal sides. A triangle",
    "In the morning the baker",
    "Water boils at one hundred degrees",
]
PASSAGE = (
    "The committee met on Tuesday to review the budget. It approved the new library, "
    "delayed the road repairs until spring, and asked for a report on the school buses."
)


def prompts_for(tokenizer, workload: str, count: int) -> list[list[int]]:
    if workload == "edit":
        texts = [
            f"{PASSAGE}\nRewrite it word for word:\n{PASSAGE[: 20 + 7 * i]}" for i in range(count)
        ]
    else:
        texts = [TEXT[i % len(TEXT)] for i in range(count)]
    return [tokenizer.encode(text) for text in texts]


def load(args, speculative):
    from noesis import LLM

    options = dict(max_model_len=args.max_model_len, max_num_seqs=max(args.batches), progress=False)
    if speculative is not None:
        options["speculative"] = speculative
    return LLM(args.model, device=args.device, dtype=args.dtype, **options)


def timed(llm, prompts, params, repeats: int):
    """(median seconds, outputs of the last run, speculation counters of the timed runs) of
    generating for `prompts`, after one warm-up run."""
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    llm.generate(prompts, params)
    before = {**llm.engine.spec_counts, **verify_counts(llm)}
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - start)
    after = {**llm.engine.spec_counts, **verify_counts(llm)}
    counts = {k: v - before[k] for k, v in after.items()}
    return statistics.median(times), outs, counts


def verify_counts(llm) -> dict:
    """Steps with verify rows that replayed a graph or ran eagerly."""
    return {f"verify_{how}": n for how, n in llm.engine.runner.verify_counts.items()}


def measure(args, method: str, speculative, reference: dict) -> list[dict]:
    """One engine for `method`, every workload and batch size; `reference` holds plain's
    (seconds, tokens) per (workload, batch), measured first."""
    from noesis import SamplingParams

    llm = load(args, speculative)
    params = SamplingParams(
        temperature=args.temperature, seed=0, max_tokens=args.new_tokens, ignore_eos=True
    )
    rows = []
    for workload in args.workloads.split(","):
        for batch in args.batches:
            prompts = prompts_for(llm.tokenizer, workload, batch)
            seconds, outs, counts = timed(llm, prompts, params, args.repeats)
            tokens = [o.token_ids for o in outs]
            if method == "off":
                reference[workload, batch] = (seconds, tokens)
            plain_seconds, plain_tokens = reference[workload, batch]
            identical = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
            rows.append(row(method, workload, batch, seconds / plain_seconds, counts, identical))
            rows[-1]["tok_s"] = batch * args.new_tokens / seconds
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def row(method, workload, batch, time_ratio, counts, identical) -> dict:
    proposed, accepted = counts.get("proposed", 0), counts.get("accepted", 0)
    verify_rows = counts.get("verify_rows", 0)
    return {
        "method": method,
        "workload": workload,
        "batch": batch,
        "speedup": 1 / time_ratio,
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_verify": (accepted + verify_rows) / verify_rows if verify_rows else None,
        "identical": f"{identical}/{batch}",
        "verify_graph": f"{counts.get('verify_graph', 0)}/{counts.get('verify_eager', 0)}",
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'workload':<9}{'method':<8}{'batch':>6}{'tok/s':>10}{'speedup':>9}"
        f"{'accept':>9}{'tok/verify':>11}{'identical':>11}{'graph':>11}"
    )
    lines = [head]
    for r in rows:
        rate = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        per = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        lines.append(
            f"{r['workload']:<9}{r['method']:<8}{r['batch']:>6}{r['tok_s']:>10.1f}"
            f"{r['speedup']:>8.2f}x{rate:>9}{per:>11}{r['identical']:>11}{r['verify_graph']:>11}"
        )
    return "\n".join(lines)


def configs(args) -> dict:
    from noesis import SpeculativeConfig

    common = dict(k=args.k, max_batch=args.max_batch)
    found = {"off": None, "ngram": SpeculativeConfig(method="ngram", **common)}
    if args.draft:
        found["draft"] = SpeculativeConfig(method="draft", draft=args.draft, **common)
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(BUNDLED))
    parser.add_argument(
        "--draft",
        help="draft checkpoint (default: the bundled draft for the "
        "bundled model; none otherwise: only ngram is measured)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=4, help="most proposals per step (default 4)")
    parser.add_argument("--batches", default="1,8", help="comma-separated (default 1,8)")
    parser.add_argument(
        "--max-batch", type=int, help="SpeculativeConfig.max_batch (default: no limit)"
    )
    parser.add_argument("--workloads", default="text,edit")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", help="also write the rows and the run's setup here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.draft is None and Path(args.model).resolve() == BUNDLED:
        args.draft = str(BUNDLED_DRAFT)
    rows, reference = [], {}
    for method, speculative in configs(args).items():  # "off" first: the others compare to it
        rows += measure(args, method, speculative, reference)
    rows.sort(key=lambda r: (r["workload"], r["batch"]))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(
        f"speculative decoding: {args.model} (draft {args.draft}), {device}, k={args.k}, "
        f"{args.new_tokens} new tokens, temperature {args.temperature}"
    )
    print(table(rows))
    report = {
        "model": args.model,
        "draft": args.draft,
        "device": device,
        "k": args.k,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
