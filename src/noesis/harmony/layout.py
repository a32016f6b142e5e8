"""The system and developer messages of a Harmony conversation: gpt-oss's system layout (identity,
knowledge cutoff, date, reasoning effort, channels) and function tools as a TypeScript namespace."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from noesis.errors import InvalidRequest

REASONING_EFFORTS = ("low", "medium", "high")
FUNCTIONS_NOTE = "Calls to these tools must go to the commentary channel: 'functions'."
_WHITESPACE = re.compile(r"\s")


@dataclass(frozen=True)
class SystemConfig:
    """What the system message says; a field set to None is left out, as gpt-oss does."""

    model_identity: str | None = "You are ChatGPT, a large language model trained by OpenAI."
    knowledge_cutoff: str | None = "2024-06"
    current_date: str | None = None  # "YYYY-MM-DD"
    reasoning_effort: str | None = "medium"
    valid_channels: tuple[str, ...] = ("analysis", "commentary", "final")
    channel_required: bool = True

    def __post_init__(self) -> None:
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequest(
                f"reasoning_effort {self.reasoning_effort!r} is not one of {REASONING_EFFORTS}"
            )

    def text(self, has_function_tools: bool) -> str:
        top = [self.model_identity] if self.model_identity is not None else []
        if self.knowledge_cutoff is not None:
            top.append(f"Knowledge cutoff: {self.knowledge_cutoff}")
        if self.current_date is not None:
            top.append(f"Current date: {self.current_date}")
        sections = ["\n".join(top)] if top else []
        if self.reasoning_effort is not None:
            sections.append(f"Reasoning: {self.reasoning_effort}")
        if self.valid_channels:
            sections.append(self._channels(has_function_tools))
        return "\n\n".join(sections)

    def _channels(self, has_function_tools: bool) -> str:
        line = f"# Valid channels: {', '.join(self.valid_channels)}."
        if self.channel_required:
            line += " Channel must be included for every message."
        return line + ("\n" + FUNCTIONS_NOTE if has_function_tools else "")


@dataclass(frozen=True)
class Layout:
    """How chat messages become Harmony messages and tokens, for one model family."""

    system: SystemConfig = field(default_factory=SystemConfig)
    # Assistant headers as `<|channel|>commentary to=functions.x` (what gpt-oss writes itself)
    # rather than openai_harmony's ` to=functions.x<|channel|>commentary`.
    recipient_after_channel: bool = False
    # openai_harmony's auto_drop_analysis: when the last assistant message is a final answer, drop
    # the analysis messages that come before the conversation's first final message.
    drop_past_analysis: bool = True
    tool_call_content_type: str = "<|constrain|>json"


GPT_OSS = Layout()
NOESIS_TINY = Layout(
    system=SystemConfig(
        model_identity=(
            "You are noesis-tiny, a small assistant that answers questions and calls tools."
        ),
        knowledge_cutoff=None,
        reasoning_effort=None,
    ),
    recipient_after_channel=True,
    drop_past_analysis=False,
)


@dataclass(frozen=True)
class FunctionTool:
    """One declared function: the OpenAI `tools` entry, normalized."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; None: no arguments

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> FunctionTool:
        """From `{"type": "function", "function": {...}}` or a bare function dict."""
        if not isinstance(tool, dict):
            raise InvalidRequest(f"a tool must be a dict, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise InvalidRequest(f"tool type {tool['type']!r} is not supported (only 'function')")
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"tool {tool!r} has no function name")
        check_function_name(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"tool {name!r}: parameters must be a JSON schema object")
        return cls(name, function.get("description") or "", parameters)


def check_function_name(name: str) -> str:
    """A function name as Harmony headers carry it (`to=functions.NAME`, `functions.NAME to=`).

    The name is encoded as text, so a token spelling in it stays text; whitespace is refused
    because it would start another header word (`lookup to=functions.other`)."""
    if _WHITESPACE.search(name):
        raise InvalidRequest(f"function name {name!r} contains whitespace")
    return name


def developer_text(instructions: str | None, tools: Sequence[FunctionTool]) -> str | None:
    """The developer message: `# Instructions` and the functions namespace; None if neither."""
    sections = ["# Instructions", instructions] if instructions else []
    if tools:
        sections += ["# Tools", functions_namespace(tools)]
    return "\n\n".join(sections) if sections else None


