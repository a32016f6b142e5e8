"""Tools the model can call: a registry built from Python callables and a concurrent executor."""

from noesis.tools.executor import ERROR_PREFIX, RetryPolicy, ToolExecutor, ToolResult
from noesis.tools.registry import (
    InvalidToolArguments,
    Tool,
    ToolDefinitionError,
    ToolError,
    ToolRegistry,
    UnknownTool,
    make_tool,
    tool,
)

__all__ = [
    "ERROR_PREFIX",
    "InvalidToolArguments",
    "RetryPolicy",
    "Tool",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "UnknownTool",
    "make_tool",
    "tool",
]
