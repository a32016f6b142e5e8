"""Tool-use eval harness behind `noesis eval tools`: held-out noesis-tiny conversations through the
one turn loop (noesis.session.Session) over an LLM it is given, the model's tool calls executed for
real by the built-in tools, scores from noesis.tiny.evaluate. The `natural` split
(noesis.tiny.natural) runs the same way, with rates per phrasing kind as well; so does the
`control` split (corpus.control_examples: questions answerable with or without a tool, questions
needing two calls in a row, among the held-out kinds).

Each example is two Session runs, moved in lockstep so every generation is batched:
  1. own:      the question -> the model's first turn (a tool call or a direct answer), scored by
               `score_call`; a direct answer is also scored by `final_correct`. Its calls run for
               real and their results go back, up to `max_tool_steps` more generations; the
               last turn is scored end to end.
  2. supplied: where the conversation answers through calls, the conversation up to the final
               answer, with the corpus's correct calls and the tools' real results supplied ->
               the final answer (one generation, batched with the own runs' second).
Greedy always; sampled too when sampling parameters are given. With a draft model, the draft's
greedy agreement with the target is measured on the target's greedy first turns and finals.
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from noesis.control.early_exit import ExitTurns
from noesis.control.policy import POLICIES, ControlPolicy, make_policy
from noesis.control.think import BudgetedTurns
from noesis.errors import InvalidRequest
from noesis.sampling.params import SamplingParams
from noesis.session import Session, SessionRun, TurnGenerator
from noesis.tiny import corpus, evaluate, natural
from noesis.tiny.corpus import Example
from noesis.tiny.lexicon import Split
from noesis.tools.builtin import builtin_tools

# Controllers by name: the control plane's policies (noesis.control.POLICIES: "default", "none"),
# which steer every run's generations through the Session, and generator hooks, each taking the
# LLM and returning the TurnGenerator the runs use.
Hook = Callable[[Any], TurnGenerator]
THINK_BUDGET = 16  # analysis tokens of "think-budget" (noesis.control.think)
CONTROLLERS: dict[str, Hook] = {
    "think-budget": lambda llm: BudgetedTurns(llm, THINK_BUDGET),
    "early-exit": lambda llm: ExitTurns(llm),  # noesis.control.early_exit, its default floor
}

# Constraints by name: the turn options every generation runs under. "harmony": a well-formed
# turn whose tool arguments match the called tool's declared schema, read as plain JSON Schema;
# "grounded": the same with the x-noesis-grounded keyword applied (arguments copied from the
# user's words), which is how `noesis chat`, the voice and the server decode. Default:
# unconstrained.
UNCONSTRAINED: dict[str, Any] = {"constrained": False}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "harmony": {"constrained": True, "grounded": False},
    "grounded": {"constrained": True, "grounded": True},
}

DEFINITIONS = {
    "tool_selection_accuracy": "share of examples whose first turn calls the expected tool, or "
    "calls none when no tool is expected",
    "call_json_rate": "share of first-turn tool calls whose arguments parse as a JSON object",
    "call_validity": "share of first-turn tool calls whose arguments parse and validate against "
    "the called tool's declared schema, on the first try (unconstrained: the baseline)",
    "call_arguments_correct": "share of first-turn tool calls that are valid and give the "
    "expected tool result when executed",
    "final_answer_accuracy": "share of scored examples whose final answer contains the expected "
    "answer, with the correct tool results supplied (direct answers: from the first turn; where a "
    "call is optional, after the model's own call if it made one)",
    "end_to_end_accuracy": "the same, with the model's own call executed for real and its result "
    "fed back",
    "mean_tokens_to_answer": "generated tokens from the question to the end of the model's own "
    "answer (first turn plus the turns after its own tool calls)",
    "tool_header_forbidden": "share of generations whose tool header the controller forbade "
    "(emit-vs-tool; controller runs only)",
    "tool_header_forced": "share of generations whose tool header the controller forced",
    "unnecessary_tool_calls": "share of examples expecting no tool whose first turn called one",
    "missed_tool_calls": "share of examples requiring a tool whose first turn called none",
    "optional_tool_calls": "share of examples answerable with or without a tool (either is "
    "right) whose first turn called it",
    "every_call_validity": "share of all tool calls of the own runs (first and later turns: the "
    "second call of a chain too) whose arguments parse and validate against the declared schema",
    "draft_greedy_agreement": "over the target's greedy continuations t (first turns, and finals "
    "with the result supplied), the share of positions i where the draft's greedy token given "
    "prompt + t[:i] equals t[i]: the per-token acceptance of greedy speculative decoding",
}


# natural: noesis.tiny.natural; control: corpus.control_examples (held-out entities)
SPLITS = ("heldout", "train", natural.SPLIT, corpus.CONTROL_SPLIT)


@dataclass(frozen=True)
class EvalConfig:
    split: Split | str = "heldout"  # one of SPLITS
    n: int = 200
    corpus_seed: int = 1234  # the held-out seed of the preliminary transformers check
    max_tokens: int = 128  # per generation
    # A sampled run besides the greedy one, with these parameters (temperature, top_p, ...); the
    # harness sets each request's seed (see request_seed) and max_tokens.
    sampled: SamplingParams | None = None
    seed: int = 0
    max_tool_steps: int = 3  # generations after the first turn (at least 1)
    constraint: str | None = None  # a name in CONSTRAINTS
    controller: str | None = None  # a name in CONTROLLERS


@dataclass(slots=True)
class Trace:
    """What the model did on one example in one decoding run: its two Session runs."""

    example: Example
    own: SessionRun
    supplied: SessionRun | None  # None when no tool is expected


@dataclass
class RunResult:
    """One decoding setting's scores and summary, and (greedy) the target's continuations."""

    label: str
    scores: list[evaluate.ExampleScore]
    summary: dict[str, Any]
    seconds: float
    continuations: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (prompt, ids)
    traces: list[Trace] = field(default_factory=list)


def evaluate_tools(llm, config: EvalConfig, draft=None) -> dict[str, Any]:
    """Run the harness; returns the report (summaries, definitions, per-example scores)."""
    if config.n < 1 or config.max_tool_steps < 1:
        raise InvalidRequest("n and max_tool_steps must be >= 1")
    generator = turn_generator(llm, config.controller)
    _constraint(config.constraint)  # an unknown name is refused before any work
    examples = eval_examples(config)
    runs = [run(generator, examples, config, None)]
    if config.sampled is not None:
        runs.append(run(generator, examples, config, config.sampled))
    report: dict[str, Any] = {
        "split": config.split,
        "corpus_seed": config.corpus_seed,
        "examples": len(examples),
        "max_tokens": config.max_tokens,
        "constraint": config.constraint,
        "controller": config.controller,
        "runs": {r.label: {**r.summary, "seconds": round(r.seconds, 1)} for r in runs},
    }
    if draft is not None:
        began = time.perf_counter()
        agreed, total = draft_agreement(draft, runs[0].continuations)
        report["draft_greedy_agreement"] = {
            "rate": agreed / total if total else None,
            "agreed_tokens": agreed,
            "target_tokens": total,
            "seconds": round(time.perf_counter() - began, 1),
        }
    report["definitions"] = DEFINITIONS
    report["scores"] = {r.label: evaluate.to_json(r.scores) for r in runs}
    return report


def eval_examples(config: EvalConfig) -> list[Example]:
    """The conversations of the configured split: the corpus's, or the natural-phrasing set."""
    if config.split == natural.SPLIT:
        return list(natural.generate(config.corpus_seed, config.n))
    if config.split == corpus.CONTROL_SPLIT:
        return corpus.control_examples(config.corpus_seed, config.n)
    if config.split not in SPLITS:
        raise InvalidRequest(f"unknown split {config.split!r} (available: {', '.join(SPLITS)})")
    return corpus.generate(config.corpus_seed, config.split, config.n)


