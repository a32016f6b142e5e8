"""Session: the one turn loop. Generate a turn, run its tool calls, feed the results back, until a
final answer, the round limit, or cancel(). `generate` returns the whole response, `stream` yields
it as it happens, `start` + `advance` move many conversations in lockstep (batched generations).
Generation sits behind TurnGenerator; tools run in the ToolExecutor; an optional control policy
(noesis.control) sets each generation's knobs and tool_choice from the model's uncertainty."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from noesis.errors import InvalidRequest, NoesisError
from noesis.tools.executor import ToolExecutor, ToolResult
from noesis.tools.registry import Tool, ToolRegistry

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy
    from noesis.control.turns import TurnControl
    from noesis.sidecars.memory import Memory

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
    prompt_token_ids: list[int] = field(default_factory=list)  # when the generator reports them
    token_ids: list[int] = field(default_factory=list)
    # Per token, noesis.sampling.metrics.TokenMetrics when the params asked for them (control)
    token_metrics: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids a streamed generation produced since its previous event. A streamed turn
    yields these and the Harmony parser events (noesis.harmony.parser) they complete."""

    token_ids: list[int]


@dataclass(slots=True)
class TurnRequest:
    """One generation to make: the transcript so far, the declared tools, and the keyword options
    the generator takes (noesis.LLM: params, constrained, grounded, response_format).
    `on_intent`, set only for a generator with `predicts_tools`, is its `on_intent` keyword."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    deterministic: bool
    options: dict[str, Any] = field(default_factory=dict)
    on_intent: Callable[[str], Any] | None = None


class TurnGenerator(Protocol):
    """Generates one assistant turn for a transcript; noesis.LLM implements it. It should return
    promptly (with what it has) once `cancel` is set. `deterministic` means greedy decoding with
    a fixed seed; `options` are the caller's, passed through (none unless given).

    Two optional methods, used when present: `stream_turn` (same arguments; a generator yielding
    turn events and returning the AssistantTurn) for Session.stream, and
    `generate_turns(requests, cancel)` (a list of AssistantTurn, one per TurnRequest, batched)
    for Session.advance. A generator whose `predicts_tools` is true also takes `on_intent` (a
    TurnRequest's, in generate_turns): a callable it calls with the tool it expects the turn to
    call, before the turn ends; Session passes its ToolExecutor.warm when a tool is isolated."""

    def generate_turn(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        *,
        tool_choice: ToolChoice,
        deterministic: bool,
        cancel: threading.Event,
        **options: Any,
    ) -> AssistantTurn: ...


class BatchedTurnGenerator:
    """A TurnGenerator written as `generate_turns` alone: its one-turn form is a batch of one
    (the control plane's turn wrappers: control.think, control.skip)."""

    def generate_turn(self, messages, tools=None, *, tool_choice="auto", deterministic=False,
                      cancel=None, **options) -> AssistantTurn:  # fmt: skip
        on_intent = options.pop("on_intent", None)
        request = TurnRequest(messages, tools, tool_choice, deterministic, options, on_intent)
        return self.generate_turns([request], cancel)[0]  # the subclass's


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
    turns: list[AssistantTurn] = field(default_factory=list)  # every generation, in order

    @property
    def cancelled(self) -> bool:
        return self.stop_reason == STOP_CANCELLED


class SessionRun:
    """One conversation's way through the loop: the next generation to make (`request`), what a
    generated turn means (`accept`: stop here, or these calls to run), their results (`record`).
    Session drives it; `response` is set once it has stopped."""

    def __init__(
        self,
        messages: list[dict[str, Any]],
        registry: ToolRegistry,
        executor: ToolExecutor,
        *,
        tool_choice: ToolChoice,
        deterministic: bool,
        max_tool_rounds: int,
        options: dict[str, Any],
        control: TurnControl | None = None,
        on_intent: Callable[[str], Any] | None = None,
    ) -> None:
        self.transcript = [dict(m) for m in messages]
        self.control = control  # None: the request's own knobs and tool_choice
        self.registry, self.executor = registry, executor
        self.tool_choice, self.deterministic = tool_choice, deterministic
        self.max_tool_rounds, self.options = max_tool_rounds, options
        self.on_intent = on_intent  # the generator's intent hook: warms a predicted tool
        self.round = 0
        self.usage = Usage()
        self.analyses: list[str] = []
        self.executed: list[ExecutedToolCall] = []
        self.turns: list[AssistantTurn] = []
        self.response: SessionResponse | None = None

    @property
    def done(self) -> bool:
        return self.response is not None

    def request(self) -> TurnRequest:
        """The next generation. A `required` or named tool_choice applies to the first only."""
        choice = self.tool_choice if self.round == 0 else _after_first(self.tool_choice)
        options = dict(self.options)
        if callable(options.get("params")):
            options["params"] = options["params"](self.round)
        declared = self.registry.schemas() or None
        if self.control is not None:
            options["params"] = self.control.params(options.get("params"))
            choice = self.control.tool_choice(choice) if declared else choice
        return TurnRequest(list(self.transcript), declared, choice, self.deterministic, options,
                           self.on_intent)  # fmt: skip

    def accept(self, turn: AssistantTurn, cancel: threading.Event) -> list[ToolCall]:
        """Take a generated turn: the calls to run now, or [] when the loop stops here."""
        assert not self.done, "accept() after the run stopped"
        self.usage.add(turn)
        self.turns.append(turn)
        if self.control is not None:
            self.control.observe_turn(turn.token_metrics, len(turn.token_ids),
                                      bool(turn.tool_calls))  # fmt: skip
        if turn.analysis:
            self.analyses.append(turn.analysis)
        stop = _stop_reason(turn, cancel, self.round, self.max_tool_rounds)
        if stop is not None:
            self.response = _finish(self, turn, stop)
            return []
        return _with_ids(turn.tool_calls, self.round)

    def record(
        self, calls: list[ToolCall], results: list[ToolResult], cancel: threading.Event
    ) -> None:
        """The executed calls join the transcript; the next round starts (unless cancelled)."""
        _append_round(self, self.turns[-1], calls, results, self.round)
        if self.control is not None:
            self.control.observe_results(results)
        self.round += 1
        if cancel.is_set():
            self.response = _finish(self, self.turns[-1], STOP_CANCELLED)


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
        control: str | ControlPolicy | None = None,
        memory: Memory | None = None,
    ) -> None:
        """`control`: a noesis.control policy ("default", "none", or an object) steering every
        run's generations; None (default): no control, the requests' own knobs. `memory`: a
        noesis.sidecars.memory.Memory that `recall` searches (its MemorySidecar fills it)."""
        if max_tool_rounds < 0:
            raise InvalidRequest(f"max_tool_rounds must be >= 0, got {max_tool_rounds}")
        self.policy = None
        if control is not None:
            from noesis.control.policy import make_policy  # the control plane loads on demand

            self.policy = make_policy(control)
        self.generator = generator
        self.executor = executor if executor is not None else ToolExecutor()
        self.max_tool_rounds = max_tool_rounds
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None
        self.memory = memory

    def recall(self, query: str, k: int = 3) -> list[tuple[str, float]]:
        """Earlier turns most like `query`, (text, cosine similarity), best first; [] without a
        memory."""
        return self.memory.recall(query, k) if self.memory is not None else []

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
        **options: Any,
    ) -> SessionResponse:
        """Run the tool loop on a copy of `messages`. `tools`: callables, Tools or a registry.
        A `required` or named tool_choice applies to the first generation only (later ones are
        `auto`), so that a forced call cannot loop until the round limit. `options` go to every
        generate_turn call (noesis.LLM: params, constrained, grounded, response_format); a
        callable `params` is called with the round index (0 first) for that round's."""
        run = self.start(messages, tools, tool_choice, deterministic, **options)
        with self._running() as cancel:
            while not run.done:
                self._step(run, _generate(self.generator, run.request(), cancel), cancel)
        assert run.response is not None
        return run.response

    def stream(
        self,
        messages: list[dict[str, Any]],
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        deterministic: bool = False,
        **options: Any,
    ) -> Iterator[Any]:
        """generate(), as it happens: per generation its turn events (Tokens and Harmony parser
        events, when the generator has `stream_turn`) then the AssistantTurn; an
        ExecutedToolCall per tool result; the SessionResponse last. Closing the iterator stops
        the loop and aborts the generation in flight."""
        return self._stream(self.start(messages, tools, tool_choice, deterministic, **options))

    def start(
        self,
        messages: list[dict[str, Any]],
        tools: ToolsArg = None,
        tool_choice: ToolChoice = "auto",
        deterministic: bool = False,
        *,
        max_tool_rounds: int | None = None,
        control: bool = True,
        **options: Any,
    ) -> SessionRun:
        """A run of the loop over a copy of `messages`, not started: `advance` moves it (and
        others) one generation at a time. Arguments as for generate(); `control=False` opts this
        run out of the session's control policy, and out of the generator's own (noesis.LLM's
        control: its generate_turn gets control=False)."""
        registry = ToolRegistry.of(tools)
        _check_messages(messages)
        _check_tool_choice(tool_choice, registry)
        rounds = self.max_tool_rounds if max_tool_rounds is None else max_tool_rounds
        if rounds < 0:
            raise InvalidRequest(f"max_tool_rounds must be >= 0, got {rounds}")
        steering = None
        if not control:
            options["control"] = False
        elif self.policy is not None:
            from noesis.control.turns import TurnControl

            steering = TurnControl(self.policy)
        executor = self.executor.with_registry(registry)
        # An intent sidecar's prediction starts an isolated tool's worker while the turn decodes
        warm = getattr(self.generator, "predicts_tools", False) and executor.isolates()
        return SessionRun(
            messages, registry, executor, tool_choice=tool_choice, deterministic=deterministic,
            max_tool_rounds=rounds, options=options, control=steering,
            on_intent=executor.warm if warm else None,
        )  # fmt: skip

    def advance(self, runs: Sequence[SessionRun]) -> None:
        """One generation for every run not yet stopped, batched in the order given when the
        generator has `generate_turns`, then each run's tool calls."""
        active = [run for run in runs if not run.done]
        if not active:
            return
        with self._running() as cancel:
            turns = _generate_all(self.generator, [run.request() for run in active], cancel)
            for run, turn in zip(active, turns, strict=True):
                self._step(run, turn, cancel)

    def _stream(self, run: SessionRun) -> Iterator[Any]:
        with self._running() as cancel:
            while not run.done:
                turn = yield from _stream_turn(self.generator, run.request(), cancel)
                yield turn
                done_before = len(run.executed)
                self._step(run, turn, cancel)
                yield from run.executed[done_before:]
            yield run.response

    def _step(self, run: SessionRun, turn: AssistantTurn, cancel: threading.Event) -> None:
        calls = run.accept(turn, cancel)
        if not run.done:
            run.record(calls, run.executor.run(calls, cancel), cancel)

    @contextlib.contextmanager
    def _running(self) -> Iterator[threading.Event]:
        with self._lock:
            if self._cancel is not None:
                raise SessionBusy("this session is already generating; use another Session")
            self._cancel = cancel = threading.Event()
        try:
            yield cancel
        finally:
            with self._lock:
                self._cancel = None


