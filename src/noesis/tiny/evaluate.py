"""Scoring of noesis-tiny conversations: pure functions from an Example and generated Harmony text
to scores, and their summary. Running the model is the eval harness's job (engine side).

A harness makes two generations per example: one from `render(example.prompt_messages, tools,
add_generation_prompt=True)`, scored with `score_call` (and with `final_correct` when no call is
expected), and one from `example.messages_before_final`, where the tool result is supplied, scored
with `final_correct`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from noesis.tiny.corpus import Example
from noesis.tiny.harmony import Completion, parse_completion
from noesis.tiny.tools import execute, validate

FUNCTIONS_PREFIX = "functions."


@dataclass(frozen=True)
class CallScore:
    """What the model did where the example expects a tool call or none."""

    called: str | None  # the tool named in the first call, None when the model made no call
    selection_correct: bool  # called == expected_tool, a missing call counting as None
    arguments_json: bool  # the call's arguments parse as a JSON object
    arguments_valid: bool  # ... and validate against the declared tool's schema
    arguments_correct: bool  # ... and mean the expected call (same result when executed)
    answered_directly: bool  # a final message came without a call


def first_call(completion: Completion) -> tuple[str, str] | None:
    """(tool name, arguments text) of the first message addressed to a function."""
    call = completion.tool_call
    if call is None or call.recipient is None:
        return None
    return call.recipient.removeprefix(FUNCTIONS_PREFIX), call.content


def score_call(example: Example, generated: str) -> CallScore:
    """Score the text generated after `<|start|>assistant` for the example's prompt."""
    completion = parse_completion(generated)
    found = first_call(completion)
    if found is None:
        selected = example.expected_tool is None
        return CallScore(None, selected, False, False, False, completion.final is not None)
    name, arguments_text = found
    arguments = _json_object(arguments_text)
    valid = arguments is not None and _valid_for_declared(example, name, arguments)
    correct = valid and name == example.expected_tool and _same_call(example, name, arguments)
    return CallScore(
        name, name == example.expected_tool, arguments is not None, valid, correct, False
    )


def final_correct(example: Example, generated: str) -> bool | None:
    """Whether the final answer in the generated text holds the expected answer (case-insensitive).
    None when the example's answer is not scored (free writing)."""
    if example.expected_answer is None:
        return None
    final = parse_completion(generated).final
    return final is not None and example.expected_answer.casefold() in final.casefold()


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
