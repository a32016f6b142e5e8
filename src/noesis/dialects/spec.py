"""Tool-call dialects as data: the markers and JSON shape each model family writes its calls and
its reasoning in, and how a family is recognised from its chat template and vocabulary.

Harmony is not here: its calls are header tokens, not text (noesis.harmony)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from noesis.errors import InvalidRequest

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Dialect:
    """How one family writes tool calls in text.

    A call is a JSON object `{"name": NAME, ARGUMENTS_KEY: {...}}`. `call_open` (and
    `call_close`) wrap one call (Hermes) or, with `call_list`, a JSON array of calls (Mistral).
    `bare_calls`: a reply that opens with `{` is a call even without `call_open` (Llama 3.x).
    `separator` joins parallel calls as the family's template renders them."""

    name: str
    call_open: str | None
    call_close: str | None = None
    call_list: bool = False
    bare_calls: bool = False
    arguments_key: str = "arguments"
    separator: str = "\n"
    call_id_length: int | None = None  # Mistral's templates insist on 9 alphanumerics

    @property
    def has_calls(self) -> bool:
        return self.call_open is not None or self.bare_calls

    def markers(self, thinks: bool) -> tuple[str, ...]:
        """Spellings free text never holds, so the parser can read what surrounds them."""
        found = [self.call_open, self.call_close] + ([THINK_OPEN, THINK_CLOSE] if thinks else [])
        return tuple(m for m in found if m)

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI-shaped messages -> what this family's template reads: call arguments as
        objects (the wire carries JSON text), reasoning as `reasoning_content`."""
        return [self._template_message(m) for m in messages]

    def _template_message(self, message: dict[str, Any]) -> dict[str, Any]:
        out = dict(message)
        if "thinking" in out and "reasoning_content" not in out:
            out["reasoning_content"] = out["thinking"]
        if out.get("tool_calls"):
            out["tool_calls"] = [self._template_call(c) for c in out["tool_calls"]]
        if out.get("tool_call_id") is not None and self.call_id_length:
            out["tool_call_id"] = self.call_id(out["tool_call_id"])
        return out

    def _template_call(self, call: dict[str, Any]) -> dict[str, Any]:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # the template shows the text as it was
        out = {**call, "function": function}
        if self.call_id_length and call.get("id") is not None:
            out["id"] = self.call_id(call["id"])
        return out

    def call_id(self, call_id: str) -> str:
        """An OpenAI call id in the shape this family's template accepts (the same id always
        maps to the same one, so a call and its result still pair up)."""
        if not self.call_id_length or (call_id.isalnum() and len(call_id) == self.call_id_length):
            return call_id
        digest = hashlib.sha256(call_id.encode()).hexdigest()
        return digest[: self.call_id_length]


HERMES = Dialect("hermes", "<tool_call>", "</tool_call>", separator="\n")
LLAMA3_JSON = Dialect(
    "llama3_json", "<|python_tag|>", bare_calls=True, arguments_key="parameters", separator="; "
)
MISTRAL = Dialect("mistral", "[TOOL_CALLS]", call_list=True, separator=", ", call_id_length=9)
# A family with reasoning but no tool syntax noesis knows (DeepSeek-R1 distills): <think> only.
PLAIN = Dialect("plain", None)

DIALECTS = {d.name: d for d in (HERMES, LLAMA3_JSON, MISTRAL, PLAIN)}
HARMONY = "harmony"
NAMES = (*DIALECTS, HARMONY)


def dialect_named(name: str) -> Dialect | None:
    """The dialect called `name` (None for harmony); InvalidRequest listing the known names."""
    if name == HARMONY:
        return None
    if name not in DIALECTS:
        raise InvalidRequest(f"unknown tool dialect {name!r}; known: {', '.join(NAMES)}")
    return DIALECTS[name]


def detect(template: str | None, vocabulary: Iterable[str]) -> Dialect | None:
    """The dialect a chat template (or, lacking one, a vocabulary) writes calls in; None when
    neither shows any tool syntax noesis knows."""
    text = template or ""
    tokens = set(vocabulary)
    for dialect, signs in _SIGNS:
        if any(sign in text for sign in signs) or (not text and signs[0] in tokens):
            return dialect
    return None


def thinks(template: str | None, vocabulary: Iterable[str]) -> bool:
    """Whether the family writes `<think>` reasoning."""
    return THINK_OPEN in (template or "") or THINK_OPEN in set(vocabulary)


# Checked in order; the first sign of each is also a token of the family's vocabulary.
_SIGNS = (
    (HERMES, ("<tool_call>",)),
    (MISTRAL, ("[TOOL_CALLS]",)),
    (LLAMA3_JSON, ("<|python_tag|>", "<|eom_id|>")),
)
