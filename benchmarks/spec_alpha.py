"""Acceptance-controlled speculative decoding benchmark (issue 14, proofs (2) and (3)): the 8B Llama
shape with a 1B-shaped draft, random weights, acceptance set by an oracle, measured speedup next to
the speedup the measured step costs predict.

    python benchmarks/spec_alpha.py --json spec_alpha.json      # H100: builds both checkpoints
    python benchmarks/spec_alpha.py --smoke                     # CPU, bundled tiny pair, < 60 s

How it works. A plain (non-speculative) engine first runs every prompt greedily: the plain
timings, and per batch size the step time. Then one speculative engine (draft method,
adaptive=False so the depth is k, no entropy cut) serves every speculative row: its Speculator's
`config` is swapped for each k (graphs are captured once, for the largest k) and its `proposer`
for an `Oracle` wrapping the real proposer. The oracle runs the real proposer first (so its cost
is real; its tokens are then discarded) and proposes, per position independently, the target's
own greedy token with probability alpha (seeded generator), otherwise a different token.
Verification is the engine's own (greedy). The target's greedy tokens (the reference, by
position) come from a run of the same engine at the same k whose oracle proposes only wrong
tokens, so that they are computed by the verify step's kernels (see `verify_reference`: a
plain decode's differ in rounding, and a random model's greedy tokens are near-ties; the JSON's
`reference_leaves_plain_at` says where the two greedy continuations first differ).

Every timed run finds its prompt's prefix in the target's prefix cache (an untimed run of the
same prompt came first in each engine); a draft model has no prefix cache and feeds the prompt.

Rows (batch 1 unless said; speedup = plain seconds / speculative seconds for the same prompts):
- `plain`: no speculation.
- `draft` alpha, k: the oracle over the 1B draft at nominal alpha and depth k.
  `alpha~` is the measured acceptance, accepted / tested proposals (a verify that accepts a of n
  tested a + 1 when a < n, else n): the engine's own estimator of the per-token alpha.
  `agree` counts verifies whose accepted length was exactly the oracle's correct prefix (below
  100% only where greedy speculative output left the reference: a half-precision near-tie).
  `predicted` = E / (k * c_draft + c_verify(k)), E = (1 - alpha^(k+1)) / (1 - alpha) (nominal
  alpha): c_draft = draft ms per drafted token / plain ms per step, the draft's time measured
  in this row around each propose call (CUDA events; it includes the draft's history feed, which
  here re-feeds the accepted tokens because the oracle's tokens are not the draft's own, a few
  graph rows more than a real draft feeds); c_verify(k) = the plain engine's step time at batch
  k + 1 / its step time at batch 1 (a verify step runs k + 1 graph rows of one sequence, which
  costs what k + 1 one-token rows cost), each the median interval between engine steps in the
  decode phase. What the prediction leaves out (the verify's sampling, the proposal's host
  work, the step that cannot overlap the next one's planning) is the gap to the measured speedup.
- `--draft-variants` (default `16`: the draft as built): one set of batch-1 rows per variant,
  `BITS[:VOCAB]`: `4` the draft quantized to int4 by `noesis quantize` (group 128; written to
  <tempdir>/noesis-bench/<draft name>-int4, and reused from there when present), `8` int8;
  `:VOCAB` its LM head cut to VOCAB rows (SpeculativeConfig.draft_vocab). E.g. `16,4,4:32768`.
  The oracle makes alpha independent of the draft's quality, so the rows differ in draft cost
  only. The large-batch and lookup rows run with the first variant.
- batch `--large-batch` (64): plain and two oracle rows. Speculation should pause itself there
  (the verify step would not fit the captured graphs): `proposed` = 0 and speedup ~1.
- `ngram` (workload `edit`: a code listing, then a request to rewrite it with one identifier
  renamed, then the rewrite's start): the engine's prompt lookup with its default adaptive
  depth, judged by the random target, which does not copy: honest, and expected to show the
  back-off keeping it at plain speed.
- `lookup` alpha: the oracle over prompt lookup (its lookups run, their cost is host-only) at
  k=4 with alpha = `lookup_alpha`, the acceptance prompt lookup reaches on this workload when the
  output is the correct rewrite: the engine's NgramProposer replayed (host only, no model) over
  the prompt and the exactly renamed listing, each step's proposals checked against it as
  greedy verification would. The oracle proposes on every step (the replay also counts the
  steps where the lookup found nothing: `lookup_hit_rate` in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY, TINY_DRAFT = ROOT / "models" / "noesis-tiny", ROOT / "models" / "noesis-tiny-draft"
ALPHAS = (0.5, 0.65, 0.8, 0.9)
DEPTHS = tuple(range(2, 9))
LOOKUP_K = 4
PROMPT = (
    "The engine reads the weights once and keeps them resident. Each step schedules a batch, "
    "runs the model and samples on the device, then the host turns the tokens into text."
)
CODE = """def summarize(orders, tax_rate):
    total = 0.0
    count = 0
    for order in orders:
        if order.cancelled:
            continue
        total += order.price * order.quantity
        count += 1
    if count == 0:
        return {"total": 0.0, "count": 0, "average": 0.0}
    total = total * (1.0 + tax_rate)
    average = total / count
    return {"total": round(total, 2), "count": count, "average": round(average, 2)}


