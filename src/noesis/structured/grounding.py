"""Grounded tool arguments: the `x-noesis-grounded` schema keyword, resolved per turn into a plain
JSON Schema `enum` of spans of the user's words, so the sampler can only copy, never invent.

A string property marked `"x-noesis-grounded": true` must be a span of the user's words (or of a
tool's result) in the conversation: one to MAX_SPAN_WORDS consecutive whole words of one user
message or tool result (source_texts; at most
MAX_SPAN_CHARS characters, never spelling `<|`), written as the user wrote them (the whitespace
and punctuation between the words kept), or that span in lower, upper or title case.
`"x-noesis-grounded": {"prefer": [...]}` means the same, except that when some spans equal
(ignoring case) a listed value, only those spans are allowed: a tool with a table steers to the
entries the user named, and still gets a name outside its table when the user named none. With
no user words (or no conversation given) the property is left to its plain schema. The keyword
only ever narrows decoding: the tool declaration a model reads ignores `x-noesis-*` keys, and a
schema without them is returned as the same object.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from noesis.structured.matcher import GrammarError

GROUNDED = "x-noesis-grounded"
MAX_SPAN_WORDS = 8
MAX_SPAN_CHARS = 200  # bounds the grammar when words are far apart (long runs of punctuation)
MAX_CANDIDATES = 4096  # spans x case forms; the latest user message's spans are kept first
# A word: letters/digits, with inner apostrophes, dots and hyphens ("What's", "3.5", "2026-01-31").
_WORD = re.compile(r"\w+(?:['’.\-]\w+)*")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def user_texts(messages: Iterable[dict[str, Any]] | None) -> list[str]:
    """The text of each user message, latest first (OpenAI content: a string or text parts)."""
    return _texts(messages, ("user",))


def source_texts(messages: Iterable[dict[str, Any]] | None) -> list[str]:
    """What grounded arguments may copy: each user message's text and each tool result's,
    latest first. A result is words the conversation holds as surely as the user's: a chain of
    calls passes one call's result to the next (the capital a look-up found, to a string tool)."""
    return _texts(messages, ("user", "tool"))


def _texts(messages: Iterable[dict[str, Any]] | None, roles: tuple[str, ...]) -> list[str]:
    texts = [_content_text(m.get("content")) for m in messages or ()
             if isinstance(m, dict) and m.get("role") in roles]  # fmt: skip
    return texts[::-1]


def is_grounded(schema: Any) -> bool:
    """Whether `schema` uses the extension anywhere (so its grammar depends on the conversation)."""
    return any(GROUNDED in node for node in _schemas(schema))


def ground(schema: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """`schema` with every grounded string property replaced by an enum of the candidate spans of
    `texts` (source_texts). A schema without the extension comes back as the very same object."""
    if not is_grounded(schema):
        return schema
    spans = candidate_spans(texts)
    return _resolve(schema, spans)


def candidate_spans(texts: list[str]) -> list[str]:
    """Every span of 1..MAX_SPAN_WORDS whole words of each text, with its case forms, deduplicated
    in order and capped at MAX_CANDIDATES (earlier texts first)."""
    found: dict[str, None] = {}
    for text in texts:
        words = list(_WORD.finditer(text))
        for first in range(len(words)):
            for last in range(first, min(first + MAX_SPAN_WORDS, len(words))):
                span = text[words[first].start() : words[last].end()]
                if "<|" in span or len(span) > MAX_SPAN_CHARS:  # longer spans only grow
                    break  # (and decoded text is parsed by its markers: never spell one)
                for form in (span, span.lower(), span.upper(), _title(span)):
                    found.setdefault(form, None)
                    if len(found) >= MAX_CANDIDATES:
                        return list(found)
    return list(found)


def _title(span: str) -> str:
    # str.title() would also capitalize after an apostrophe ("What'S").
    return _WORD.sub(lambda m: m.group(0)[:1].upper() + m.group(0)[1:].lower(), span)


def _resolve(schema: Any, spans: list[str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = {key: _resolve_child(key, value, spans) for key, value in schema.items()}
    if GROUNDED not in out:
        return out
    mode = _mode(out.pop(GROUNDED))
    allowed = [] if mode is False else _allowed(out, _narrowed(spans, mode))
    if not allowed:
        return out  # off, or nothing to copy from: the plain schema
    kept = {k: v for k, v in out.items() if k in ("description", "title")}
    return {**kept, "enum": allowed}


def _resolve_child(key: str, value: Any, spans: list[str]) -> Any:
    if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
        return {name: _resolve(sub, spans) for name, sub in value.items()}
    if key in _SUBSCHEMA_LISTS and isinstance(value, list):
        return [_resolve(sub, spans) for sub in value]
    if key in ("items", "additionalProperties"):
        return _resolve(value, spans)
    return value


def _mode(mode: Any) -> bool | dict[str, Any]:
    prefer = mode.get("prefer") if isinstance(mode, dict) else None
    if isinstance(mode, bool) or (
        isinstance(prefer, list) and all(isinstance(v, str) for v in prefer) and len(mode) == 1
    ):
        return mode
    raise GrammarError(
        f"{GROUNDED} must be true, false or {{'prefer': [strings]}}, got {mode!r}"
    )


def _narrowed(spans: list[str], mode: Any) -> list[str]:
    """The spans a `{"prefer": [...]}` keeps: those naming a preferred value, if any does."""
    if not isinstance(mode, dict):
        return spans
    preferred = {value.casefold() for value in mode["prefer"]}
    named = [span for span in spans if span.casefold() in preferred]
    return named or spans


def _allowed(schema: dict[str, Any], spans: list[str]) -> list[str]:
    """The spans that also satisfy the property's own string keywords (length, pattern, enum)."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    pattern = schema.get("pattern")
    enum = schema.get("enum")
    return [
        span
        for span in spans
        if len(span) >= low
        and (high is None or len(span) <= high)
        and (pattern is None or _search(pattern, span))
        and (enum is None or span in enum)
    ]


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except (re.error, TypeError) as exc:
        raise GrammarError(f"pattern {pattern!r} of a grounded property is invalid: {exc}") from exc


def _schemas(schema: Any) -> Iterable[dict[str, Any]]:
    """Every (sub)schema object of `schema`, following the keywords that hold subschemas."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                yield from _schemas(sub)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for sub in value:
                yield from _schemas(sub)
        elif key in ("items", "additionalProperties"):
            yield from _schemas(value)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return " ".join(p for p in parts if isinstance(p, str))
    return ""