def functions_namespace(tools: Sequence[FunctionTool]) -> str:
    lines = ["## functions\n", "namespace functions {\n"]
    for tool in tools:
        lines += [f"// {line}" for line in _lines(tool.description)]
        if tool.parameters is None:
            lines.append(f"type {tool.name} = () => any;\n")
        else:
            lines.append(f"type {tool.name} = (_: {typescript(tool.parameters, '')}) => any;\n")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _lines(text: str) -> list[str]:
    """Lines as Rust's str::lines splits them: on \\n, a trailing \\r dropped, no final empty."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


# ---------------------------------------------------------------- JSON schema -> TypeScript


def typescript(schema: Any, indent: str) -> str:
    """A JSON schema in gpt-oss's TypeScript-like notation (openai_harmony's rendering)."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(schema.get("oneOf"), list):
        return _union(schema["oneOf"], indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        enum = schema.get("enum") if isinstance(schema.get("enum"), list) else []
        values = [f'"{v}"' for v in enum if isinstance(v, str)]
        return " | ".join(values) if values else "string"
    if kind == "array":
        items = schema.get("items")
        return f"{typescript(items, indent)}[]" if "items" in schema else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any")


def _union(variants: list[Any], indent: str) -> str:
    out = ""
    for variant in variants:
        out += f"\n{indent} | " + _variant_type(variant, indent)
        notes = [variant["description"]] if _has_str(variant, "description") else []
        notes += _default_note(variant, quote_enum=True)
        out += f" // {' '.join(notes)}" if notes else ""
    return out


def _object(schema: dict[str, Any], indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if _has_str(schema, "description") else ""
    out += "{\n"
    properties = schema.get("properties")
    if isinstance(properties, dict):
        required = schema.get("required")
        required = (
            {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        )
        for name, spec in properties.items():
            out += _property(name, spec if isinstance(spec, dict) else {}, name in required, indent)
    return out + f"{indent}}}"


def _property(name: str, spec: dict[str, Any], required: bool, indent: str) -> str:
    out = ""
    if _has_str(spec, "title"):
        out += f"{indent}// {spec['title']}\n{indent}//\n"
    if "oneOf" not in spec and _has_str(spec, "description"):
        out += f"{indent}// {spec['description']}\n"
    examples = spec.get("examples")
    if isinstance(examples, list) and examples:
        out += f"{indent}// Examples:\n"
        out += "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
    optional = "" if required else "?"
    if isinstance(spec.get("oneOf"), list):
        return out + _union_property(name + optional, spec, indent)
    out += f"{indent}{name}{optional}: {_nullable(spec, typescript(spec, indent + '    '))},"
    if "oneOf" not in spec:
        out += "".join(f" // {note}" for note in _default_note(spec, quote_enum=False))
    return out + "\n"


def _union_property(label: str, spec: dict[str, Any], indent: str) -> str:
    """A property whose schema is `oneOf`: one `| variant` line each, comments deduplicated."""
    variants = spec["oneOf"]
    described = spec["description"] if _has_str(spec, "description") else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    above = described is not None and first.get("description") != described
    out = f"{indent}// {described}\n" if above else ""
    out += "".join(f"{indent}// {note}\n" for note in _default_note(spec, quote_enum=False))
    out += f"{indent}{label}:\n"
    for index, variant in enumerate(variants):
        variant = variant if isinstance(variant, dict) else {}
        out += f"{indent} | " + _variant_type(variant, indent)
        notes = []
        own = variant["description"] if _has_str(variant, "description") else None
        if not (index == 0 and above) and own is not None and own != described:
            notes.append(own)
        notes += _default_note(variant, quote_enum=False)
        out += (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"


def _variant_type(variant: Any, indent: str) -> str:
    variant = variant if isinstance(variant, dict) else {}
    return _nullable(variant, typescript(variant, indent + "   "))


def _nullable(spec: dict[str, Any], rendered: str) -> str:
    if spec.get("nullable") is True and "null" not in rendered:
        return rendered + " | null"
    return rendered


def _default_note(spec: dict[str, Any], quote_enum: bool) -> list[str]:
    """`default: ...` as openai_harmony writes it: a plain string quoted, an enum's string quoted
    only in a top-level union, anything else as compact JSON."""
    if "default" not in spec:
        return []
    default = spec["default"]
    if isinstance(default, str) and not _is_enum(spec):
        return [f'default: "{default}"']
    if isinstance(default, str) and not quote_enum:
        return [f"default: {default}"]
    return [f"default: {json.dumps(default, ensure_ascii=False, separators=(',', ':'))}"]


def _is_enum(spec: dict[str, Any]) -> bool:
    return isinstance(spec.get("enum"), list) and bool(spec["enum"])


def _has_str(spec: dict[str, Any], key: str) -> bool:
    return isinstance(spec.get(key), str)