def turn_generator(llm, controller: str | None = None) -> TurnGenerator:
    """The LLM as the runs' turn generator, or the named controller's generator over it (a
    control policy steers through the Session instead: the LLM itself)."""
    if controller is None or controller in POLICIES:
        return llm
    return _named("controller", controller, {**CONTROLLERS, **POLICIES})(llm)


def control_policy(controller: str | None) -> ControlPolicy | None:
    """The named control policy the runs' Session applies, or None."""
    return make_policy(controller) if controller in POLICIES else None


def _constraint(name: str | None) -> dict[str, Any]:
    return UNCONSTRAINED if name is None else _named("constraint", name, CONSTRAINTS)


def _named(kind: str, name: str, table: dict[str, Any]):
    if name not in table:
        known = ", ".join(table) or "none yet"
        raise InvalidRequest(f"unknown {kind} {name!r} (available: {known})")
    return table[name]


def request_seed(seed: int, example_id: str, step: str) -> int:
    """A sampled request's seed: fixed by (run seed, example, pass), whatever shares the batch."""
    return zlib.crc32(f"{seed}/{example_id}/{step}".encode())


# ---------------------------------------------------------------- one decoding run


def run(
    generator: TurnGenerator,
    examples: list[Example],
    config: EvalConfig,
    sampled: SamplingParams | None,
) -> RunResult:
    """Every example's runs under one decoding setting (greedy when sampled is None)."""
    began = time.perf_counter()
    label = "greedy" if sampled is None else _label(sampled, config.seed)
    options = _constraint(config.constraint)
    policy = control_policy(config.controller)
    session = Session(generator, max_tool_rounds=config.max_tool_steps, control=policy)
    traces = [_start(session, example, config, sampled, options) for example in examples]
    owns = [trace.own for trace in traces]
    session.advance(owns)  # every first turn
    runs = [t.supplied for t in traces if t.supplied is not None] + owns
    while not all(r.done for r in runs):
        session.advance(runs)  # the supplied finals, batched with the turns after own calls
    scores = [_score(trace) for trace in traces]
    summary = evaluate.summarize(scores)
    summary["end_to_end_accuracy"] = _rate([score.end_to_end for score in scores])
    summary.update(evaluate.route_rates(examples, scores))
    summary["every_call_validity"] = _rate(
        [flag for t in traces for flag in evaluate.calls_valid(t.example, t.own.turns)]
    )
    if policy is not None:
        summary.update(_control_summary(traces))
    if any(isinstance(e, natural.NaturalExample) for e in examples):
        summary["by_kind"] = _by_kind(scores, examples)
    result = RunResult(label, scores, summary, time.perf_counter() - began, traces=traces)
    if sampled is None:
        firsts = [t.own.turns[0] for t in traces]
        finals = [t.supplied.turns[0] for t in traces if t.supplied is not None]
        result.continuations = [(turn.prompt_token_ids, turn.token_ids) for turn in firsts + finals]
    return result


