"""Tool-use eval harness behind `noesis eval tools`: held-out noesis-tiny conversations through an
LLM it is given, the model's tool calls executed for real, scores from noesis.tiny.evaluate. The
`natural` split (noesis.tiny.natural) runs the same way, with rates per phrasing kind as well.

One decoding run makes three batched passes over the examples:
  1. first:    the question -> the model's first turn (a tool call or a direct answer), scored by
               `score_call`; a direct answer is also scored by `final_correct`.
  2. supplied: where a tool is expected, the conversation up to the final answer, with the corpus's
               correct call and the tool's real result supplied -> the final answer.
  3. own:      where the model called a tool in pass 1, that call executed for real and its result
               fed back -> the model's next turn, repeated up to `max_tool_steps` generations.
Greedy always; sampled too when sampling parameters are given. With a draft model, the draft's
greedy agreement with the target is measured on the target's greedy continuations of passes 1-2.
"""

from __future__ import annotations

import dataclasses
import textwrap
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from noesis.errors import InvalidRequest
from noesis.sampling.params import SamplingParams
from noesis.structured.harmony_grammar import harmony_turn_spec
from noesis.structured.matcher import GrammarSpec
from noesis.tiny import chat, corpus, evaluate, natural
from noesis.tiny.corpus import Example
from noesis.tiny.lexicon import Split

# Generate: prompts (token ids) and one SamplingParams each -> generated token ids and text each.
Generate = Callable[[list[list[int]], list[SamplingParams]], list[tuple[list[int], str]]]

# Controllers by name: each takes the LLM and the Generate it wraps and returns a Generate (a
# later issue registers one steered by the model's entropy). None exist yet.
Hook = Callable[[Any, Generate], Generate]
CONTROLLERS: dict[str, Hook] = {}


def _harmony_turn(example: Example) -> GrammarSpec:
    return harmony_turn_spec(example.tools or None, "auto")


# Constraints by name: the grammar each request of an example is sampled under. "harmony": a
# well-formed turn whose tool arguments match the called tool's declared schema.
CONSTRAINTS: dict[str, Callable[[Example], GrammarSpec | None]] = {"harmony": _harmony_turn}

DEFINITIONS = {
    "tool_selection_accuracy": "share of examples whose first turn calls the expected tool, or "
    "calls none when no tool is expected",
    "call_json_rate": "share of first-turn tool calls whose arguments parse as a JSON object",
    "call_validity": "share of first-turn tool calls whose arguments parse and validate against "
    "the called tool's declared schema, on the first try (unconstrained: the baseline)",
    "call_arguments_correct": "share of first-turn tool calls that are valid and give the "
    "expected tool result when executed",
    "final_answer_accuracy": "share of scored examples whose final answer contains the expected "
    "answer, with the correct tool result supplied (direct answers: from the first turn)",
    "end_to_end_accuracy": "the same, with the model's own call executed for real and its result "
    "fed back",
    "mean_tokens_to_answer": "generated tokens from the question to the end of the model's own "
    "answer (first turn plus the turns after its own tool calls)",
    "draft_greedy_agreement": "over the target's greedy continuations t (first turns, and finals "
    "with the result supplied), the share of positions i where the draft's greedy token given "
    "prompt + t[:i] equals t[i]: the per-token acceptance of greedy speculative decoding",
}


SPLITS = ("heldout", "train", natural.SPLIT)  # natural: noesis.tiny.natural, not the corpus


@dataclass(frozen=True)
class EvalConfig:
    split: Split | str = "heldout"  # one of SPLITS
    n: int = 200
    corpus_seed: int = 1234  # the held-out seed of the preliminary transformers check
    max_tokens: int = 128  # per generation
    # A sampled run besides the greedy one, with these parameters (temperature, top_p, ...); the
    # harness sets each request's seed (see request_seed), max_tokens and special-token output.
    sampled: SamplingParams | None = None
    seed: int = 0
    max_tool_steps: int = 3  # generations after the first turn in passes 2-3 (at least 1)
    constraint: str | None = None  # a name in CONSTRAINTS
    controller: str | None = None  # a name in CONTROLLERS


