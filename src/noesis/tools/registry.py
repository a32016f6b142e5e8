"""Tool registry: Python callables turned into named tools with JSON schemas (from type hints, via
pydantic) and argument validation. Running them is the executor's job."""

from __future__ import annotations

import functools
import inspect
import json
import pickle
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import pydantic
import pydantic_core
from pydantic.fields import FieldInfo

from noesis.errors import NoesisError
from noesis.tools.docstrings import parse_docstring

# Keys whose values are data, not sub-schemas: titles inside them are kept.
_DATA_KEYS = ("default", "enum", "const", "examples")


class ToolDefinitionError(NoesisError, ValueError):
    """A callable cannot become a tool (no type hint, *args), or a tool name is taken."""


class UnknownTool(NoesisError, LookupError):
    """No tool of that name is registered."""


class InvalidToolArguments(NoesisError, ValueError):
    """A call's arguments are not valid JSON or do not fit the schema; `fields` names the fields."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class ToolError(Exception):
    """Raised by a tool to refuse its input; the message goes back to the model verbatim."""


class ArgumentParser(Protocol):
    """Turns a call's raw arguments into keyword arguments, or raises InvalidToolArguments."""

    def __call__(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Tool:
    """A callable the model may call: its name, description, argument schema and validator.
    `isolated` tools run in a worker process that the executor kills when they time out."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    function: Callable[..., Any]  # called with the parsed arguments as keywords
    parse_arguments: ArgumentParser
    is_async: bool
    isolated: bool = False

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly, as if it were not a tool."""
        return self.function(*args, **kwargs)


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    isolated: bool = False,
) -> Any:
    """Decorator: `@tool` or `@tool(name=..., description=..., isolated=...)` turns a function
    into a Tool."""
    if function is None:
        return lambda f: make_tool(f, name=name, description=description, isolated=isolated)
    return make_tool(function, name=name, description=description, isolated=isolated)


def make_tool(
    function: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    isolated: bool = False,
) -> Tool:
    """A Tool from a sync or async callable: name from the function, description from the first
    docstring paragraph, parameter schema from the type hints and the docstring's Args section.
    `isolated=True` runs it in a worker process (see check_isolatable for what that needs)."""
    if isinstance(function, Tool):
        if isolated and not function.isolated:
            check_isolatable(function.function, function.name, function.is_async)
            return replace(function, isolated=True)
        return function
    if not callable(function):
        raise ToolDefinitionError(f"a tool must be callable, got {type(function).__name__}")
    tool_name = name or getattr(function, "__name__", None)
    if not tool_name or tool_name == "<lambda>":
        raise ToolDefinitionError("a lambda or unnamed callable needs an explicit tool name")
    docstring = parse_docstring(inspect.getdoc(function))
    model = arguments_model(function, tool_name, docstring.params)
    is_async = _is_async(function)
    if isolated:
        check_isolatable(function, tool_name, is_async)
    return Tool(
        name=tool_name,
        description=description if description is not None else docstring.summary,
        parameters=json_schema(model),
        function=function,
        parse_arguments=PydanticArguments(model),
        is_async=is_async,
        isolated=isolated,
    )


def check_isolatable(function: Callable[..., Any], tool_name: str, is_async: bool) -> None:
    """Raise ToolDefinitionError unless a worker process can run `function`: it must be sync (an
    async tool runs on the caller's loop, where cancelling it works) and importable by name from
    a module (pickled by reference): not a lambda, closure, local function or bound state that
    does not pickle, and not defined in `__main__`, which the worker does not import."""
    where = f"tool {tool_name!r} cannot be isolated"
    if is_async:
        raise ToolDefinitionError(f"{where}: it is async; isolated tools must be sync functions")
    if getattr(function, "__module__", None) == "__main__":
        raise ToolDefinitionError(
            f"{where}: it is defined in __main__, which a worker process does not import; "
            "move it to a module"
        )
    try:
        pickle.dumps(function)
    except Exception as exc:  # PicklingError, AttributeError, TypeError: all mean "not by name"
        raise ToolDefinitionError(
            f"{where}: a worker process can only run a function it can import by name "
            f"(module level; not a lambda, closure or local function): {exc}"
        ) from exc