def _start(
    session: Session,
    example: Example,
    config: EvalConfig,
    sampled: SamplingParams | None,
    options: dict[str, Any],
) -> Trace:
    tools = _builtin_registry(example)
    base = sampled or SamplingParams(temperature=0.0)

    def params(step: Callable[[int], str]) -> Callable[[int], SamplingParams]:
        def for_round(index: int) -> SamplingParams:
            seed = None if sampled is None else request_seed(config.seed, example.id, step(index))
            return dataclasses.replace(base, seed=seed, max_tokens=config.max_tokens)

        return for_round

    own = session.start(example.prompt_messages, tools, params=params(_own_step), **options)
    supplied = None
    if example.shows_call:
        supplied = session.start(
            example.messages_before_final, tools, max_tool_rounds=0,
            params=params(lambda index: "supplied0"), **options,
        )  # fmt: skip
    return Trace(example, own, supplied)


def _own_step(index: int) -> str:
    return "first" if index == 0 else f"own{index - 1}"


def _builtin_registry(example: Example):
    """The example's declared tools as the built-in tools that run its calls."""
    names = [tool["function"]["name"] for tool in example.tools]
    registry = builtin_tools(names)
    if registry.schemas() != example.tools:
        raise InvalidRequest(f"example {example.id} declares tools unlike the built-in ones")
    return registry