def largest(orders):
    best = None
    for order in orders:
        total = order.price * order.quantity
        if best is None or total > best[1]:
            best = (order.id, total)
    return best
"""
RENAME = ("total", "amount")


# ---------------------------------------------------------------- the oracle


@dataclass
class Oracle:
    """Proposer wrapper: runs `inner` (its cost is real), then proposes per request its
    reference tokens, each right with probability `alpha`. `references`: request id -> the
    target's greedy tokens (prompt then output), indexed by position."""

    inner: object
    references: dict[str, list[int]]
    alpha: float
    vocab_size: int
    seed: int = 0
    timer: StepTimer = None
    planted: dict[str, list[int]] = field(default_factory=dict)  # id -> correct prefix lengths
    diverged: set = field(default_factory=set)  # requests whose history left the reference

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def propose(self, request_ids, histories, depths, sampling=None):
        with self.timer.span():
            inner = self.inner.propose(request_ids, histories, depths, sampling)
        device = inner.proposed.device
        k = max(depths, default=0)
        rows = [
            self._row(rid, hist, depth, k)
            for rid, hist, depth in zip(request_ids, histories, depths, strict=True)
        ]
        return type(inner)(_on(rows, device), _on(list(depths), device))

    def _row(self, request_id, history, depth, k) -> list[int]:
        reference = self.references[request_id]
        if list(history) != reference[: len(history)]:
            self.diverged.add(request_id)
        tokens, correct = [], None
        for position in range(len(history), len(history) + depth):
            target = reference[position] if position < len(reference) else 0
            if self.rng.random() < self.alpha:
                tokens.append(target)
            else:
                tokens.append(
                    (target + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                )
                correct = len(tokens) - 1 if correct is None else correct
        if depth:
            self.planted.setdefault(request_id, []).append(depth if correct is None else correct)
        return tokens + [0] * (k - depth)

    def release(self, request_id) -> None:
        self.inner.release(request_id)


def _on(values: list, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class StepTimer:
    """Times spans on the device: CUDA events read after the run (no sync while it runs), or
    the host clock on CPU, where work is synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs, self.seconds = [], []

    def span(self):
        timer = self

        class _Span:
            def __enter__(self):
                if timer.cuda:
                    self.start = torch.cuda.Event(enable_timing=True)
                    self.start.record()
                else:
                    self.start = time.perf_counter()

            def __exit__(self, *exc):
                if timer.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    timer.pairs.append((self.start, end))
                else:
                    timer.seconds.append(time.perf_counter() - self.start)

        return _Span()

    def mean_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) for start, end in self.pairs]
        else:
            times = [1e3 * s for s in self.seconds]
        return statistics.mean(times) if times else float("nan")


class Outcomes:
    """Each verify's (request, proposed, accepted), from the Speculator's own bookkeeping (its
    `record` wrapped for the benchmark's lifetime)."""

    def __init__(self, speculator) -> None:
        self.rows: list[tuple[str, int, int]] = []
        record = speculator.record

        def recording(seq, proposed: int, accepted: int) -> None:
            if proposed:
                self.rows.append((seq.request_id, proposed, accepted))
            record(seq, proposed, accepted)

        speculator.record = recording

    def take(self) -> list[tuple[str, int, int]]:
        rows, self.rows = self.rows, []
        return rows


def acceptance(outcomes, planted: dict[str, list[int]]) -> dict:
    """Measured alpha (accepted / tested), tokens per verify, and how many verifies accepted
    exactly the oracle's correct prefix."""
    accepted = sum(a for _, _, a in outcomes)
    tested = sum(a + (a < n) for _, n, a in outcomes)
    queues = {rid: list(lengths) for rid, lengths in planted.items()}
    agree = sum(a == min(queues[rid].pop(0), n) for rid, n, a in outcomes if queues.get(rid))
    return {
        "verifies": len(outcomes),
        "proposed": sum(n for _, n, _ in outcomes),
        "alpha_measured": accepted / tested if tested else None,
        "tokens_per_verify": (accepted + len(outcomes)) / len(outcomes) if outcomes else None,
        "agree": f"{agree}/{len(outcomes)}",
    }


# ---------------------------------------------------------------- running the engine


@dataclass
class Run:
    seconds: float
    tokens: dict[str, list[int]]  # request id -> prompt + output token ids
    step_s: float  # median interval between engine steps after the first few (decode phase)


class Driver:
    """Runs batches of prompts straight through an Engine, with request ids the oracle knows."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.count = 0
        cuda = engine.device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def ids(self, n: int) -> list[str]:
        self.count += n
        return [f"bench-{self.count - n + i}" for i in range(n)]

    def run(self, prompts: list[list[int]], new_tokens: int, ids: list[str] | None = None) -> Run:
        from noesis import SamplingParams

        engine = self.engine
        ids = ids or self.ids(len(prompts))
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        self.sync()
        start = time.perf_counter()
        for prompt, request_id in zip(prompts, ids, strict=True):
            engine.add_request(prompt, params, request_id=request_id, stream=False)
        stamps, outputs = [], {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.prompt_token_ids + out.token_ids
            stamps.append(time.perf_counter())
        self.sync()
        seconds = time.perf_counter() - start
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][2:]
        return Run(seconds, outputs, statistics.median(gaps) if gaps else float("nan"))


def build(model: str, args, speculative=None):
    from noesis import LLM

    options = dict(max_model_len=args.max_model_len, max_num_seqs=args.large_batch, progress=False)
    if speculative is not None:
        options["speculative"] = speculative
    llm = LLM(model, device=args.device, dtype=args.dtype, **options)
    llm.engine.warm_up(8)
    return llm


def release(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- workloads


def workloads(tokenizer, large_batch: int) -> dict[str, list[list[int]]]:
    renamed = CODE.replace(*RENAME)
    edit = (
        f"{CODE}\nRewrite the code above with `{RENAME[0]}` renamed to `{RENAME[1]}`.\n"
        f"{renamed[:40]}"
    )
    return {
        "text": [tokenizer.encode(PROMPT)],
        "large": [tokenizer.encode(f"Request {i}. {PROMPT}") for i in range(large_batch)],
        "edit": [tokenizer.encode(edit)],
    }


def lookup_replay(tokenizer, k: int) -> dict:
    """Prompt lookup on the edit workload when the output is the correct rewrite: the engine's
    NgramProposer stepped over it (host only), each step's proposals judged as greedy
    verification would judge them."""
    from noesis.speculative.proposer import NgramProposer

    renamed = CODE.replace(*RENAME)
    prompt = tokenizer.encode(
        f"{CODE}\nRewrite the code above with `{RENAME[0]}` renamed to `{RENAME[1]}`.\n"
    )
    answer = tokenizer.encode(renamed)
    lookup = NgramProposer()
    position, accepted, tested, steps, hits = 0, 0, 0, 0, 0
    while position < len(answer):
        history = prompt + answer[:position]
        guess = lookup.propose(["replay"], [history], [k]).to_lists()[0]
        run = 0
        while (
            run < len(guess)
            and position + run < len(answer)
            and guess[run] == answer[position + run]
        ):
            run += 1
        if guess:
            hits += 1
            accepted += run
            tested += run + (run < len(guess))
        steps += 1
        position += run + 1
    return {
        "lookup_alpha": accepted / tested if tested else 0.0,
        "lookup_hit_rate": hits / steps,
        "lookup_tokens_per_step": len(answer) / steps,
    }


# ---------------------------------------------------------------- the benchmark


def predicted(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c_draft + c_verify)


def measure_plain(args, prompts, depths) -> tuple[dict, dict, dict]:
    """Plain greedy outputs (request id -> tokens), plain seconds per workload, step seconds
    per batch (a plain step of k + 1 rows costs what a verify step of depth k costs)."""
    llm = build(args.model, args)
    driver = Driver(llm.engine)
    references, seconds = {}, {}
    extra = max(depths)  # the oracle looks up to k tokens past the last one kept
    for name, batch in prompts.items():
        run = driver.run(batch, args.new_tokens + extra)
        references[name] = list(run.tokens.values())
        # Timed runs with the oracle's request ids: the same prompts, args.new_tokens each.
        seconds[name] = driver.run(batch, args.new_tokens).seconds
    step_s = {}
    for batch in sorted({1, *(k + 1 for k in depths)}):
        step_s[batch] = driver.run(prompts["text"] * batch, args.step_tokens).step_s
    for batch, seconds_per_step in sorted(step_s.items()):
        print(f"  plain step at batch {batch}: {1e3 * seconds_per_step:.2f} ms", flush=True)
    release(llm)
    return references, seconds, step_s


def verify_reference(spec, driver, prompts, inner, new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation as the speculative engine computes it: a run whose
    oracle proposes only wrong tokens (alpha 0), so each step emits the token of its verify
    step's first row. A plain decode step computes with other kernels (another batch bucket),
    whose rounding flips near-ties, and a random-weight model's logits are nearly flat: its
    greedy tokens are near-ties everywhere, and one flip makes every later reference token
    wrong. Each row of a verify step computes as the others do (the same bucket, rows
    independent), so a token accepted at row j is the one row 0 would have given."""
    ids = driver.ids(len(prompts))
    vocab = driver.engine.loaded.config.vocab_size
    timer = StepTimer(driver.engine.device)
    spec.proposer = Oracle(inner, {i: [] for i in ids}, 0.0, vocab, timer=timer)
    run = driver.run(prompts, new_tokens, ids)
    spec.proposer = inner
    return [run.tokens[i] for i in ids]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def oracle_row(spec, driver, outcomes, prompts, references, args, *, alpha, k, inner, tag):
    """One timed oracle run; the row's measurements (no speedup yet)."""
    ids = driver.ids(len(prompts))
    timer = StepTimer(driver.engine.device)
    oracle = Oracle(
        inner,
        dict(zip(ids, references, strict=True)),
        alpha,
        driver.engine.loaded.config.vocab_size,
        seed=args.seed,
        timer=timer,
    )
    spec.proposer = oracle
    outcomes.take()
    run = driver.run(prompts, args.new_tokens, ids)
    spec.proposer = inner
    identical = sum(
        run.tokens[i] == r[: len(run.tokens[i])] for i, r in zip(ids, references, strict=True)
    )
    return {
        "tag": tag,
        "alpha": alpha,
        "k": k,
        "seconds": run.seconds,
        "draft_ms": timer.mean_ms() / max(k, 1),
        "identical": f"{identical}/{len(ids)}",
        "diverged": len(oracle.diverged),
        **acceptance(outcomes.take(), oracle.planted),
    }


@dataclass(frozen=True)
class Variant:
    """A draft variant (--draft-variants): its table tag, checkpoint and head rows."""

    tag: str
    path: str
    vocab: int | None


def variants(args) -> list[Variant]:
    """Parse --draft-variants, quantizing the draft where a variant asks (unless that
    quantized checkpoint exists already)."""
    out = []
    for spec in args.draft_variants.split(","):
        bits, _, vocab = spec.strip().partition(":")
        if bits not in ("16", "8", "4") or (vocab and not vocab.isdigit()):
            raise SystemExit(f"--draft-variants: {spec!r} is not BITS[:VOCAB] (BITS 16, 8 or 4)")
        path, tag = args.draft, "draft"
        if bits != "16":
            name = f"{Path(args.draft).name}-int{bits}"  # beside the built checkpoints
            path, tag = str(Path(tempfile.gettempdir()) / "noesis-bench" / name), f"int{bits}"
            if not (Path(path) / "config.json").exists():
                from noesis.quant.quantize import quantize_checkpoint

                start = time.perf_counter()
                group = 64 if args.smoke else None  # the tiny draft's 192 columns
                quantize_checkpoint(Path(args.draft), Path(path), int(bits), group)
                print(f"quantized the draft to int{bits} at {path} in "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
        if vocab:
            tag += f"/{int(vocab) // 1024}k" if int(vocab) >= 1024 else f"/{vocab}"
        out.append(Variant(tag, path, int(vocab) if vocab else None))
    return out


def measure_spec(args, prompts, references, plain_s, step_s, variant: Variant,
                 extras: bool = True) -> list[dict]:
    """The batch-1 oracle rows over `variant`'s draft; with `extras` also the large-batch and
    lookup rows."""
    from noesis import SpeculativeConfig

    base = SpeculativeConfig(
        method="draft",
        draft=variant.path,
        k=max(args.depths),
        adaptive=False,
        entropy_cutoff=math.inf,
        draft_vocab=variant.vocab,
    )
    llm = build(args.model, args, base)
    spec, driver = llm.engine.speculator, Driver(llm.engine)
    draft, outcomes = spec.proposer, Outcomes(spec)
    for name in ("text", "edit"):  # the prompts' prefixes cached, as for the timed plain runs
        driver.run(prompts[name], 2)
    rows = []
    extra = max(args.depths)
    for k in args.depths:
        spec.config = replace(base, k=k)
        reference = verify_reference(spec, driver, prompts["text"], draft, args.new_tokens + extra)
        flip = first_difference(reference[0], references["text"][0])
        for alpha in args.alphas:
            row = oracle_row(
                spec,
                driver,
                outcomes,
                prompts["text"],
                reference,
                args,
                alpha=alpha,
                k=k,
                inner=draft,
                tag=variant.tag,
            )
            c_draft = row["draft_ms"] / (1e3 * step_s[1])
            row["reference_leaves_plain_at"] = flip
            row["predicted"] = predicted(alpha, k, c_draft, step_s[k + 1] / step_s[1])
            rows.append(finish(row, "text", 1, plain_s["text"], args))
    if not extras:
        release(llm)
        return rows
    for alpha, k in args.large_rows:
        spec.config = replace(base, k=k)
        row = oracle_row(
            spec,
            driver,
            outcomes,
            prompts["large"],
            references["large"],
            args,
            alpha=alpha,
            k=k,
            inner=draft,
            tag="draft",
        )
        rows.append(finish(row, "large", args.large_batch, plain_s["large"], args))
    rows += measure_lookup(args, spec, driver, outcomes, prompts, references, plain_s)
    release(llm)
    return rows


def measure_lookup(args, spec, driver, outcomes, prompts, references, plain_s) -> list[dict]:
    from noesis import SpeculativeConfig
    from noesis.speculative.proposer import NgramProposer

    lookup = NgramProposer()
    spec.proposer, spec.config = lookup, SpeculativeConfig(method="ngram", k=LOOKUP_K)
    outcomes.take()
    run = driver.run(prompts["edit"], args.new_tokens)
    real = {
        "tag": "ngram",
        "alpha": None,
        "k": LOOKUP_K,
        "seconds": run.seconds,
        "draft_ms": None,
        "identical": "-",
        "diverged": 0,
        **acceptance(outcomes.take(), {}),
    }
    real["agree"] = "-"  # no oracle: nothing planted to agree with
    spec.config = SpeculativeConfig(method="ngram", k=LOOKUP_K, adaptive=False)
    extra = max(args.depths)
    reference = verify_reference(spec, driver, prompts["edit"], lookup, args.new_tokens + extra)
    row = oracle_row(
        spec,
        driver,
        outcomes,
        prompts["edit"],
        reference,
        args,
        alpha=args.lookup_alpha,
        k=LOOKUP_K,
        inner=lookup,
        tag="lookup",
    )
    return [
        finish(real, "edit", 1, plain_s["edit"], args),
        finish(row, "edit", 1, plain_s["edit"], args),
    ]


def finish(row: dict, workload: str, batch: int, plain_seconds: float, args) -> dict:
    row.update(
        workload=workload,
        batch=batch,
        speedup=plain_seconds / row["seconds"],
        tok_s=batch * args.new_tokens / row["seconds"],
    )
    row.setdefault("predicted", None)
    print("  " + line(row), flush=True)
    return row


HEAD = (
    f"{'workload':<9}{'batch':>5} {'method':<9}{'alpha':>6}{'k':>3}{'tok/s':>9}"
    f"{'speedup':>9}{'predicted':>10}{'alpha~':>8}{'tok/verify':>11}{'draft ms':>9}"
    f"{'proposed':>9}{'agree':>10}{'identical':>10}"
)


def line(r: dict) -> str:
    def num(value, spec):
        return "-" if value is None else format(value, spec)

    return (
        f"{r['workload']:<9}{r['batch']:>5} {r['tag']:<9}{num(r['alpha'], '.2f'):>6}"
        f"{num(r['k'], 'd'):>3}{r['tok_s']:>9.1f}{r['speedup']:>8.2f}x"
        f"{num(r['predicted'], '.2f'):>9}x{num(r['alpha_measured'], '.3f'):>8}"
        f"{num(r['tokens_per_verify'], '.2f'):>11}{num(r['draft_ms'], '.2f'):>9}"
        f"{num(r['proposed'], 'd'):>9}{r['agree']:>10}{r['identical']:>10}"
    )


def plain_rows(plain_s: dict, prompts: dict, args) -> list[dict]:
    rows = []
    for workload, seconds in plain_s.items():
        batch = len(prompts[workload])
        rows.append(
            {
                "tag": "plain",
                "workload": workload,
                "batch": batch,
                "alpha": None,
                "k": None,
                "seconds": seconds,
                "tok_s": batch * args.new_tokens / seconds,
                "speedup": 1.0,
                "predicted": None,
                "alpha_measured": None,
                "tokens_per_verify": None,
                "draft_ms": None,
                "proposed": None,
                "agree": "-",
                "identical": "-",
            }
        )
    return rows


def checkpoints(args) -> None:
    """The random 8B target and 1B draft (bfloat16, drawn on the device), unless present."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_random_checkpoint import make_checkpoint

    for path, shape, tie in ((args.model, "llama-8b", False), (args.draft, "llama-1b", True)):
        if not (Path(path) / "config.json").exists():
            start = time.perf_counter()
            make_checkpoint(Path(path), shape, "bfloat16", 8192, 0, tie, args.device)
            print(f"built {shape} at {path} in {time.perf_counter() - start:.0f} s", flush=True)


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script on the bundled tiny pair: alpha 0.9, k=2, 6 tokens",
    )
    parser.add_argument(
        "--model",
        default="/tmp/noesis-bench/llama-8b",
        help="target (built as the random 8B shape when missing)",
    )
    parser.add_argument(
        "--draft",
        default="/tmp/noesis-bench/llama-1b",
        help="draft (built as the random 1B shape when missing)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=32,
        help="tokens per plain run that times a step at batch k + 1",
    )
    parser.add_argument("--large-batch", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--lookup-alpha", type=float, help="alpha of the lookup oracle row (default: the replay's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--draft-variants", default="16",
        help="comma list of BITS[:VOCAB] draft variants (see the module doc), e.g. 16,4,4:32768",
    )
    parser.add_argument("--alphas", help="comma list (default 0.5,0.65,0.8,0.9)")
    parser.add_argument("--depths", help="comma list (default 2..8)")
    parser.add_argument("--json", help="also write the rows and the setup here")
    args = parser.parse_args(argv)
    args.alphas = tuple(map(float, args.alphas.split(","))) if args.alphas else ALPHAS
    args.depths = tuple(map(int, args.depths.split(","))) if args.depths else DEPTHS
    args.large_rows = [(0.8, 4), (0.9, 8)]
    if args.smoke:
        args.model, args.draft, args.device, args.dtype = (
            str(TINY),
            str(TINY_DRAFT),
            "cpu",
            "float32",
        )
        args.alphas, args.depths, args.large_rows = (0.9,), (2,), [(0.9, 2)]
        args.new_tokens, args.step_tokens, args.large_batch = 6, 4, 2
        args.max_model_len = 1024
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    start = time.perf_counter()
    if not args.smoke:
        checkpoints(args)
    from noesis.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(args.model))
    prompts = workloads(tokenizer, args.large_batch)
    replay = lookup_replay(tokenizer, LOOKUP_K)
    if args.lookup_alpha is None:
        args.lookup_alpha = round(replay["lookup_alpha"], 3)
    print(f"lookup replay on the edit workload: {replay}", flush=True)
    print("plain engine: references and step times", flush=True)
    references, plain_s, step_s = measure_plain(args, prompts, args.depths)
    print("speculative engine (one, its config and proposer swapped per row)", flush=True)
    rows = plain_rows(plain_s, prompts, args)
    for i, variant in enumerate(variants(args)):
        rows += measure_spec(args, prompts, references, plain_s, step_s, variant, extras=i == 0)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(
        f"\nspeculative decoding, acceptance-controlled: target {args.model}, draft "
        f"{args.draft}, {device}, {args.new_tokens} new tokens, greedy; "
        f"{time.perf_counter() - start:.0f} s in all"
    )
    print(HEAD)
    for r in rows:
        print(line(r))
    report = {
        "model": args.model,
        "draft": args.draft,
        "device": device,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        **replay,
        "plain_step_ms": {b: 1e3 * s for b, s in step_s.items()},
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