class ToolRegistry:
    """Tools by name, in registration order. A name can be registered once."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.register(item)

    @classmethod
    def of(cls, tools: ToolRegistry | Iterable[Tool | Callable[..., Any]] | None) -> ToolRegistry:
        """A registry from a registry (itself), callables and Tools, or None (empty)."""
        if isinstance(tools, ToolRegistry):
            return tools
        if tools is None:
            return cls()
        if isinstance(tools, (Tool, str, Mapping)) or callable(tools):
            raise ToolDefinitionError("tools must be a ToolRegistry or a list of callables/Tools")
        return cls(tools)

    def register(
        self,
        function: Tool | Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        isolated: bool = False,
    ) -> Tool:
        """Add a Tool or callable; returns the Tool (so this works as a decorator too)."""
        item = make_tool(function, name=name, description=description, isolated=isolated)
        if item.name in self._tools:
            raise ToolDefinitionError(f"a tool named {item.name!r} is already registered")
        self._tools[item.name] = item
        return item

    def get(self, name: str) -> Tool:
        if name not in self._tools:
            raise UnknownTool(f"unknown tool {name!r} (registered: {', '.join(self._tools)})")
        return self._tools[name]

    def find(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI `tools` entries, in registration order."""
        return [item.schema() for item in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


# ---------------------------------------------------------------- schemas from signatures


def arguments_model(
    function: Callable[..., Any], tool_name: str, descriptions: Mapping[str, str]
) -> type[pydantic.BaseModel]:
    """A pydantic model of the callable's parameters. Fields get internal names and the parameter
    names as aliases, so a parameter may be called `schema` or `json` without shadowing pydantic."""
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(_hinted(function), include_extras=True)
    except (TypeError, ValueError, NameError) as exc:
        message = f"cannot read the signature of tool {tool_name!r}: {exc}"
        raise ToolDefinitionError(message) from exc
    fields: dict[str, Any] = {}
    for index, parameter in enumerate(signature.parameters.values()):
        _check_parameter(parameter, hints, tool_name)
        annotation = hints[parameter.name]
        field = _field(parameter, annotation, descriptions.get(parameter.name))
        fields[f"field_{index}"] = (annotation, field)
    config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=False)
    try:
        return pydantic.create_model(f"{tool_name}_arguments", __config__=config, **fields)
    except (pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise ToolDefinitionError(f"tool {tool_name!r}: unsupported parameter type: {exc}") from exc


def _hinted(function: Callable[..., Any]) -> Any:
    """Where the hints live: the function itself, or `__call__` of a callable object."""
    if inspect.isroutine(function) or inspect.isclass(function):
        return function
    if isinstance(function, functools.partial):
        return function.func
    return getattr(function, "__call__", function)  # noqa: B004


def _check_parameter(parameter: inspect.Parameter, hints: dict[str, Any], tool_name: str) -> None:
    where = f"parameter {parameter.name!r} of tool {tool_name!r}"
    if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        raise ToolDefinitionError(f"{where}: *args and **kwargs cannot be described to a model")
    if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
        raise ToolDefinitionError(f"{where}: positional-only parameters cannot be named by a call")
    if parameter.name not in hints:
        raise ToolDefinitionError(f"{where} has no type hint")


def _field(parameter: inspect.Parameter, annotation: Any, doc: str | None) -> FieldInfo:
    default = ... if parameter.default is inspect.Parameter.empty else parameter.default
    if doc and not _annotated_description(annotation):
        return pydantic.Field(default, alias=parameter.name, description=doc)
    return pydantic.Field(default, alias=parameter.name)


def _annotated_description(annotation: Any) -> bool:
    metadata = getattr(annotation, "__metadata__", ())
    return any(isinstance(item, FieldInfo) and item.description for item in metadata)


def json_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """The model's JSON schema without pydantic's generated titles (they restate the names)."""
    return _strip_titles(model.model_json_schema(by_alias=True))


def _strip_titles(node: Any) -> Any:
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    stripped = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            stripped[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            stripped[key] = value if key in _DATA_KEYS else _strip_titles(value)
    return stripped


def _is_async(function: Callable[..., Any]) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - async callable objects
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


# ---------------------------------------------------------------- argument validation


@dataclass(frozen=True)
class PydanticArguments:
    """Parses a JSON string (or a dict) with the tool's pydantic model."""

    model: type[pydantic.BaseModel]

    def __call__(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        try:
            if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
                instance = self.model.model_validate({})  # a call with no arguments at all
            elif isinstance(arguments, str):
                instance = self.model.model_validate_json(arguments)
            else:
                instance = self.model.model_validate(arguments)
        except pydantic.ValidationError as exc:
            raise _invalid(exc) from None
        # Keywords by parameter name, values as validated (nested models stay models).
        return {info.alias: getattr(instance, key) for key, info in self.model.model_fields.items()}


def _invalid(exc: pydantic.ValidationError) -> InvalidToolArguments:
    problems, fields = [], []
    for error in exc.errors(include_url=False):
        location = ".".join(str(part) for part in error["loc"])
        if location:
            fields.append(location)
        problems.append(f"{location}: {error['msg']}" if location else error["msg"])
    return InvalidToolArguments("invalid arguments: " + "; ".join(problems), tuple(fields))


def as_content(value: Any) -> str:
    """A tool's return value as message content: strings verbatim, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return pydantic_core.to_json(value, fallback=str).decode()
    except (pydantic_core.PydanticSerializationError, ValueError):
        return json.dumps(str(value))