def _score(trace: Trace) -> evaluate.ExampleScore:
    example, first = trace.example, trace.own.turns[0]
    final_turn = first if trace.supplied is None else trace.supplied.turns[0]
    if trace.supplied is None and example.tool_optional:
        final_turn = trace.own.turns[-1]  # after its call, when it chose to make one
    return evaluate.ExampleScore(
        example.id,
        example.task,
        example.expected_tool,
        evaluate.score_call(example, first),
        evaluate.final_correct(example, final_turn),
        trace.own.usage.completion_tokens,
        evaluate.final_correct(example, trace.own.turns[-1]),
    )


def _control_summary(traces: list[Trace]) -> dict[str, float | None]:
    """How often the controller forbade or forced the tool header, over every generation."""
    runs = [t.own for t in traces] + [t.supplied for t in traces if t.supplied is not None]
    decisions = [d for r in runs if r.control is not None
                 for d in r.control.summary().get("decisions", [])]  # fmt: skip
    return {
        "tool_header_forbidden": _rate([d == "none" for d in decisions]),
        "tool_header_forced": _rate([d == "required" for d in decisions]),
    }


def _by_kind(scores: list[evaluate.ExampleScore], examples: list[Example]) -> dict[str, Any]:
    """Per phrasing kind of the natural split: selection, arguments, final and end-to-end rates."""
    groups: dict[str, list[evaluate.ExampleScore]] = {}
    for example, score in zip(examples, scores, strict=True):
        kind = example.kind if isinstance(example, natural.NaturalExample) else ""
        groups.setdefault(kind, []).append(score)
    return {
        kind: {
            "examples": len(group),
            "tool_selection_accuracy": _rate([s.call.selection_correct for s in group]),
            "call_arguments_correct": _rate(
                [s.call.arguments_correct for s in group if s.call.called is not None]
            ),
            "final_answer_accuracy": _rate([s.final_correct for s in group]),
            "end_to_end_accuracy": _rate([s.end_to_end for s in group]),
        }
        for kind, group in groups.items()
    }


def _label(sampled: SamplingParams, seed: int) -> str:
    """`t=0.7 seed=0`, plus the filters that differ from their defaults."""
    parts = [f"t={sampled.temperature:g}"]
    parts += [f"top_k={sampled.top_k}"] if sampled.top_k else []
    parts += [f"top_p={sampled.top_p:g}"] if sampled.top_p < 1.0 else []
    parts += [f"min_p={sampled.min_p:g}"] if sampled.min_p > 0.0 else []
    return " ".join([*parts, f"seed={seed}"])


def _rate(flags: list[bool | None]) -> float | None:
    scored = [flag for flag in flags if flag is not None]
    return sum(scored) / len(scored) if scored else None


# ---------------------------------------------------------------- draft agreement


