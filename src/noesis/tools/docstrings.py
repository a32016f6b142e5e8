"""Docstring reading for tools: the summary paragraph and per-parameter descriptions (Google or
NumPy style). Text only; it knows nothing about schemas."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

GOOGLE_PARAM_SECTIONS = ("args", "arguments", "parameters", "params", "keyword args")
NUMPY_PARAM_SECTIONS = ("parameters", "other parameters", "keyword arguments")
# `name (type): text`, `name: text`, `*name: text`
_GOOGLE_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NUMPY_RULE = re.compile(r"^-{3,}\s*$")


@dataclass(frozen=True)
class Docstring:
    summary: str  # the first paragraph, lines joined by spaces
    params: dict[str, str] = field(default_factory=dict)  # parameter name -> description


def parse_docstring(text: str | None) -> Docstring:
    """Summary and parameter descriptions of a docstring; an absent docstring gives empty ones."""
    if not text or not text.strip():
        return Docstring("")
    lines = inspect.cleandoc(text).splitlines()
    return Docstring(_summary(lines), {**_numpy_params(lines), **_google_params(lines)})


def _summary(lines: list[str]) -> str:
    paragraph: list[str] = []
    for index, line in enumerate(lines):
        if not line.strip():
            break
        if _is_google_header(line) or _is_numpy_header(lines, index):
            break
        paragraph.append(line.strip())
    return " ".join(paragraph)


def _is_google_header(line: str) -> bool:
    stripped = line.strip()
    return stripped.endswith(":") and stripped[:-1].strip().lower() in GOOGLE_PARAM_SECTIONS + (
        "returns",
        "raises",
        "yields",
        "examples",
        "example",
        "note",
        "notes",
    )


def _is_numpy_header(lines: list[str], index: int) -> bool:
    return index + 1 < len(lines) and bool(_NUMPY_RULE.match(lines[index + 1].strip()))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _google_params(lines: list[str]) -> dict[str, str]:
    """Entries under `Args:` (and its synonyms) until a line indented no deeper than the header."""
    params: dict[str, list[str]] = {}
    for start, line in enumerate(lines):
        header = line.strip().lower().rstrip(":")
        if not line.strip().endswith(":") or header not in GOOGLE_PARAM_SECTIONS:
            continue
        base, entry_indent, current = _indent(line), None, None
        for body in lines[start + 1 :]:
            if not body.strip():
                continue
            if _indent(body) <= base:
                break
            entry_indent = _indent(body) if entry_indent is None else entry_indent
            match = _GOOGLE_ENTRY.match(body.strip())
            if _indent(body) == entry_indent and match:
                current = match.group(1)
                params[current] = [match.group(2).strip()]
            elif current is not None:
                params[current].append(body.strip())
    return {name: " ".join(p for p in parts if p) for name, parts in params.items()}


def _numpy_params(lines: list[str]) -> dict[str, str]:
    """Entries under a `Parameters` header underlined with dashes, until the next header."""
    params: dict[str, list[str]] = {}
    index = 0
    while index + 1 < len(lines):
        title, rule = lines[index].strip().lower(), lines[index + 1].strip()
        index += 1
        if title not in NUMPY_PARAM_SECTIONS or not _NUMPY_RULE.match(rule):
            continue
        base, names = _indent(lines[index - 1]), []
        for position in range(index + 1, len(lines)):
            body = lines[position]
            if not body.strip():
                continue
            if _is_numpy_header(lines, position) and _indent(body) <= base:
                break
            if _indent(body) <= base:
                names = [n.strip().lstrip("*") for n in body.split(":")[0].split(",")]
                params.update({name: [] for name in names})
            else:
                for name in names:
                    params[name].append(body.strip())
    return {name: " ".join(parts) for name, parts in params.items()}