def _generate(generator: TurnGenerator, request: TurnRequest, cancel: threading.Event):
    return generator.generate_turn(
        request.messages,
        request.tools,
        tool_choice=request.tool_choice,
        deterministic=request.deterministic,
        cancel=cancel,
        **_options(request),
    )


def _options(request: TurnRequest) -> dict[str, Any]:
    """A request's keyword options, with its on_intent when it has one."""
    if request.on_intent is None:
        return request.options
    return {**request.options, "on_intent": request.on_intent}


def _generate_all(
    generator: TurnGenerator, requests: list[TurnRequest], cancel: threading.Event
) -> list[AssistantTurn]:
    batched = getattr(generator, "generate_turns", None)
    if batched is not None:
        return batched(requests, cancel)
    return [_generate(generator, request, cancel) for request in requests]


def _stream_turn(
    generator: TurnGenerator, request: TurnRequest, cancel: threading.Event
) -> Generator[Any, None, AssistantTurn]:
    stream = getattr(generator, "stream_turn", None)
    if stream is None:
        return _generate(generator, request, cancel)
    return (
        yield from stream(
            request.messages,
            request.tools,
            tool_choice=request.tool_choice,
            deterministic=request.deterministic,
            cancel=cancel,
            **_options(request),
        )
    )


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


def _finish(run: SessionRun, turn: AssistantTurn, stop: str) -> SessionResponse:
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
        turns=run.turns,
    )


def _append_round(
    run: SessionRun,
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
        message["thinking"] = turn.analysis  # how the chat templates read analysis
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
