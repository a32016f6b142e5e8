"""Harmony chat for the CLI: parse a model's Harmony stream leniently, print its channels, and run
the built-in tools between generations (through the ToolExecutor, with its timeout) until the
model gives a final answer.

Takes an LLM it is given (imports no engine). Malformed output never raises: what cannot be parsed
is shown as such.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from noesis.errors import InvalidRequest
from noesis.sampling.params import SamplingParams
from noesis.tiny import harmony, tools
from noesis.tiny.harmony import ParsedMessage
from noesis.tools.builtin import builtin_tools
from noesis.tools.executor import ToolExecutor

MAX_TOOL_STEPS = 4  # generations per user turn; a model that keeps calling tools is cut off here
# The bundled model was trained with at most four declared tools; given all seven it overlooks the
# first ones, so the chat declares four by default.
DEFAULT_TOOLS = ("calculator", "convert_units", "day_of_week", "lookup_country")
# An assistant never writes a user turn; a model that runs on past its answer starts one.
RUN_ON_STOP = harmony.START + "user"
FUNCTIONS = "functions."
LABEL_WIDTH = 12


@dataclass(frozen=True)
class Unparsed:
    """Generated text that is not a well-formed Harmony message."""

    text: str


Segment = ParsedMessage | Unparsed


def is_harmony(tokenizer) -> bool:
    """Whether the tokenizer has Harmony's structural special tokens."""
    needed = (harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL)
    return all(tokenizer.token_to_id(token) is not None for token in needed)


def tool_declarations(spec: str) -> list[dict[str, Any]]:
    """`builtin` (the default four), `none`, or comma-separated names of built-in tools."""
    if spec == "none":
        return []
    names = DEFAULT_TOOLS if spec == "builtin" else tuple(n.strip() for n in spec.split(","))
    unknown = [name for name in names if name not in tools.TOOLS]
    if unknown:
        raise InvalidRequest(f"unknown tools {unknown} (built-in: {', '.join(tools.TOOLS)})")
    return tools.schemas(names)


# ---------------------------------------------------------------- parsing


def parse_stream(text: str) -> list[Segment]:
    """Messages in text generated after a prompt that ended in `<|start|>assistant`: split at
    `<|start|>`, header up to `<|message|>`, body up to `<|end|>`, `<|call|>` or `<|return|>`.
    A chunk without `<|message|>`, and text after a closing token, come back as Unparsed."""
    segments: list[Segment] = []
    chunks = (harmony.GENERATION_PROMPT + text).split(harmony.START)[1:]
    for index, chunk in enumerate(chunks):
        raw = chunk.removeprefix("assistant") if index == 0 else harmony.START + chunk
        if harmony.MESSAGE not in chunk:
            if raw.strip():
                segments.append(Unparsed(raw))
            continue
        message = harmony.parse_completion(harmony.START + chunk, False).messages[0]
        segments.append(message)
        rest = chunk.partition(harmony.MESSAGE)[2]
        tail = rest[len(message.content) + len(message.stop or "") :]
        if tail.strip():
            segments.append(Unparsed(tail))
    return segments


def function_name(message: ParsedMessage) -> str | None:
    """The tool a message calls (`to=functions.NAME`), or None."""
    recipient = message.recipient or ""
    return recipient.removeprefix(FUNCTIONS) if recipient.startswith(FUNCTIONS) else None


def run_declared(
    declared: list[dict[str, Any]], name: str, arguments: str, executor: ToolExecutor | None = None
) -> str:
    """Execute a tool if it was declared; an undeclared one gets an error result. `executor`
    (default: builtin_executor()) runs the call from its registry, with its timeout; the result
    is the tool's text or an `error: ...` message, never an exception."""
    if name not in {tool["function"]["name"] for tool in declared}:
        return f"{tools.ERROR_PREFIX}tool {name!r} is not declared"
    executor = executor if executor is not None else builtin_executor()
    [result] = executor.run([{"id": "call_0", "name": name, "arguments": arguments}])
    return result.content


@functools.cache
def builtin_executor() -> ToolExecutor:
    """The executor of every built-in tool with ToolExecutor's defaults (timeout included), shared
    by the chat, the voice expert and the eval."""
    return ToolExecutor(builtin_tools())


