"""Scoring of noesis-tiny conversations: pure functions from an Example and a generated turn to
scores, and their summary. Running the model is the eval harness's job (engine side).

A turn is anything with `tool_calls` (each with `name` and `arguments`) and `final`: a Session's
AssistantTurn, or a noesis.harmony ParsedTurn (`parse_text` reads another runtime's text).
A harness makes two generations per example: one from the example's prompt messages, scored with
`score_call` (and with `final_correct` when no call is expected), and one from
`example.messages_before_final`, where the tool result is supplied, scored with `final_correct`.
An example whose call is optional (`Example.tool_optional`) is answered right either way; one
with `later_calls` is a chain, scored end to end on its final and on every call's validity
(`calls_valid`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from noesis.tiny.corpus import Example
from noesis.tools.builtin import execute, validate


class Call(Protocol):
    name: str
    arguments: str


class Turn(Protocol):
    """What scoring reads of a generated turn."""

    @property
    def tool_calls(self) -> Sequence[Call]: ...

    @property
    def final(self) -> str | None: ...


@dataclass(frozen=True)
class CallScore:
    """What the model did where the example expects a tool call or none."""

    called: str | None  # the tool named in the first call, None when the model made no call
    selection_correct: bool  # called == expected_tool, a missing call counting as None
    arguments_json: bool  # the call's arguments parse as a JSON object
    arguments_valid: bool  # ... and validate against the declared tool's schema
    arguments_correct: bool  # ... and mean the expected call (same result when executed)
    answered_directly: bool  # a final message came without a call


def first_call(turn: Turn) -> tuple[str, str] | None:
    """(tool name, arguments text) of the turn's first tool call."""
    calls = turn.tool_calls
    return (calls[0].name, calls[0].arguments) if calls else None


def score_call(example: Example, turn: Turn) -> CallScore:
    """Score the model's first turn for the example's prompt."""
    found = first_call(turn)
    if found is None:
        selected = example.expected_tool is None or example.tool_optional
        return CallScore(None, selected, False, False, False, turn.final is not None)
    name, arguments_text = found
    arguments = _json_object(arguments_text)
    valid = arguments is not None and _valid_for_declared(example, name, arguments)
    correct = valid and name == example.expected_tool and _same_call(example, name, arguments)
    return CallScore(
        name, name == example.expected_tool, arguments is not None, valid, correct, False
    )


def final_correct(example: Example, turn: Turn | None) -> bool | None:
    """Whether the turn's final answer holds the expected answer (case-insensitive); False without
    a turn. None when the example's answer is not scored (free writing)."""
    if example.expected_answer is None:
        return None
    final = turn.final if turn is not None else None
    return final is not None and example.expected_answer.casefold() in final.casefold()


def calls_valid(example: Example, turns: Sequence[Turn]) -> list[bool]:
    """Per tool call the turns made, in order: do its arguments parse as a JSON object that
    validates against the called tool's declared schema (first try: each call as written)?"""
    flags = []
    for turn in turns:
        for call in turn.tool_calls:
            arguments = _json_object(call.arguments)
            valid = arguments is not None and _valid_for_declared(example, call.name, arguments)
            flags.append(valid)
    return flags


def route_rates(examples: Sequence[Example], scores: Sequence[ExampleScore]) -> dict[str, Any]:
    """Where the first turn went against where it should: calls where none was expected
    (unnecessary), none where one was required (missed), and calls where either was right
    (optional_tool_calls: not an error either way). Each a share with its count."""
    pairs = list(zip(examples, scores, strict=True))
    called = {
        "unnecessary_tool_calls": [s.call.called is not None for e, s in pairs
                                   if e.expected_tool is None],
        "missed_tool_calls": [s.call.called is None for e, s in pairs
                              if e.expected_tool is not None and not e.tool_optional],
        "optional_tool_calls": [s.call.called is not None for e, s in pairs if e.tool_optional],
    }  # fmt: skip
    rates: dict[str, Any] = {}
    for name, flags in called.items():
        rates[name] = _rate(flags)
        rates[f"{name}_n"] = len(flags)
    return rates


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _valid_for_declared(example: Example, name: str, arguments: dict[str, Any]) -> bool:
    for tool in example.tools:
        function = tool.get("function", tool)
        if function["name"] == name:
            return not validate(function.get("parameters", {}), arguments)
    return False


def _same_call(example: Example, name: str, arguments: dict[str, Any]) -> bool:
    if arguments == example.expected_arguments:
        return True
    return execute(name, json.dumps(arguments)) == example.tool_result


# ---------------------------------------------------------------- summary


@dataclass(frozen=True)
class ExampleScore:
    example_id: str
    task: str
    expected_tool: str | None
    call: CallScore
    final_correct: bool | None  # with the tool result supplied (or the direct answer)
    tokens_to_answer: int | None = None
    end_to_end: bool | None = None  # the final after the model's own calls ran (None: unscored)


def summarize(scores: list[ExampleScore]) -> dict[str, Any]:
    """Rates over a run: selection, first-try call validity, final answers, tokens to answer."""
    calls = [s.call for s in scores if s.call.called is not None]
    finals = [s.final_correct for s in scores if s.final_correct is not None]
    tokens = [s.tokens_to_answer for s in scores if s.tokens_to_answer is not None]
    by_task: dict[str, list[ExampleScore]] = {}
    for score in scores:
        by_task.setdefault(score.task, []).append(score)
    return {
        "examples": len(scores),
        "tool_selection_accuracy": _rate([s.call.selection_correct for s in scores]),
        "call_json_rate": _rate([c.arguments_json for c in calls]),
        "call_validity": _rate([c.arguments_valid for c in calls]),
        "call_arguments_correct": _rate([c.arguments_correct for c in calls]),
        "final_answer_accuracy": _rate(finals),
        "mean_tokens_to_answer": sum(tokens) / len(tokens) if tokens else None,
        "by_task": {
            task: {
                "examples": len(items),
                "tool_selection_accuracy": _rate([s.call.selection_correct for s in items]),
                "final_answer_accuracy": _rate(
                    [s.final_correct for s in items if s.final_correct is not None]
                ),
            }
            for task, items in sorted(by_task.items())
        },
    }


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def to_json(scores: list[ExampleScore]) -> list[dict[str, Any]]:
    return [asdict(score) for score in scores]
