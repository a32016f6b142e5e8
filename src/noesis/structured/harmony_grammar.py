"""The Harmony assistant-turn grammar: what a model may write after a prompt that ends with
`<|start|>assistant`, given the request's tools, tool_choice and response_format.

One turn, as noesis.tiny.harmony renders it (the first header's `<|start|>assistant` is the
prompt's):

    (<|channel|>analysis<|message|>TEXT<|end|><|start|>assistant)*
    then  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
    or    <|channel|>final<|message|>TEXT<|return|>

ARGS follows the tool's parameter schema; a property marked `x-noesis-grounded` must copy a span
of the user's words in `messages` (noesis.structured.grounding), so the grammar is built per
turn. Free text holds no special token, and no spelled-out `<|` either (decoded text is parsed
by its markers); a final's text also never says `to=functions`. A json_schema / json_object
response_format makes the final's text that JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from noesis.structured.grounding import ground, source_texts
from noesis.structured.matcher import GrammarError, GrammarSpec

TOOL_CHOICES = ("auto", "none", "required")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ANY_OBJECT = {"type": "object"}

# Lexemes: any text without "<|"; the final's text also without "to=functions".
_TEXT_LEXEMES = r"""
TEXT: /(?s:.*)/ & ~/(?s:.*)<\|(?s:.*)/
FINAL_TEXT: /(?s:.*)/ & ~/(?s:.*)(<\||to=functions)(?s:.*)/
"""


def harmony_turn_spec(
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] = "auto",
    response_format: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
    analysis: bool = True,
) -> GrammarSpec:
    return GrammarSpec.lark(
        harmony_turn_grammar(tools, tool_choice, response_format, messages, analysis)
    )


def harmony_turn_grammar(
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] = "auto",
    response_format: dict[str, Any] | None = None,
    messages: list[dict[str, Any]] | None = None,
    analysis: bool = True,
) -> str:
    """Lark text (llguidance dialect) of one assistant turn; GrammarError on a bad option.
    `messages` (the conversation so far) supplies the user's words and the tools' results that
    grounded arguments copy;
    without it they decode as their plain schema. `analysis=False` forbids analysis messages:
    the turn opens with its call or its final (noesis.control.skip)."""
    functions = _functions(tools or [])
    texts = source_texts(messages)
    functions = {name: ground(schema, texts) for name, schema in functions.items()}
    callable_names = _callable(functions, tool_choice)
    final = _final_body(response_format)
    may_answer = tool_choice in ("auto", "none")  # "required" and a named tool force a call
    endings = (["call"] if callable_names else []) + (["final"] if may_answer else [])
    lines = [
        "start: " + ('(analysis <|end|> <|start|> "assistant")* ' if analysis else "")
        + _alternatives(endings),
        'analysis: <|channel|> "analysis" <|message|> TEXT',
        f'final: <|channel|> "final" <|message|> {final} <|return|>',
    ]
    if callable_names:
        rules = [f"call_{i}" for i in range(len(callable_names))]
        lines.append("call: " + " | ".join(rules))
        for rule, name in zip(rules, callable_names, strict=True):
            lines.append(_call_rule(rule, name, functions[name]))
    return "\n".join(lines) + "\n" + _TEXT_LEXEMES


def _alternatives(rules: list[str]) -> str:
    return rules[0] if len(rules) == 1 else "(" + " | ".join(rules) + ")"


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> parameter schema, in declaration order."""
    if not isinstance(tools, list):
        raise GrammarError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise GrammarError(f"tools[{index}] must be a {{'type': 'function', ...}} object")
        function = tool.get("function", tool)
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise GrammarError(f"tools[{index}] has an invalid name {name!r} (want [A-Za-z0-9_-])")
        if name in functions:
            raise GrammarError(f"tool {name!r} is declared twice")
        parameters = function.get("parameters") or _ANY_OBJECT
        if not isinstance(parameters, dict):
            raise GrammarError(f"tool {name!r} parameters must be a JSON schema object")
        functions[name] = parameters
    return functions


def _callable(functions: dict[str, dict[str, Any]], tool_choice: str | dict[str, Any]):
    """The tool names a call may name under `tool_choice`."""
    if isinstance(tool_choice, dict):
        name = _named_choice(tool_choice)
        if name not in functions:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools")
        return [name]
    if tool_choice not in TOOL_CHOICES:
        raise GrammarError(f"tool_choice must be one of {TOOL_CHOICES} or a function object")
    if tool_choice == "required" and not functions:
        raise GrammarError("tool_choice 'required' needs at least one tool")
    return [] if tool_choice == "none" else list(functions)


def _named_choice(tool_choice: dict[str, Any]) -> str:
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise GrammarError(
            "a tool_choice object must be {'type': 'function', 'function': {'name': ...}}"
        )
    return function.get("name")


def _final_body(response_format: dict[str, Any] | None) -> str:
    schema = response_format_schema(response_format)
    return "FINAL_TEXT" if schema is None else "%json " + _compact(schema)


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI `response_format` -> the JSON schema the reply must match (None: free text).
    A schema sent as JSON text is parsed; anything malformed is a GrammarError (a 400)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _ANY_OBJECT
    if kind != "json_schema":
        raise GrammarError(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise GrammarError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
    schema = wrapper["schema"]
    if isinstance(schema, str):  # some clients send the schema as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"response_format schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise GrammarError("response_format json_schema.schema must be a JSON object")
    return schema


def _call_rule(rule: str, name: str, parameters: dict[str, Any]) -> str:
    header = json.dumps(f"commentary to=functions.{name} ")
    return (
        f'{rule}: <|channel|> {header} <|constrain|> "json" <|message|> '
        f"%json {_compact(parameters)} <|call|>"
    )


def _compact(schema: dict[str, Any]) -> str:
    """The schema for %json with no optional whitespace: models trained on compact JSON (and
    random weights) would otherwise be free to emit newlines without end."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


# Shared with the text dialects' turn grammars (noesis.dialects.grammar).
tool_schemas = _functions
callable_tools = _callable
compact_schema = _compact