@dataclass(slots=True)
class Trace:
    """What the model did on one example in one decoding run."""

    example: Example
    conversation: list[dict[str, Any]]  # grows with the model's own calls and their results
    first_text: str = ""
    supplied_text: str | None = None  # pass 2's final turn
    own_text: str | None = None  # pass 3's last turn
    tokens_to_answer: int = 0  # pass 1 + pass 3 generated tokens


@dataclass
class RunResult:
    """One decoding setting's scores and summary, and (greedy) the target's continuations."""

    label: str
    scores: list[evaluate.ExampleScore]
    summary: dict[str, Any]
    seconds: float
    continuations: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (prompt, ids)


def evaluate_tools(llm, config: EvalConfig, draft=None) -> dict[str, Any]:
    """Run the harness; returns the report (summaries, definitions, per-example scores)."""
    if config.n < 1 or config.max_tool_steps < 1:
        raise InvalidRequest("n and max_tool_steps must be >= 1")
    generate = generator(llm, config.controller)
    constraint = _constraint(config.constraint)
    examples = eval_examples(config)
    runs = [run(generate, llm, examples, config, None, constraint)]
    if config.sampled is not None:
        runs.append(run(generate, llm, examples, config, config.sampled, constraint))
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
    if config.split not in SPLITS:
        raise InvalidRequest(f"unknown split {config.split!r} (available: {', '.join(SPLITS)})")
    return corpus.generate(config.corpus_seed, config.split, config.n)


def generator(llm, controller: str | None = None) -> Generate:
    """The engine's batched generate, wrapped by the named controller."""
    generate = _engine_generate(llm)
    if controller is not None:
        generate = _named("controller", controller, CONTROLLERS)(llm, generate)
    return generate


def _constraint(name: str | None):
    return None if name is None else _named("constraint", name, CONSTRAINTS)


def _named(kind: str, name: str, table: dict[str, Any]):
    if name not in table:
        known = ", ".join(table) or "none yet"
        raise InvalidRequest(f"unknown {kind} {name!r} (available: {known})")
    return table[name]


def _engine_generate(llm) -> Generate:
    def generate(prompts: list[list[int]], params: list[SamplingParams]):
        if not prompts:
            return []
        return [(out.token_ids, out.text) for out in llm.generate(prompts, params)]

    return generate


def request_seed(seed: int, example_id: str, step: str) -> int:
    """A sampled request's seed: fixed by (run seed, example, pass), whatever shares the batch."""
    return zlib.crc32(f"{seed}/{example_id}/{step}".encode())


# ---------------------------------------------------------------- one decoding run


def run(
    generate: Generate,
    llm,
    examples: list[Example],
    config: EvalConfig,
    sampled: SamplingParams | None,
    constraint: Callable[[Example], GrammarSpec | None] | None = None,
) -> RunResult:
    """Passes 1-3 over every example under one decoding setting (greedy when sampled is None)."""
    began = time.perf_counter()
    label = "greedy" if sampled is None else _label(sampled, config.seed)
    base = sampled or SamplingParams(temperature=0.0)

    def params(example: Example, step: str) -> SamplingParams:
        seed = None if sampled is None else request_seed(config.seed, example.id, step)
        grammar = constraint(example) if constraint is not None else None
        return dataclasses.replace(
            base, seed=seed, max_tokens=config.max_tokens, skip_special_tokens=False,
            grammar=grammar,
        )

    traces = [Trace(e, list(e.prompt_messages)) for e in examples]
    prompts = [_render(llm, t.conversation, t.example) for t in traces]
    firsts = generate(prompts, [params(t.example, "first") for t in traces])
    for trace, (ids, text) in zip(traces, firsts, strict=True):
        trace.first_text, trace.tokens_to_answer = text, len(ids)
    supplied = _finals(llm, generate, traces, params, config.max_tool_steps)
    scores = [_score(trace) for trace in traces]
    summary = evaluate.summarize(scores)
    summary["end_to_end_accuracy"] = _rate(
        [evaluate.final_correct(t.example, _last_turn(t)) for t in traces]
    )
    if any(isinstance(e, natural.NaturalExample) for e in examples):
        summary["by_kind"] = _by_kind(traces, scores)
    result = RunResult(label, scores, summary, time.perf_counter() - began)
    if sampled is None:
        result.continuations = [(p, ids) for p, (ids, _) in zip(prompts, firsts, strict=True)]
        result.continuations += supplied
    return result


