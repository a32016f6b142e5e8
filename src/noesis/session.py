"""Session: one conversation's tool loop. Generate a turn, run its tool calls, feed the results
back, until a final answer, the round limit, or cancel(). Generation sits behind TurnGenerator."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from noesis.errors import InvalidRequest, NoesisError
from noesis.tools.executor import ToolExecutor, ToolResult
from noesis.tools.registry import Tool, ToolRegistry

ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
ToolsArg = ToolRegistry | Iterable[Tool | Callable[..., Any]] | None
DEFAULT_MAX_TOOL_ROUNDS = 4

# Why a generate() call stopped.
STOP_FINAL = "final"  # the model gave a final answer
STOP_MAX_TOOL_ROUNDS = "max_tool_rounds"  # it still called tools after the last allowed round
STOP_CANCELLED = "cancelled"  # cancel() was called
STOP_NO_FINAL = "no_final"  # a turn with neither tool calls nor a final (see finish_reason)


class SessionBusy(NoesisError, RuntimeError):
    """generate() was called while the same session is still generating."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text the model wrote


@dataclass
class AssistantTurn:
    """One generation: the analysis text, then tool calls or a final answer."""

    analysis: str
    tool_calls: list[ToolCall]
    final: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # the generator's word: "stop", "tool_calls", "length", "cancelled", ...


class TurnGenerator(Protocol):
    """Generates one assistant turn for a transcript; noesis.LLM implements it. It should return
    promptly (with what it has) once `cancel` is set. `deterministic` means greedy decoding with
    a fixed seed."""

    def generate_turn(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        *,
        tool_choice: ToolChoice,
        deterministic: bool,
        cancel: threading.Event,
    ) -> AssistantTurn: ...


@dataclass
class ExecutedToolCall:
    """A tool call the model made, with the executor's result."""

    id: str
    name: str
    arguments: str
    result: ToolResult
    round: int  # 0 for the calls of the first generation


@dataclass
class Usage:
    prompt_tokens: int = 0  # summed over every generation (each re-reads the transcript)
    completion_tokens: int = 0
    generations: int = 0
    tool_rounds: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, turn: AssistantTurn) -> None:
        self.prompt_tokens += turn.prompt_tokens
        self.completion_tokens += turn.completion_tokens
        self.generations += 1


@dataclass
class SessionResponse:
    analysis: str  # the analysis of every generation, joined by newlines
    tool_calls: list[ExecutedToolCall]
    final: str | None
    usage: Usage
    messages: list[dict[str, Any]]  # the input transcript plus this response, OpenAI-shaped
    stop_reason: str  # one of the STOP_* values
    finish_reason: str  # the last generation's own finish reason

    @property
    def cancelled(self) -> bool:
        return self.stop_reason == STOP_CANCELLED


@dataclass
class _Run:
    """State of one generate() call."""

    transcript: list[dict[str, Any]]
    usage: Usage = field(default_factory=Usage)
    analyses: list[str] = field(default_factory=list)
    executed: list[ExecutedToolCall] = field(default_factory=list)


class Session:
    """Answers with tools: `generate` loops generator and executor; `cancel` stops it.

    >>> session = Session(llm, max_tool_rounds=4)
    >>> response = session.generate([{"role": "user", "content": "17*23?"}], tools=[calculator])
    >>> response.final, [c.result.content for c in response.tool_calls]
    """

    def __init__(
        self,
        generator: TurnGenerator,
        *,
        executor: ToolExecutor | None = None,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
    ) -> None:
        if max_tool_rounds < 0:
            raise InvalidRequest(f"max_tool_rounds must be >= 0, got {max_tool_rounds}")
        self.generator = generator
        self.executor = executor if executor is not None else ToolExecutor()
        self.max_tool_rounds = max_tool_rounds
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None

    def cancel(self) -> None:
        """Stop the generate() in progress, from any thread: the generation in flight and any
        running tools are told to stop, and no further round starts. A no-op when idle."""
        with self._lock:
            if self._cancel is not None:
                self._cancel.set()

    def generate(
        self,
        messages: list[dict[str, Any]],
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        deterministic: bool = False,
    ) -> SessionResponse:
        """Run the tool loop on a copy of `messages`. `tools`: callables, Tools or a registry.
        A `required` or named tool_choice applies to the first generation only (later ones are
        `auto`), so that a forced call cannot loop until the round limit."""
        registry = ToolRegistry.of(tools)
        _check_messages(messages)
        _check_tool_choice(tool_choice, registry)
        cancel = self._start()
        try:
            return self._loop(messages, registry, tool_choice, deterministic, cancel)
        finally:
            with self._lock:
                self._cancel = None

    def _start(self) -> threading.Event:
        with self._lock:
            if self._cancel is not None:
                raise SessionBusy("this session is already generating; use another Session")
            self._cancel = threading.Event()
            return self._cancel

    def _loop(
        self,
        messages: list[dict[str, Any]],
        registry: ToolRegistry,
        tool_choice: ToolChoice,
        deterministic: bool,
        cancel: threading.Event,
    ) -> SessionResponse:
        run = _Run(transcript=[dict(m) for m in messages])
        executor = self.executor.with_registry(registry)
        declared = registry.schemas() or None
        for round_index in range(self.max_tool_rounds + 1):
            choice = tool_choice if round_index == 0 else _after_first(tool_choice)
            turn = self.generator.generate_turn(
                list(run.transcript),
                declared,
                tool_choice=choice,
                deterministic=deterministic,
                cancel=cancel,
            )
            run.usage.add(turn)
            if turn.analysis:
                run.analyses.append(turn.analysis)
            stop = _stop_reason(turn, cancel, round_index, self.max_tool_rounds)
            if stop is not None:
                return _finish(run, turn, stop)
            calls = _with_ids(turn.tool_calls, round_index)
            _append_round(run, turn, calls, executor.run(calls, cancel), round_index)
            if cancel.is_set():
                return _finish(run, turn, STOP_CANCELLED)
        raise AssertionError("unreachable: the last round always stops")


