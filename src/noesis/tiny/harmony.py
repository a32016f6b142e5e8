"""Harmony text for noesis-tiny: render OpenAI-style messages and tools, parse a completion back.

`render` is the reference that the jinja chat template (template.py) must match byte for byte; the
corpus is rendered with it. Layout follows gpt-oss: a fixed system message, a developer message with
the instructions and the tools as a TypeScript-like namespace, then the conversation.

The result is text in which a message's own `<|end|>` reads like the real token: fine for the
corpus we write, never for what users send. Prompts are encoded with `Tokenizer.encode_chat`,
which renders the same text through the template and keeps the users' spellings text.
"""

from __future__ import annotations

import json
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDOFTEXT, STARTOFTEXT = "<|endoftext|>", "<|startoftext|>"
# Order fixes the token ids 0..8 of the tokenizer.
SPECIAL_TOKENS = (ENDOFTEXT, STARTOFTEXT, START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

SYSTEM_PROMPT = (
    "You are noesis-tiny, a small assistant that answers questions and calls tools.\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
TOOLS_NOTE = "\nCalls to these tools must go to the commentary channel: 'functions'."
GENERATION_PROMPT = START + "assistant"


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Harmony text of a conversation; a closing assistant final ends with <|return|>."""
    tools = tools or []
    parts = [_system(bool(tools))]
    instructions, conversation = _split_instructions(messages)
    if instructions or tools:
        parts.append(_developer(instructions, tools))
    parts += _conversation(conversation, closing=not add_generation_prompt)
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _system(has_tools: bool) -> str:
    return f"{START}system{MESSAGE}{SYSTEM_PROMPT}{TOOLS_NOTE if has_tools else ''}{END}"


def _split_instructions(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    if messages and messages[0]["role"] in ("system", "developer"):
        return content_text(messages[0].get("content")), messages[1:]
    return "", messages


def _developer(instructions: str, tools: list[dict[str, Any]]) -> str:
    sections = []
    if instructions:
        sections.append(f"# Instructions\n\n{instructions}")
    if tools:
        declared = "".join(typescript(tool) + "\n\n" for tool in tools)
        namespace = f"namespace functions {{\n\n{declared}}} // namespace functions"
        sections.append(f"# Tools\n\n## functions\n\n{namespace}")
    body = "\n\n".join(sections)
    return f"{START}developer{MESSAGE}{body}{END}"


def typescript(tool: dict[str, Any]) -> str:
    """One tool declaration in gpt-oss's TypeScript-like notation."""
    function = tool.get("function", tool)
    header = f"// {function['description']}\n" if function.get("description") else ""
    properties = function.get("parameters", {}).get("properties", {})
    if not properties:
        return f"{header}type {function['name']} = () => any;"
    required = function["parameters"].get("required", [])
    lines = [_property(name, spec, name in required) for name, spec in properties.items()]
    return f"{header}type {function['name']} = (_: {{\n{''.join(lines)}}}) => any;"


def _property(name: str, spec: dict[str, Any], required: bool) -> str:
    comment = f"// {spec['description']}\n" if spec.get("description") else ""
    default = f" // default: {spec['default']}" if "default" in spec else ""
    optional = "" if required else "?"
    return f"{comment}{name}{optional}: {_ts_type(spec)},{default}\n"


def _ts_type(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return " | ".join(f'"{value}"' for value in spec["enum"])
    kind = spec.get("type")
    if kind in ("number", "integer"):
        return "number"
    if kind in ("string", "boolean"):
        return kind
    if kind == "array":
        return _ts_type(spec.get("items", {})) + "[]"
    return "any"


def _conversation(messages: list[dict[str, Any]], closing: bool) -> list[str]:
    parts, last_call = [], ""
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "user":
            parts.append(f"{START}user{MESSAGE}{content_text(message.get('content'))}{END}")
        elif role == "assistant":
            is_last = closing and index == len(messages) - 1
            parts += _assistant(message, is_last)
            calls = message.get("tool_calls") or []
            last_call = _call_function(calls[-1])["name"] if calls else last_call
        elif role == "tool":
            name = message.get("name") or last_call
            body = content_text(message.get("content"))
            parts.append(
                f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{body}{END}"
            )
        else:
            raise ValueError(f"unexpected {role!r} message after the first message")
    return parts


def assistant_text(message: dict[str, Any], is_last: bool) -> str:
    """One assistant turn: analysis, then tool calls or a final (closed by <|return|> if last)."""
    return "".join(_assistant(message, is_last))


def _assistant(message: dict[str, Any], is_last: bool) -> list[str]:
    parts = []
    if message.get("thinking"):
        parts.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{message['thinking']}{END}")
    calls = message.get("tool_calls") or []
    for call in calls:
        function = _call_function(call)
        header = (
            f"{START}assistant{CHANNEL}commentary to=functions.{function['name']} {CONSTRAIN}json"
        )
        parts.append(f"{header}{MESSAGE}{_arguments(function['arguments'])}{CALL}")
    if not calls:
        close = RETURN if is_last else END
        body = content_text(message.get("content"))
        parts.append(f"{START}assistant{CHANNEL}final{MESSAGE}{body}{close}")
    return parts


def _call_function(call: dict[str, Any]) -> dict[str, Any]:
    return call.get("function", call)


def _arguments(arguments: Any) -> str:
    # A string is the exact JSON text the model produced; a dict is compact JSON in key order.
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
