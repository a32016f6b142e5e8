"""Ablation ladder of the control plane on the tool-use eval (noesis.tiny.harness): the same
examples under each rung, greedy and sampled (T = 0.7, several seeds), with 95% intervals.

    python benchmarks/control_ladder.py --split heldout --json ladder_heldout.json
    python benchmarks/control_ladder.py --split natural --json ladder_natural.json
    python benchmarks/control_ladder.py --split control --json ladder_control.json  # new kinds
    python benchmarks/control_ladder.py --split train --n 100 --json ladder_train.json  # tuning
    python benchmarks/control_ladder.py --n 4 --seeds 0 --device cpu --json /tmp/l.json  # smoke

Rungs (a name in RUNGS): baseline (unconstrained), +phi (unconstrained, the default policy: only
Φ acts, per token inside each generation (noesis.control.knobs), the tool header is not
grammar-bound), +constraints (grounded turn grammar),
+control-none (the grammar, the null policy: metrics on, knobs unchanged; must equal
+constraints), +phi+efe (the grammar and the default policy), +budgetB (the grammar, the first
turn's analysis capped at B tokens: noesis.control.think), +phi+efe+budget8, +skip (the grammar,
each first turn's analysis skipped when a probe of the turn without analysis is confident:
noesis.control.skip, margin floor 0.8), +skip-all (floor 0: analysis always skipped, the
lever's bound), +exit (the grammar, each first turn's analysis written a sentence at a time and
closed after the first sentence whose 16-token probe of the rest is confident:
noesis.control.early_exit, floor 0.8), +exit-whole (the probe is the whole rest, kept when
confident), +phi+efe+exit, +exit-first (floor 0: analysis closed after its first sentence, the
lever's bound), +all (the grammar, the default policy and the exit). Per run, pooled over
examples x seeds, each share with its Wilson interval: end-to-end accuracy, first-try schema
validity of the first turns' calls and of every call (a chain's second too), unnecessary calls
(of the examples expecting none), missed calls (of those requiring one) and optional calls (of
those answerable either way: not an error); tokens to answer (mean, normal interval) and its
change against the unconstrained baseline of the same mode (paired bootstrap over examples), and
how often the controller forbade or forced the tool header; probing rungs add their probes'
decode steps per turn. The JSON and the Quality@Tokens PNG
(benchmarks/quality_at_tokens.py, --png) are rewritten after every run, so a cut-off run keeps
what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from noesis import LLM, SamplingParams  # noqa: E402
from noesis.control.branched import BranchedTurns  # noqa: E402
from noesis.control.early_exit import ExitConfig, ExitStats, ExitTurns  # noqa: E402
from noesis.control.skip import ProbedTurns, SkipConfig  # noqa: E402
from noesis.control.think import BudgetedTurns  # noqa: E402
from noesis.tiny import evaluate, harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXIT_MARGIN = 0.8  # +exit's margin floor (noesis.control.early_exit), as +skip's
RUNGS = {  # name: (constraint, control policy, turn generator over the LLM or None: the LLM)
    "baseline": (None, None, None),
    "+phi": (None, "default", None),
    "+constraints": ("grounded", None, None),
    "+control-none": ("grounded", "none", None),
    "+phi+efe": ("grounded", "default", None),
    "+budget8": ("grounded", None, lambda llm: BudgetedTurns(llm, 8)),
    "+budget16": ("grounded", None, lambda llm: BudgetedTurns(llm, 16)),
    "+phi+efe+budget8": ("grounded", "default", lambda llm: BudgetedTurns(llm, 8)),
    "+skip": ("grounded", None, lambda llm: ProbedTurns(llm, SkipConfig(min_margin=0.8))),
    "+skip-all": ("grounded", None, lambda llm: ProbedTurns(llm, SkipConfig(min_margin=0.0))),
    "+exit": ("grounded", None, lambda llm: _exit(llm)),
    "+exit-whole": ("grounded", None, lambda llm: _exit(llm, probe_tokens=None)),
    "+phi+efe+exit": ("grounded", "default", lambda llm: _exit(llm)),
    "+exit-first": ("grounded", None, lambda llm: _exit(llm, min_margin=0.0)),
    # all that acts on one turn: the grammar, the default policy (Φ, EFE-lite) and the exit
    "+all": ("grounded", "default", lambda llm: _exit(llm)),
    # each sampled turn as best_of 4 branches under the binding gate, the likeliest kept
    # (noesis.control.branched; greedy turns run once): its decoded tokens are all branches'
    "+gate": ("grounded", "default", lambda llm: BranchedTurns(llm, GATE_BEST_OF)),
}
GATE_BEST_OF = 4


def _exit(llm, **config) -> ExitTurns:
    return ExitTurns(llm, ExitConfig(**{"min_margin": EXIT_MARGIN, **config}))


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    if total == 0:
        return (math.nan, math.nan)
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (centre - half, centre + half)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, n - 1))
    return mean, mean - 1.96 * sd / math.sqrt(n), mean + 1.96 * sd / math.sqrt(n)


def paired_change(ours: list[float], base: list[float], draws: int = 2000) -> dict:
    """Relative change of the mean (ours / base - 1), with a bootstrap interval over examples."""
    rng = random.Random(0)
    n = len(ours)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(ours[i] for i in picks) / sum(base[i] for i in picks) - 1)
    ratios.sort()
    return {"change": sum(ours) / sum(base) - 1, "low": ratios[int(0.025 * draws)],
            "high": ratios[int(0.975 * draws)]}  # fmt: skip


def one_rung(llm, examples, args, rung: str, sampled: SamplingParams | None, seeds) -> dict:
    """Every seed of one rung and decoding mode, pooled over examples x seeds."""
    constraint, controller, wrap = RUNGS[rung]
    scores, traces, summaries, probes, branched = [], [], [], [], []
    began = time.perf_counter()
    for seed in seeds:
        config = harness.EvalConfig(split=args.split, n=args.n, corpus_seed=args.corpus_seed,
                                    max_tokens=args.max_tokens, seed=seed, constraint=constraint,
                                    controller=controller)  # fmt: skip
        generator = wrap(llm) if wrap else llm
        result = harness.run(generator, examples, config, sampled)
        scores += result.scores
        traces += result.traces
        summaries.append(result.summary)
        if isinstance(generator, ProbedTurns | ExitTurns):
            probes.append(generator.stats)
        if isinstance(generator, BranchedTurns):
            branched.append(generator)
    tokens = [float(s.tokens_to_answer) for s in scores if s.tokens_to_answer is not None]
    mean, t_low, t_high = mean_interval(tokens)
    return {
        "rung": rung, "mode": "greedy" if sampled is None else f"t={sampled.temperature:g}",
        "seeds": list(seeds), "examples": len(scores), **shares(traces, scores),
        "mean_tokens_to_answer": mean, "tokens_ci": [t_low, t_high],
        "tool_header_forbidden": _mean([s.get("tool_header_forbidden") for s in summaries]),
        "tool_header_forced": _mean([s.get("tool_header_forced") for s in summaries]),
        "per_example_tokens": tokens, "seconds": round(time.perf_counter() - began, 1),
        **_probe_summary(probes), **_gate_summary(branched, len(scores)),
    }  # fmt: skip


def _gate_summary(generators: list, examples: int) -> dict:
    """+gate: the tokens every branch decoded per example (what the device paid, against the
    kept branch's tokens to answer) and the branches the gate pruned per example."""
    if not generators:
        return {}
    return {"decoded_tokens_per_example": sum(g.decoded for g in generators) / max(1, examples),
            "pruned_per_example": sum(g.pruned for g in generators) / max(1, examples)}


def shares(traces: list, scores: list) -> dict:
    """A run's shares, pooled over its traces (harness.Trace) and their scores: end to end,
    first-try validity of the first turns' calls and of every call, and where the first turn
    went: a call where none was expected (unnecessary), none where one was required (missed),
    a call where either was right (optional: counted apart, not an error)."""
    examples = [t.example for t in traces]
    pairs = list(zip(examples, scores, strict=True))
    e2e = rate("end_to_end_accuracy", [s.end_to_end for s in scores])
    e2e["end_to_end_ci"] = e2e.pop("end_to_end_accuracy_ci")  # the plot's (and older reports')
    every = [flag for t in traces for flag in evaluate.calls_valid(t.example, t.own.turns)]
    return {
        **e2e,
        **rate("call_validity", [s.call.arguments_valid for s in scores if s.call.called]),
        **rate("every_call_validity", every),
        **rate("unnecessary_tool_calls",
               [s.call.called is not None for e, s in pairs if e.expected_tool is None]),
        **rate("missed_tool_calls", [s.call.called is None for e, s in pairs
                                     if e.expected_tool is not None and not e.tool_optional]),
        **rate("optional_tool_calls", [s.call.called is not None for e, s in pairs
                                       if e.tool_optional]),
        "by_task": by_task(pairs),
    }  # fmt: skip


def by_task(pairs: list) -> dict:
    """Per task kind (the control split's optional_tool and two_calls among the others): its
    end-to-end share with interval and count, and its mean tokens to answer."""
    groups: dict[str, list] = {}
    for example, score in pairs:
        groups.setdefault(example.task, []).append(score)
    table = {}
    for task, scores in sorted(groups.items()):
        tokens = [s.tokens_to_answer for s in scores if s.tokens_to_answer is not None]
        mean = sum(tokens) / len(tokens) if tokens else None
        table[task] = {**rate("end_to_end_accuracy", [s.end_to_end for s in scores]),
                       "mean_tokens_to_answer": mean}  # fmt: skip
    return table


def _probe_summary(stats: list) -> dict:
    """Probing rungs: the decode steps the probes spent per turn (not in tokens to answer), and
    for +skip the share of probed turns run without analysis; for +exit the share of turns whose
    analysis closed on a probe, and the analysis sentences and tokens kept per turn."""
    if not stats:
        return {}
    turns = max(1, sum(s.turns for s in stats))
    summary = {"probe_steps_per_turn": sum(s.probe_steps for s in stats) / turns}
    if all(isinstance(s, ExitStats) for s in stats):
        return {**summary, "analysis_exited": sum(s.exits for s in stats) / turns,
                "sentences_per_turn": sum(s.sentences for s in stats) / turns,
                "analysis_tokens_per_turn":
                    sum(s.analysis_tokens for s in stats) / turns}  # fmt: skip
    return {**summary, "analysis_skipped": sum(s.skipped for s in stats) / turns}


def rate(name: str, flags: list) -> dict:
    """A share with its Wilson interval and its count: {name, name_ci, name_n} (None when no
    example counts: no call was made, no example expects none, ...)."""
    flags = [bool(f) for f in flags if f is not None]
    if not flags:
        return {name: None, f"{name}_ci": None, f"{name}_n": 0}
    return {name: sum(flags) / len(flags), f"{name}_ci": list(wilson(sum(flags), len(flags))),
            f"{name}_n": len(flags)}  # fmt: skip


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "noesis-tiny"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--split", default="heldout", choices=harness.SPLITS)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--corpus-seed", type=int, default=1234)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seeds", default="0,1,2", help="sampled runs' seeds")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--modes", default="greedy,sampled", help="greedy, sampled or both")
    parser.add_argument("--json", required=True)
    parser.add_argument("--png", help="the Quality@Tokens plot (default: the JSON's path, .png)")
    args = parser.parse_args()
    png = Path(args.png or Path(args.json).with_suffix(".png"))
    llm = LLM(args.model, device=args.device, progress=False, enable_prefix_caching=True)
    examples = harness.eval_examples(harness.EvalConfig(split=args.split, n=args.n,
                                                        corpus_seed=args.corpus_seed))  # fmt: skip
    seeds = [int(s) for s in args.seeds.split(",") if s]
    wanted = args.modes.split(",")
    modes = [(None, [0])] if "greedy" in wanted else []
    if "sampled" in wanted and seeds:
        modes.append((SamplingParams(temperature=args.temperature), seeds))
    report = {"split": args.split, "n": len(examples), "corpus_seed": args.corpus_seed,
              "device": str(llm.engine.device), "command": " ".join(sys.argv),
              "runs": []}  # fmt: skip
    for sampled, mode_seeds in modes:
        for rung in args.rungs.split(","):
            row = one_rung(llm, examples, args, rung, sampled, mode_seeds)
            report["runs"].append(row)
            _compare(report["runs"])
            print(_line(row), flush=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
            write_png(report["runs"], png)
    print(f"wrote {args.json} and the Quality@Tokens plot {png}")


def _compare(runs: list[dict]) -> None:
    """Tokens against the unconstrained baseline of the same mode (paired over examples)."""
    last = runs[-1]
    base = next((r for r in runs if r["rung"] == "baseline" and r["mode"] == last["mode"]), None)
    if base is not None and base is not last:
        last["tokens_vs_baseline"] = paired_change(last["per_example_tokens"],
                                                   base["per_example_tokens"])  # fmt: skip


def _line(r: dict) -> str:
    tci, versus = r["tokens_ci"], r.get("tokens_vs_baseline")
    change = f" {100 * versus['change']:+.1f}% [{100 * versus['low']:+.1f}, " \
             f"{100 * versus['high']:+.1f}]" if versus else ""  # fmt: skip
    return (f"{r['mode']:>7} {r['rung']:<17} e2e {_share(r, 'end_to_end_accuracy')}  "
            f"valid {_share(r, 'call_validity')}  every call {_share(r, 'every_call_validity')}  "
            f"tokens {r['mean_tokens_to_answer']:.1f} [{tci[0]:.1f}, {tci[1]:.1f}]{change}  "
            f"unnecessary {_share(r, 'unnecessary_tool_calls')}  missed "
            f"{_share(r, 'missed_tool_calls')}  optional {_share(r, 'optional_tool_calls')}  "
            f"forbidden {r['tool_header_forbidden']}{_skips(r)}  ({r['seconds']} s)")  # fmt: skip


def _skips(r: dict) -> str:
    if "decoded_tokens_per_example" in r:
        return (f"  decoded (all branches) {r['decoded_tokens_per_example']:.1f} tokens/example, "
                f"pruned {r['pruned_per_example']:.2f} branches/example")
    if "analysis_exited" in r:
        return (f"  analysis exited {100 * r['analysis_exited']:.0f}% (sentences/turn "
                f"{r['sentences_per_turn']:.1f}, analysis tokens/turn "
                f"{r['analysis_tokens_per_turn']:.1f}), probe steps/turn "
                f"{r['probe_steps_per_turn']:.1f}")  # fmt: skip
    if "analysis_skipped" not in r:
        return ""
    return (f"  analysis skipped {100 * r['analysis_skipped']:.0f}%, probe steps/turn "
            f"{r['probe_steps_per_turn']:.1f}")  # fmt: skip


def _share(r: dict, name: str) -> str:
    if r.get(name) is None:  # nothing counted (or a report from before the share existed)
        return "-"
    low, high = r["end_to_end_ci" if name == "end_to_end_accuracy" else f"{name}_ci"]
    return f"{100 * r[name]:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def write_png(runs: list[dict], path: Path) -> None:
    """The Quality@Tokens plot of the runs so far (benchmarks/quality_at_tokens.py draws it with
    zlib alone: no plotting package needed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality_at_tokens import plot

    path.write_bytes(plot(runs))


if __name__ == "__main__":
    main()