def _by_kind(traces: list[Trace], scores: list[evaluate.ExampleScore]) -> dict[str, Any]:
    """Per phrasing kind of the natural split: selection, arguments, final and end-to-end rates."""
    groups: dict[str, list[tuple[Trace, evaluate.ExampleScore]]] = {}
    for trace, score in zip(traces, scores, strict=True):
        example = trace.example
        kind = example.kind if isinstance(example, natural.NaturalExample) else ""
        groups.setdefault(kind, []).append((trace, score))
    return {
        kind: {
            "examples": len(pairs),
            "tool_selection_accuracy": _rate([s.call.selection_correct for _, s in pairs]),
            "call_arguments_correct": _rate(
                [s.call.arguments_correct for _, s in pairs if s.call.called is not None]
            ),
            "final_answer_accuracy": _rate([s.final_correct for _, s in pairs]),
            "end_to_end_accuracy": _rate(
                [evaluate.final_correct(t.example, _last_turn(t)) for t, _ in pairs]
            ),
        }
        for kind, pairs in groups.items()
    }


def _label(sampled: SamplingParams, seed: int) -> str:
    """`t=0.7 seed=0`, plus the filters that differ from their defaults."""
    parts = [f"t={sampled.temperature:g}"]
    parts += [f"top_k={sampled.top_k}"] if sampled.top_k else []
    parts += [f"top_p={sampled.top_p:g}"] if sampled.top_p < 1.0 else []
    parts += [f"min_p={sampled.min_p:g}"] if sampled.min_p > 0.0 else []
    return " ".join([*parts, f"seed={seed}"])


def _render(llm, messages: list[dict[str, Any]], example: Example) -> list[int]:
    return llm.render_chat(messages, example.tools or None)


def _finals(llm, generate: Generate, traces: list[Trace], params, max_tool_steps: int):
    """Passes 2 and 3, batched together; pass 3 goes on while the model calls tools. Returns pass
    2's (prompt, generated ids)."""
    jobs = [("supplied", t) for t in traces if t.example.expected_tool is not None]
    jobs += [("own", t) for t in traces if _feed_call(t, t.first_text)]
    supplied: list[tuple[list[int], list[int]]] = []
    for step in range(max_tool_steps):
        if not jobs:
            break
        prompts = [
            _render(llm, t.example.messages_before_final if kind == "supplied" else t.conversation,
                    t.example)
            for kind, t in jobs
        ]  # fmt: skip
        outputs = generate(prompts, [params(t.example, f"{kind}{step}") for kind, t in jobs])
        next_jobs = []
        for (kind, trace), prompt, (ids, text) in zip(jobs, prompts, outputs, strict=True):
            if kind == "supplied":
                trace.supplied_text = text
                supplied.append((prompt, ids))
                continue
            trace.own_text = text
            trace.tokens_to_answer += len(ids)
            if _feed_call(trace, text):
                next_jobs.append(("own", trace))
        jobs = next_jobs
    return supplied


def _feed_call(trace: Trace, text: str) -> bool:
    """If the model's turn calls a tool, run it and append the call and its result."""
    action = chat.next_action(chat.parse_stream(text))
    if not isinstance(action, tuple):
        return False
    analysis, name, arguments = action
    result = chat.run_declared(trace.example.tools, name, arguments)
    call_id = f"call_{len(trace.conversation)}"
    trace.conversation += chat.call_messages(analysis, name, arguments, result, call_id)
    return True


def _score(trace: Trace) -> evaluate.ExampleScore:
    example = trace.example
    final_text = trace.first_text if example.expected_tool is None else trace.supplied_text
    return evaluate.ExampleScore(
        example.id,
        example.task,
        example.expected_tool,
        evaluate.score_call(example, trace.first_text),
        evaluate.final_correct(example, final_text or ""),
        trace.tokens_to_answer,
    )


def _last_turn(trace: Trace) -> str:
    return trace.first_text if trace.own_text is None else trace.own_text


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