def call_messages(
    analysis: str, name: str, arguments: str, result: str, call_id: str = "call_0"
) -> list[dict[str, Any]]:
    """The assistant's tool call and the tool's result, as the chat template expects them."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    assistant: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
    if analysis:
        assistant["thinking"] = analysis
    return [assistant, {"role": "tool", "name": name, "content": result}]


# ---------------------------------------------------------------- display


class Display:
    """Prints segments one per line under a label; analysis dimmed on a terminal."""

    def __init__(self, out: TextIO | None = None, color: bool | None = None) -> None:
        self.out = out or sys.stdout
        if color is None:
            color = self.out.isatty() and "NO_COLOR" not in os.environ
        self.color = color

    def segment(self, segment: Segment) -> None:
        if isinstance(segment, Unparsed):
            self.line("unparsed", repr(segment.text))
            return
        name = function_name(segment)
        body = segment.content if segment.stop else segment.content + " [cut off]"
        if name is not None:
            self.line("tool call", f"{name} {body}")
        elif segment.channel in ("analysis", "final"):
            self.line(segment.channel, body, dim=segment.channel == "analysis")
        else:
            to = f" to={segment.recipient}" if segment.recipient else ""
            self.line(f"{segment.channel or segment.role or '?'}{to}", body)

    def line(self, label: str, text: str, dim: bool = False) -> None:
        head = f"{label:<{LABEL_WIDTH}}"
        if self.color:
            head = f"\033[1m{head}\033[22m"
            text = f"\033[2m{text}\033[22m" if dim else text
        self.out.write(f"{head}{text}\n")
        self.out.flush()


def stream_segments(
    llm, prompt: list[int], params: SamplingParams, show: Callable
) -> list[Segment]:
    """Generate one step, calling `show` on each segment as soon as it is complete."""
    params = dataclasses.replace(
        params, skip_special_tokens=False, stop=(*params.stop, RUN_ON_STOP)
    )
    text, shown = "", 0
    for delta in llm.stream(prompt, params):
        text += delta
        segments = parse_stream(text)
        complete = segments[: len(segments) if _closed(segments) else len(segments) - 1]
        for segment in complete[shown:]:
            show(segment)
        shown = max(shown, len(complete))
    segments = parse_stream(text)
    for segment in segments[shown:]:
        show(segment)
    return segments


def _closed(segments: list[Segment]) -> bool:
    """Whether the last segment can no longer grow: a message that reached its closing token."""
    return bool(segments) and isinstance(segments[-1], ParsedMessage) and bool(segments[-1].stop)


# ---------------------------------------------------------------- the turn loop


def run_turn(
    llm,
    history: list[dict[str, Any]],
    declared: list[dict[str, Any]],
    params: SamplingParams,
    display: Display,
    max_steps: int = MAX_TOOL_STEPS,
    executor: ToolExecutor | None = None,
) -> str | None:
    """Answer the last user message in `history`: generate, execute a built-in tool the model
    calls (with `executor`, see run_declared), feed the result back, until a final answer.
    Appends the turn to `history` (analysis dropped, as gpt-oss does for past turns) and returns
    the final answer, or None."""
    turn: list[dict[str, Any]] = []
    final = None
    for _ in range(max_steps):
        prompt = llm.render_chat(history + turn, declared or None)
        segments = stream_segments(llm, prompt, params, display.segment)
        action = next_action(segments)
        if isinstance(action, str):
            final = action
            break
        if action is None:
            display.line("stopped", "no final answer in the model's output")
            break
        if not declared:
            display.line("stopped", "the model called a tool, but no tools are declared")
            break
        analysis, name, arguments = action
        result = run_declared(declared, name, arguments, executor)
        display.line("tool result", result)
        turn += call_messages(analysis, name, arguments, result, f"call_{len(turn) // 2}")
    else:
        display.line("stopped", f"{max_steps} generations without a final answer")
    history += [{k: v for k, v in m.items() if k != "thinking"} for m in turn]
    if final is not None:
        history.append({"role": "assistant", "content": final})
    return final


def next_action(segments: list[Segment]) -> str | tuple[str, str, str] | None:
    """The final answer, or (analysis, tool name, arguments) of the first call, whichever the
    model wrote first; None when it wrote neither."""
    analysis = []
    for segment in segments:
        if not isinstance(segment, ParsedMessage):
            continue
        name = function_name(segment)
        if name is not None:
            return "\n".join(analysis), name, segment.content
        if segment.channel == "final":
            return segment.content
        if segment.channel == "analysis":
            analysis.append(segment.content)
    return None