def draft_agreement(draft, continuations: Sequence[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(agreed, total) tokens: teacher-forced greedy agreement of the draft on the target's path.

    Computed with free-running greedy requests, batched: the draft continues prompt + t[:k]; its
    tokens equal what it would predict teacher-forced up to its first difference from t, where
    the target's token is forced and the draft starts again after it. One request per
    disagreement, so a well-matched pair needs few rounds."""
    agreed = 0
    cursors = [0] * len(continuations)
    pending = [i for i, (_, target) in enumerate(continuations) if target]
    while pending:
        prompts = [continuations[i][0] + continuations[i][1][: cursors[i]] for i in pending]
        params = [
            SamplingParams(temperature=0.0, max_tokens=len(continuations[i][1]) - cursors[i])
            for i in pending
        ]
        outputs = draft.generate(prompts, params)
        still = []
        for i, out in zip(pending, outputs, strict=True):
            rest = continuations[i][1][cursors[i] :]
            same = _common_prefix(out.token_ids, rest)
            agreed += same
            cursors[i] += same + 1  # the token at the first difference is the target's
            if cursors[i] < len(continuations[i][1]):
                still.append(i)
        pending = still
    return agreed, sum(len(target) for _, target in continuations)


def _common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


# ---------------------------------------------------------------- report


def format_report(report: dict[str, Any], header: str) -> str:
    """The report as a text table: one column per decoding run, then per-task rates."""
    runs = report["runs"]
    rows = [
        ("tool-selection accuracy", "tool_selection_accuracy", _percent),
        ("first-try call: JSON object", "call_json_rate", _percent),
        ("first-try call: schema-valid", "call_validity", _percent),
        ("call arguments correct", "call_arguments_correct", _percent),
        ("final answer (result supplied)", "final_answer_accuracy", _percent),
        ("end to end (own calls run)", "end_to_end_accuracy", _percent),
        ("every call: schema-valid", "every_call_validity", _percent),
        ("unnecessary tool calls", "unnecessary_tool_calls", _percent),
        ("missed tool calls", "missed_tool_calls", _percent),
        ("optional tool calls (no error)", "optional_tool_calls", _percent),
        ("mean tokens to answer", "mean_tokens_to_answer", lambda v: f"{v:.1f}"),
        ("seconds", "seconds", lambda v: f"{v:.1f}"),
    ]
    width = max(14, *(len(label) for label in runs)) + 2
    lines = [header, "", f"{'':<32}" + "".join(f"{label:>{width}}" for label in runs)]
    for title, key, fmt in rows:
        cells = [runs[label].get(key) for label in runs]
        lines.append(f"{title:<32}" + "".join(f"{_cell(v, fmt):>{width}}" for v in cells))
    agreement = report.get("draft_greedy_agreement")
    if agreement:
        lines.append(
            f"{'draft/target greedy agreement':<32}{_cell(agreement['rate'], _percent):>{width}}"
            f"   ({agreement['agreed_tokens']}/{agreement['target_tokens']} tokens)"
        )
    lines += ["", _task_table(runs)]
    if "by_kind" in next(iter(runs.values())):
        lines += ["", _kind_table(runs)]
    lines += ["", "Definitions:"]
    for key, text in DEFINITIONS.items():
        lines += textwrap.wrap(f"{key}: {text}", 100, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def _task_table(runs: dict[str, dict[str, Any]]) -> str:
    """Per task, for each run: selection / final answer accuracy."""
    tasks = next(iter(runs.values()))["by_task"]
    lines = [f"{'per task (n): selection / final':<32}" + "".join(f"{label:>20}" for label in runs)]
    for task, stats in tasks.items():
        cells = [
            f"{_cell(r['by_task'][task]['tool_selection_accuracy'], _percent)} / "
            f"{_cell(r['by_task'][task]['final_answer_accuracy'], _percent)}"
            for r in runs.values()
        ]
        name = f"{task} ({stats['examples']})"
        lines.append(f"{name:<32}" + "".join(f"{cell:>20}" for cell in cells))
    return "\n".join(lines)


def _kind_table(runs: dict[str, dict[str, Any]]) -> str:
    """Per phrasing kind (natural split), for each run: selection / end-to-end accuracy."""
    kinds = next(iter(runs.values()))["by_kind"]
    lines = [f"{'per kind (n): selection / e2e':<32}" + "".join(f"{label:>20}" for label in runs)]
    for kind, stats in kinds.items():
        cells = [
            f"{_cell(r['by_kind'][kind]['tool_selection_accuracy'], _percent)} / "
            f"{_cell(r['by_kind'][kind]['end_to_end_accuracy'], _percent)}"
            for r in runs.values()
        ]
        name = f"{kind} ({stats['examples']})"
        lines.append(f"{name:<32}" + "".join(f"{cell:>20}" for cell in cells))
    return "\n".join(lines)


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def _cell(value: Any, fmt: Callable[[Any], str]) -> str:
    return "-" if value is None else fmt(value)
