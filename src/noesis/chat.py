"""`noesis chat` for Harmony models: a user message answered through Session.stream, each message
printed under its channel's label as soon as it closes, tool calls and their real results between.

Takes the LLM it is given (imports no engine). Malformed output never raises: what the parser
could not place is shown as such.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from noesis.errors import InvalidRequest
from noesis.harmony.parser import ContentDelta, MessageEnd, MessageStart, ParsedMessage, ParseIssue
from noesis.session import (
    STOP_FINAL,
    STOP_MAX_TOOL_ROUNDS,
    AssistantTurn,
    ExecutedToolCall,
    Session,
    SessionResponse,
)
from noesis.tools.builtin import TOOLS, builtin_tools
from noesis.tools.executor import ToolExecutor
from noesis.tools.registry import ToolRegistry

MAX_TOOL_STEPS = 4  # generations per user message; a model that keeps calling tools is cut off
# The bundled model was trained with at most four declared tools; `builtin` declares these four.
DEFAULT_TOOLS = ("calculator", "convert_units", "day_of_week", "lookup_country")
FUNCTIONS = "functions."
LABEL_WIDTH = 12
_CLOSED = ("end", "call", "return")  # the other stops (eos, truncated) cut a message off


def tool_registry(spec: str) -> ToolRegistry:
    """`builtin` (the default four), `none`, or comma-separated names of built-in tools."""
    if spec == "none":
        return ToolRegistry()
    names = DEFAULT_TOOLS if spec == "builtin" else tuple(n.strip() for n in spec.split(","))
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise InvalidRequest(f"unknown tools {unknown} (built-in: {', '.join(TOOLS)})")
    return builtin_tools(names)


def reply(
    llm,
    history: list[dict[str, Any]],
    tools: ToolRegistry,
    display: Display,
    *,
    executor: ToolExecutor | None = None,
    max_steps: int = MAX_TOOL_STEPS,
    control: Any = None,
    **options: Any,
) -> str | None:
    """Answer the last user message in `history` through the tool loop, showing it on `display`.
    Appends the turn to `history` (analysis dropped, as gpt-oss does for past turns) and returns
    the final answer, or None. `control` is the Session's (noesis.control: a policy name or
    object, None: off); `options` go to the generator (params, constrained)."""
    session = Session(llm, executor=executor, max_tool_rounds=max_steps - 1, control=control)
    events = session.stream(history, tools, **options)
    try:
        response = _show(events, display, stray_calls=not len(tools))
    finally:
        events.close()  # stops the loop (and aborts a generation) when it ended early
    if response is None:
        return None
    history += [
        {k: v for k, v in m.items() if k != "thinking"} for m in response.messages[len(history) :]
    ]
    if response.finish_reason == "content_filter":  # a safety sidecar (--sidecars, --safety)
        display.line("stopped", "the safety sidecar ended the answer")
    elif response.stop_reason == STOP_MAX_TOOL_ROUNDS:
        display.line("stopped", f"{max_steps} generations without a final answer")
    elif response.stop_reason != STOP_FINAL:
        display.line("stopped", "no final answer in the model's output")
    return response.final


def _show(events: Iterator[Any], display: Display, stray_calls: bool) -> SessionResponse | None:
    """Display the events; the response, or None when a call with no tools declared ends it."""
    for event in events:
        if isinstance(event, SessionResponse):
            return event
        if isinstance(event, AssistantTurn) and event.tool_calls and stray_calls:
            display.line("stopped", "the model called a tool, but no tools are declared")
            return None
        if isinstance(event, ExecutedToolCall):
            display.line("tool result", event.result.content)
        else:
            display.event(event)
    return None


class Display:
    """Prints messages one per line under a label as they close; analysis dimmed on a terminal.
    Feed it a streamed turn's events (other events are ignored)."""

    def __init__(self, out: TextIO | None = None, color: bool | None = None) -> None:
        self.out = out or sys.stdout
        if color is None:
            color = self.out.isatty() and "NO_COLOR" not in os.environ
        self.color = color
        self._open: ParsedMessage | None = None

    def event(self, event: Any) -> None:
        if isinstance(event, MessageStart):
            self._open = ParsedMessage(
                event.role, event.channel, event.recipient, event.content_type
            )
        elif isinstance(event, ContentDelta) and self._open is not None:
            self._open.content += event.text
        elif isinstance(event, MessageEnd) and self._open is not None:
            self._open.stop = event.stop
            self.message(self._open)
            self._open = None
        elif isinstance(event, ParseIssue):
            self.line("unparsed", f"{event.message}: {event.raw!r}")

    def message(self, message: ParsedMessage) -> None:
        recipient = message.recipient or ""
        body = message.content if message.stop in _CLOSED else message.content + " [cut off]"
        if recipient.startswith(FUNCTIONS):
            self.line("tool call", f"{recipient.removeprefix(FUNCTIONS)} {body}")
        elif message.channel in ("analysis", "final"):
            self.line(message.channel, body, dim=message.channel == "analysis")
        else:
            to = f" to={recipient}" if recipient else ""
            self.line(f"{message.channel or message.role or '?'}{to}", body)

    def line(self, label: str, text: str, dim: bool = False) -> None:
        head = f"{label:<{LABEL_WIDTH}}"
        if self.color:
            head = f"\033[1m{head}\033[22m"
            text = f"\033[2m{text}\033[22m" if dim else text
        self.out.write(f"{head}{text}\n")
        self.out.flush()