def _stop_reason(
    turn: AssistantTurn, cancel: threading.Event, round_index: int, max_rounds: int
) -> str | None:
    """Why the loop ends after this turn, or None to run its tool calls and go on."""
    if cancel.is_set():
        return STOP_CANCELLED
    if not turn.tool_calls:
        return STOP_FINAL if turn.final is not None else STOP_NO_FINAL
    if round_index == max_rounds:
        return STOP_MAX_TOOL_ROUNDS
    return None


def _finish(run: _Run, turn: AssistantTurn, stop: str) -> SessionResponse:
    final = turn.final if stop == STOP_FINAL else None
    if final is not None:
        message: dict[str, Any] = {"role": "assistant", "content": final}
        if turn.analysis:
            message["thinking"] = turn.analysis
        run.transcript.append(message)
    return SessionResponse(
        analysis="\n".join(run.analyses),
        tool_calls=run.executed,
        final=final,
        usage=run.usage,
        messages=run.transcript,
        stop_reason=stop,
        finish_reason=turn.finish_reason,
    )


def _append_round(
    run: _Run,
    turn: AssistantTurn,
    calls: list[ToolCall],
    results: list[ToolResult],
    round_index: int,
) -> None:
    """The assistant message with every call of the turn, then one tool message per result."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in calls
        ],
    }
    if turn.analysis:
        message["thinking"] = turn.analysis  # how noesis.tiny.harmony.render reads analysis
    run.transcript.append(message)
    run.transcript += [result.message() for result in results]
    run.executed += [
        ExecutedToolCall(call.id, call.name, call.arguments, result, round_index)
        for call, result in zip(calls, results, strict=True)
    ]
    run.usage.tool_rounds += 1


def _with_ids(calls: list[ToolCall], round_index: int) -> list[ToolCall]:
    """The calls, with an id made up for any the generator left empty or repeated."""
    seen: set[str] = set()
    fixed = []
    for index, call in enumerate(calls):
        call_id = call.id if call.id and call.id not in seen else f"call_{round_index}_{index}"
        seen.add(call_id)
        fixed.append(ToolCall(call_id, call.name, call.arguments))
    return fixed


def _after_first(tool_choice: ToolChoice) -> ToolChoice:
    return "none" if tool_choice == "none" else "auto"


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of message dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise InvalidRequest(f"messages[{index}] must be a dict with a 'role'")


def _check_tool_choice(tool_choice: ToolChoice, registry: ToolRegistry) -> None:
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise InvalidRequest(
                f"tool_choice must be auto, none, required or a function, got {tool_choice!r}"
            )
        if tool_choice == "required" and not len(registry):
            raise InvalidRequest("tool_choice='required' but no tools were given")
        return
    name = _choice_name(tool_choice)
    if name not in registry:
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not among the tools "
            f"({', '.join(registry.names) or 'none'})"
        )


def _choice_name(tool_choice: Any) -> str | None:
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise InvalidRequest(
            f"tool_choice must be auto, none, required or "
            f'{{"type": "function", "function": {{"name": ...}}}}, '
            f"got {tool_choice!r}"
        )
    function = tool_choice.get("function")
    return function.get("name") if isinstance(function, Mapping) else None
