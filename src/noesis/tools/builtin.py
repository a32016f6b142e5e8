"""noesis-tiny's built-in tools (noesis.tiny.tools) as registry Tools, with the schemas, checks and
error messages the model was trained on. The arithmetic ones run isolated (in a worker process)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from noesis.tiny import tools as tiny_tools
from noesis.tools.registry import InvalidToolArguments, Tool, ToolError, ToolRegistry, UnknownTool

# Field names in the tiny validator's messages: "arguments.days ...", "lacks required 'date'".
_FIELD = re.compile(r"arguments\.(\w+)|required '(\w+)'|unexpected '(\w+)'")
# Tools doing arithmetic on numbers the model chose run in a worker process the executor can
# kill. Their inputs are bounded (noesis.tiny.tools), so this is a second wall, not the first.
ISOLATED = ("calculator", "convert_units")


def builtin_tools(names: Iterable[str] | None = None) -> ToolRegistry:
    """A registry of the named built-in tools (all of them by default), in the order given."""
    names = list(tiny_tools.TOOLS) if names is None else list(names)
    unknown = [name for name in names if name not in tiny_tools.TOOLS]
    if unknown:
        known = ", ".join(tiny_tools.TOOLS)
        raise UnknownTool(f"unknown built-in tools {unknown} (built-in: {known})")
    return ToolRegistry(builtin_tool(name) for name in names)


def builtin_tool(name: str) -> Tool:
    spec = tiny_tools.TOOLS[name]
    return Tool(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        function=_Runner(spec),
        parse_arguments=_SchemaArguments(spec.parameters),
        is_async=False,
        isolated=name in ISOLATED,
    )


@dataclass(frozen=True)
class _SchemaArguments:
    """JSON parsing and the tiny schema validator, worded as noesis.tiny.tools.execute words it."""

    parameters: dict[str, Any]

    def __call__(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        if isinstance(arguments, Mapping):
            value: Any = dict(arguments)
        else:
            try:
                value = tiny_tools.parse_arguments(arguments)  # type: ignore[arg-type]
            except tiny_tools.ToolError as exc:
                raise InvalidToolArguments(str(exc)) from None
        problems = tiny_tools.validate(self.parameters, value)
        if problems:
            raise InvalidToolArguments("; ".join(problems), _named_fields(problems))
        return value


def _named_fields(problems: list[str]) -> tuple[str, ...]:
    found = (m for problem in problems for m in _FIELD.finditer(problem))
    return tuple(dict.fromkeys(next(g for g in m.groups() if g) for m in found))


@dataclass(frozen=True)
class _Runner:
    """Calls the tiny tool's `run(dict)` with keyword arguments; its refusals become ToolError."""

    spec: tiny_tools.Tool

    def __call__(self, **arguments: Any) -> str:
        try:
            return self.spec.run(arguments)
        except tiny_tools.ToolError as exc:
            raise ToolError(str(exc)) from exc
