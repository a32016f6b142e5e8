"""Tools the model can call: a registry built from Python callables, a concurrent executor, and
worker processes for isolated tools."""

from noesis.tools.executor import ERROR_PREFIX, RetryPolicy, ToolExecutor, ToolResult
from noesis.tools.isolation import WorkerPool
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
    "WorkerPool",
    "make_tool",
    "tool",
]
