"""Harmony messages, and the conversion of OpenAI-style chat messages and tools into them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from noesis.errors import InvalidRequest
from noesis.harmony.layout import (
    GPT_OSS,
    FunctionTool,
    Layout,
    check_function_name,
    developer_text,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning", "reasoning_content", "thinking")  # where clients put analysis text
FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class Message:
    """One Harmony message. A tool's result has role "tool" and its name ("functions.NAME") as
    `name`; an assistant's tool call has recipient "functions.NAME"."""

    role: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None  # e.g. "<|constrain|>json"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"Harmony role {self.role!r} is not one of {ROLES}")
        if self.role == "tool" and not self.name:
            raise InvalidRequest("a tool message needs the tool's name (e.g. 'functions.lookup')")


def from_openai(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    layout: Layout = GPT_OSS,
) -> list[Message]:
    """Harmony messages for an OpenAI-style conversation: the layout's system message, a developer
    message with the leading system/developer instructions and the tools, then the turns."""
    functions = [FunctionTool.from_openai(tool) for tool in tools or ()]
    instructions, turns = _split_instructions(messages)
    out = [Message("system", layout.system.text(bool(functions)))] if layout.system else []
    developer = developer_text(instructions, functions)
    if developer is not None:
        out.append(Message("developer", developer))
    return out + _turns(turns, layout)


def content_text(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_part(part) for part in content)
    raise InvalidRequest(f"message content must be a string or a list of parts, got {content!r}")


def _text_part(part: Any) -> str:
    if not isinstance(part, dict):
        raise InvalidRequest(f"a content part must be a dict, got {part!r}")
    if part.get("type") != "text":
        return ""  # images and audio have no Harmony text form
    return part.get("text") or ""


def _split_instructions(
    messages: Sequence[dict[str, Any]],
) -> tuple[str, Sequence[dict[str, Any]]]:
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"a chat message must be a dict with a 'role', got {message!r}")
    if messages and messages[0]["role"] in ("system", "developer"):
        return content_text(messages[0].get("content")), messages[1:]
    return "", messages


def _turns(messages: Sequence[dict[str, Any]], layout: Layout) -> list[Message]:
    out: list[Message] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name
    last_call = ""
    for message in messages:
        role = message["role"]
        if role == "user":
            out.append(Message("user", content_text(message.get("content"))))
        elif role == "assistant":
            calls = [_call(call) for call in message.get("tool_calls") or ()]
            out += _assistant(message, calls, layout)
            call_names.update((call_id, name) for call_id, name, _ in calls if call_id)
            last_call = calls[-1][1] if calls else last_call
        elif role == "tool":
            out.append(_tool_result(message, call_names, last_call))
        elif role in ("system", "developer"):
            raise InvalidRequest(f"a {role} message is only accepted as the first message")
        else:
            raise InvalidRequest(f"unknown chat role {role!r} (expected one of {ROLES})")
    return out


def _assistant(
    message: dict[str, Any], calls: list[tuple[str | None, str, str]], layout: Layout
) -> list[Message]:
    """Analysis, then either the tool calls (any text before them as a commentary preamble) or
    the final answer."""
    out = []
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k)), None)
    if reasoning:
        out.append(Message("assistant", content_text(reasoning), channel="analysis"))
    text = content_text(message.get("content"))
    if not calls:
        return out + [Message("assistant", text, channel="final")]
    if text:
        out.append(Message("assistant", text, channel="commentary"))
    for _, name, arguments in calls:
        out.append(
            Message(
                "assistant",
                arguments,
                channel="commentary",
                recipient=FUNCTIONS + name,
                content_type=layout.tool_call_content_type,
            )
        )
    return out


def _call(call: Any) -> tuple[str | None, str, str]:
    """(id, function name, arguments JSON text) of an OpenAI tool call."""
    if not isinstance(call, dict):
        raise InvalidRequest(f"a tool call must be a dict, got {call!r}")
    function = call.get("function", call)
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tool call {call!r} has no function name")
    return call.get("id"), check_function_name(name), _arguments(function.get("arguments"))


def _arguments(arguments: Any) -> str:
    # A string is the exact JSON text the model produced; anything else becomes compact JSON.
    if isinstance(arguments, str):
        return arguments
    return json.dumps(
        {} if arguments is None else arguments, ensure_ascii=False, separators=(",", ":")
    )


def _tool_result(message: dict[str, Any], call_names: dict[str, str], last_call: str) -> Message:
    name = message.get("name") or call_names.get(message.get("tool_call_id") or "") or last_call
    if not name:
        raise InvalidRequest(
            "a tool message needs a 'name' or a 'tool_call_id' of an earlier tool call"
        )
    if not isinstance(name, str):
        raise InvalidRequest(f"a tool message's name must be a string, got {name!r}")
    name = check_function_name(name.removeprefix(FUNCTIONS))
    return Message(
        "tool",
        content_text(message.get("content")),
        channel="commentary",
        recipient="assistant",
        name=FUNCTIONS + name,
    )
