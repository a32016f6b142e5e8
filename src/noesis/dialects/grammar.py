"""The turn grammar of a text dialect (llguidance lark): optional `<think>` reasoning, then
either an answer or one or more calls whose arguments follow the declared schemas, under
tool_choice and parallel_tool_calls. The text dialects' counterpart of harmony_grammar.py.

    start: [<think> THOUGHT </think>] WS? (answer | calls)

An answer is free text that never spells a marker of the dialect (nor opens with `{` where a bare
`{` opens a call), or the response_format's JSON. A call is the family's own shape, the name first:
Hermes `<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>`, Llama 3.x
`{"name": N, "parameters": ARGS}` (after an optional <|python_tag|>), Mistral
`[TOOL_CALLS] [{"name": N, "arguments": ARGS}, ...]`. A thinking budget bounds the reasoning in
tokens; at the budget only `</think>` may follow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from noesis.dialects.spec import THINK_CLOSE, THINK_OPEN, Dialect
from noesis.structured.grounding import ground, source_texts
from noesis.structured.harmony_grammar import callable_tools, response_format_schema, tool_schemas
from noesis.structured.matcher import GrammarError, GrammarSpec

# "optional": the model may open <think>; "open": the prompt opened it, the reply closes it;
# "off": no reasoning (the family has none, or the prompt closed it already).
ThinkMode = Literal["optional", "open", "off"]


@dataclass(frozen=True)
class TurnOptions:
    """What one turn's grammar depends on besides the tools."""

    tool_choice: str | dict[str, Any] = "auto"
    response_format: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None  # for grounded arguments
    think: ThinkMode = "off"
    thinking_budget: int | None = None  # tokens of reasoning at most
    parallel_tool_calls: bool = True


def dialect_turn_spec(
    dialect: Dialect,
    token: Callable[[str], str],
    tools: list[dict[str, Any]] | None,
    options: TurnOptions,
) -> GrammarSpec:
    return GrammarSpec.lark(dialect_turn_grammar(dialect, token, tools, options))


def dialect_turn_grammar(
    dialect: Dialect,
    token: Callable[[str], str],
    tools: list[dict[str, Any]] | None,
    options: TurnOptions,
) -> str:
    """Lark text of one turn; GrammarError on a bad option. `token(marker)` is the grammar term
    of a marker: its token (`<[id]>`) where the vocabulary has one, else its text."""
    functions = tool_schemas(tools or [])
    texts = source_texts(options.messages)
    functions = {name: ground(schema, texts) for name, schema in functions.items()}
    names = callable_tools(functions, options.tool_choice)
    if names and not dialect.has_calls:
        raise GrammarError(f"the {dialect.name} dialect has no tool-call syntax")
    budget = options.thinking_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise GrammarError(f"thinking_budget must be a whole number of tokens, got {budget!r}")
    if budget is not None and budget < 0:
        raise GrammarError(f"thinking_budget must be >= 0, got {budget}")
    may_answer = options.tool_choice in ("auto", "none")
    endings = (["answer"] if may_answer else []) + (["calls"] if names else [])
    lines = [
        "start: " + _think_head(options.think, budget) + "WS? " + _alternatives(endings),
        *_think_rules(token, options.think, budget),
        "answer: " + _answer(options.response_format),
    ]
    if names:
        lines += _call_rules(dialect, token, functions, names, options.parallel_tool_calls)
    lines += _lexemes(dialect, options.think != "off", calls=bool(names))
    return "\n".join(lines) + "\n"


def _think_head(think: ThinkMode, budget: int | None) -> str:
    if think == "open":
        return "thought "
    if think == "optional" and budget != 0:
        return "thought? "
    return ""


def _think_rules(token: Callable[[str], str], think: ThinkMode, budget: int | None) -> list[str]:
    if think == "off" or (think == "optional" and budget == 0):
        return []
    opener = "" if think == "open" else token(THINK_OPEN) + " "
    closer = token(THINK_CLOSE)
    if budget == 0:
        return [f"thought: {opener}{closer}"]
    limit = "" if budget is None else f"[max_tokens={budget}]"
    return [f"thought: {opener}reasoning? {closer}", f"reasoning{limit}: THOUGHT"]


def _answer(response_format: dict[str, Any] | None) -> str:
    schema = response_format_schema(response_format)
    return "TEXT" if schema is None else "%json " + _schema_text(schema)


def _call_rules(
    dialect: Dialect,
    token: Callable[[str], str],
    functions: dict[str, dict[str, Any]],
    names: list[str],
    parallel: bool,
) -> list[str]:
    rules = [f"call_{i}" for i in range(len(names))]
    separator = json.dumps(dialect.separator)
    if dialect.call_list:  # Mistral: one marker, a JSON array of calls
        repeat = f" ({json.dumps(', ')} call)*" if parallel else ""
        head = [f'calls: {token(dialect.call_open)} " [" call{repeat} "]"']
    elif dialect.call_close:  # Hermes: each call wrapped
        repeat = f" ({separator} wrapped)*" if parallel else ""
        head = [
            f"calls: wrapped{repeat}",
            f'wrapped: {token(dialect.call_open)} "\\n" call "\\n" {token(dialect.call_close)}',
        ]
    else:  # Llama 3.x: bare JSON, or after <|python_tag|>
        repeat = f" ({separator} call)*" if parallel else ""
        head = [f"calls: {token(dialect.call_open)}? call{repeat}"]
    lines = [*head, "call: " + " | ".join(rules)]
    for rule, name in zip(rules, names, strict=True):
        prefix = json.dumps(f'{{"name": "{name}", "{dialect.arguments_key}": ')
        lines.append(f'{rule}: {prefix} %json {_schema_text(functions[name])} "}}"')
    return lines


def _schema_text(schema: dict[str, Any]) -> str:
    """The schema for %json, written as the families' templates write JSON (Python's json.dumps
    separators, no other whitespace): what the model has seen, and no room for endless blanks."""
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return json.dumps({**schema, "x-guidance": layout})


def _alternatives(rules: list[str]) -> str:
    return rules[0] if len(rules) == 1 else "(" + " | ".join(rules) + ")"


def _lexemes(dialect: Dialect, thinks: bool, calls: bool) -> list[str]:
    markers = dialect.markers(thinks)
    forbidden = "|".join(re.escape(m).replace("/", "\\/") for m in markers)
    first = r"[^\s{]" if dialect.bare_calls and calls else r"[^\s]"  # `{` would open a call
    text = f"TEXT: /(?s:{first}.*)/"
    if forbidden:
        text += f" & ~/(?s:.*)({forbidden})(?s:.*)/"
    lines = [text, r"WS: /[ \n]{1,2}/"]  # bounded: random or unsure models pad without end
    if thinks:
        lines.append(f"THOUGHT: /(?s:.+)/ & ~/(?s:.*)({forbidden})(?s:.*)/")
    return lines
