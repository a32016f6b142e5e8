"""Session: the tool loop over a scripted TurnGenerator (rounds, parallel calls, errors fed back,
round limit, cancel from another thread, flags passed through, transcript shape)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from noesis.errors import InvalidRequest
from noesis.session import (
    STOP_CANCELLED,
    STOP_FINAL,
    STOP_MAX_TOOL_ROUNDS,
    STOP_NO_FINAL,
    AssistantTurn,
    Session,
    SessionBusy,
    ToolCall,
)
from noesis.tiny import harmony
from noesis.tools import RetryPolicy, ToolError, ToolExecutor, ToolRegistry, tool
from noesis.tools.builtin import builtin_tools

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Help me."}]


def turn(*calls: tuple[str, str], final: str | None = None, analysis: str = "", **kw):
    tool_calls = [ToolCall(f"call_{name}_{i}", name, args) for i, (name, args) in enumerate(calls)]
    fields = {"prompt_tokens": 10, "completion_tokens": 5, "finish_reason": "stop", **kw}
    return AssistantTurn(analysis, tool_calls, final, **fields)


class Scripted:
    """Plays back turns (or functions of the request that return one) and records each request."""

    def __init__(self, *script: AssistantTurn | Callable[..., AssistantTurn]) -> None:
        self.script = list(script)
        self.requests: list[dict] = []

    def generate_turn(self, messages, tools, *, tool_choice, deterministic, cancel, **options):
        request = {
            "messages": copy.deepcopy(messages),
            "tools": tools,
            "tool_choice": tool_choice,
            "deterministic": deterministic,
            "cancel": cancel,
        }
        self.requests.append(request)
        step = self.script[min(len(self.requests), len(self.script)) - 1]
        return step(**request) if callable(step) else step


@tool
def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@tool
async def shout(text: str) -> str:
    """Upper-cases a text."""
    return text.upper()


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"refused: {reason}")


def test_multi_round_loop_with_parallel_calls():
    generator = Scripted(
        turn(("add", '{"a": 2, "b": 3}'), analysis="Need a sum."),
        turn(("add", '{"a": 5, "b": 10}'), ("shout", '{"text": "done"}'), analysis="Two more."),
        turn(final="15, DONE", analysis="Answer now.", prompt_tokens=40, completion_tokens=7),
    )
    response = Session(generator).generate(USER, tools=[add, shout])

    assert response.stop_reason == STOP_FINAL and not response.cancelled
    assert response.final == "15, DONE"
    assert response.analysis == "Need a sum.\nTwo more.\nAnswer now."
    assert [(c.name, c.result.content, c.round) for c in response.tool_calls] == [
        ("add", "5", 0),
        ("add", "15", 1),
        ("shout", "DONE", 1),
    ]
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (60, 17, 77)
    assert (usage.generations, usage.tool_rounds) == (3, 2)
    # The second generation saw the first round's call and result.
    seen = generator.requests[1]["messages"]
    assert seen[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert seen[3] == {"role": "tool", "tool_call_id": "call_add_0", "name": "add", "content": "5"}
    assert [s["function"]["name"] for s in generator.requests[0]["tools"]] == ["add", "shout"]


def test_transcript_is_openai_shaped_and_renders_as_harmony():
    generator = Scripted(
        turn(("add", '{"a":1,"b":2}'), ("shout", '{"text":"hi"}'), analysis="Both."),
        turn(final="3 and HI"),
    )
    response = Session(generator).generate(USER, tools=[add, shout])
    roles = [m["role"] for m in response.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant"]
    call_message = response.messages[2]
    assert call_message["thinking"] == "Both."
    assert [c["id"] for c in call_message["tool_calls"]] == ["call_add_0", "call_shout_1"]
    assert all(c["type"] == "function" for c in call_message["tool_calls"])
    assert [m["tool_call_id"] for m in response.messages[3:5]] == ["call_add_0", "call_shout_1"]
    assert response.messages[-1] == {"role": "assistant", "content": "3 and HI"}

    text = harmony.render(response.messages, generator.requests[0]["tools"])
    assert "<|start|>assistant<|channel|>analysis<|message|>Both.<|end|>" in text
    assert 'commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}<|call|>' in text
    assert "<|start|>functions.add to=assistant<|channel|>commentary<|message|>3<|end|>" in text
    assert "<|start|>functions.shout to=assistant<|channel|>commentary<|message|>HI<|end|>" in text
    assert text.endswith("<|channel|>final<|message|>3 and HI<|return|>")


def test_tool_errors_go_back_to_the_model():
    generator = Scripted(
        turn(("explode", '{"reason": "no"}'), ("add", '{"a": "x"}'), ("nope", "{}")),
        lambda messages, **_: turn(final=" | ".join(m["content"] for m in messages[-3:])),
    )
    response = Session(generator).generate(USER, tools=[explode, add])
    assert response.stop_reason == STOP_FINAL
    contents = [c.result.content for c in response.tool_calls]
    assert contents[0] == "error: refused: no"
    assert contents[1].startswith("error: invalid arguments: a: Input should be a valid integer")
    assert "b: Field required" in contents[1]
    assert contents[2] == "error: tool 'nope' is not declared"
    assert response.final == " | ".join(contents)
    assert [c.result.error for c in response.tool_calls] == [
        "tool_error",
        "invalid_arguments",
        "unknown_tool",
    ]


def test_max_tool_rounds_stops_with_a_clear_reason():
    generator = Scripted(turn(("add", '{"a": 1, "b": 1}')))  # calls a tool forever
    response = Session(generator, max_tool_rounds=2).generate(USER, tools=[add])
    assert response.stop_reason == STOP_MAX_TOOL_ROUNDS
    assert response.final is None
    assert (response.usage.generations, response.usage.tool_rounds) == (3, 2)
    assert len(response.tool_calls) == 2  # the third generation's call is not run
    assert response.messages[-1]["role"] == "tool"  # every call in the transcript has a result


def test_zero_tool_rounds_means_no_tool_runs():
    response = Session(Scripted(turn(("add", "{}"))), max_tool_rounds=0).generate(USER, [add])
    assert response.stop_reason == STOP_MAX_TOOL_ROUNDS and response.tool_calls == []


def test_a_turn_without_final_or_calls_reports_its_finish_reason():
    generator = Scripted(turn(analysis="Thinking...", finish_reason="length"))
    response = Session(generator).generate(USER)
    assert (response.stop_reason, response.finish_reason) == (STOP_NO_FINAL, "length")
    assert response.final is None and response.messages == USER


def test_cancel_from_another_thread_stops_generation_mid_turn():
    started = threading.Event()

    def blocking(cancel, **_):
        started.set()
        stopped = cancel.wait(timeout=10)  # a real generator stops decoding when this is set
        return turn(analysis="partial", finish_reason="cancelled" if stopped else "stop")

    generator = Scripted(turn(("add", '{"a": 1, "b": 2}')), blocking, turn(final="never"))
    session = Session(generator)
    threading.Thread(target=lambda: (started.wait(5), session.cancel()), daemon=True).start()
    start = time.perf_counter()
    response = session.generate(USER, tools=[add])
    assert time.perf_counter() - start < 5
    assert response.cancelled and response.stop_reason == STOP_CANCELLED
    assert response.finish_reason == "cancelled"
    assert response.final is None and len(generator.requests) == 2
    assert [c.result.content for c in response.tool_calls] == ["3"]
    # The session is reusable after a cancel, and cancel() while idle does nothing.
    session.cancel()
    generator.script = [turn(final="fresh")]
    assert session.generate(USER).final == "fresh"


def test_cancel_during_tool_execution_stops_the_loop():
    release = threading.Event()

    @tool
    def wait_for_release() -> str:
        """Blocks."""
        release.wait(5)
        return "released"

    generator = Scripted(turn(("wait_for_release", "{}")), turn(final="never"))
    session = Session(generator, executor=ToolExecutor(timeout_s=None))
    threading.Timer(0.2, session.cancel).start()
    start = time.perf_counter()
    response = session.generate(USER, tools=[wait_for_release])
    release.set()
    assert time.perf_counter() - start < 3
    assert response.cancelled and len(generator.requests) == 1
    assert response.tool_calls[0].result.error == "cancelled"
    assert response.messages[-1]["content"].startswith("error: cancelled")


def test_flags_are_passed_through():
    generator = Scripted(turn(("add", '{"a": 1, "b": 1}')), turn(final="2"))
    Session(generator).generate(USER, tools=[add], tool_choice="required", deterministic=True)
    assert [r["deterministic"] for r in generator.requests] == [True, True]
    # A forced call applies to the first generation; after it the model may answer.
    assert [r["tool_choice"] for r in generator.requests] == ["required", "auto"]
    assert isinstance(generator.requests[0]["cancel"], threading.Event)

    named = {"type": "function", "function": {"name": "add"}}
    generator = Scripted(turn(final="ok"))
    Session(generator).generate(USER, tools=[add], tool_choice=named)
    assert (
        generator.requests[0]["tool_choice"] == named and not generator.requests[0]["deterministic"]
    )


def test_tools_may_be_callables_tools_or_a_registry():
    def plain(x: int) -> int:
        """Doubles."""
        return 2 * x

    for tools in ([plain], [tool(plain)], ToolRegistry([plain])):
        generator = Scripted(turn(("plain", '{"x": 4}')), turn(final="8"))
        response = Session(generator).generate(USER, tools=tools)
        assert response.tool_calls[0].result.content == "8"
    generator = Scripted(turn(("calculator", '{"expression": "6*7"}')), turn(final="42"))
    response = Session(generator).generate(USER, tools=builtin_tools(["calculator"]))
    assert response.tool_calls[0].result.content == "42"
    assert generator.requests[0]["tools"][0]["function"]["name"] == "calculator"


def test_no_tools_declares_none_and_a_stray_call_gets_an_error():
    generator = Scripted(turn(("add", "{}")), turn(final="sorry"))
    response = Session(generator).generate(USER)
    assert generator.requests[0]["tools"] is None
    assert response.tool_calls[0].result.content == "error: tool 'add' is not declared"


def test_missing_or_repeated_ids_are_made_unique():
    generator = Scripted(
        AssistantTurn(
            "",
            [
                ToolCall("", "add", '{"a":1,"b":1}'),
                ToolCall("x", "add", '{"a":2,"b":2}'),
                ToolCall("x", "add", '{"a":3,"b":3}'),
            ],
            None,
            1,
            1,
            "tool_calls",
        ),
        turn(final="done"),
    )
    response = Session(generator).generate(USER, tools=[add])
    assert [c.id for c in response.tool_calls] == ["call_0_0", "x", "call_0_2"]
    assert [m["tool_call_id"] for m in response.messages if m["role"] == "tool"] == [
        "call_0_0",
        "x",
        "call_0_2",
    ]


def test_input_messages_are_not_modified():
    messages = copy.deepcopy(USER)
    Session(Scripted(turn(("add", '{"a":1,"b":1}')), turn(final="2"))).generate(messages, [add])
    assert messages == USER


def test_retries_configured_on_the_session_executor_apply():
    attempts = []

    @tool
    def flaky() -> str:
        """Fails once."""
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("reset")
        return "ok"

    executor = ToolExecutor(retry=RetryPolicy(max_attempts=2, initial_s=0.0))
    generator = Scripted(turn(("flaky", "{}")), turn(final="ok"))
    response = Session(generator, executor=executor).generate(USER, tools=[flaky])
    assert response.tool_calls[0].result.attempts == 2 and response.tool_calls[0].result.ok


def test_a_busy_session_refuses_a_second_generate():
    started, release = threading.Event(), threading.Event()

    def slow(**_):
        started.set()
        release.wait(5)
        return turn(final="first")

    session = Session(Scripted(slow))
    worker = threading.Thread(target=session.generate, args=(USER,))
    worker.start()
    started.wait(5)
    with pytest.raises(SessionBusy):
        session.generate(USER)
    release.set()
    worker.join(5)


@pytest.mark.parametrize(
    ("messages", "options", "words"),
    [
        ([], {}, "non-empty"),
        ([{"content": "no role"}], {}, "role"),
        (USER, {"tool_choice": "sometimes"}, "tool_choice"),
        (USER, {"tool_choice": "required"}, "no tools"),
        (
            USER,
            {"tool_choice": {"type": "function", "function": {"name": "sub"}}, "tools": [add]},
            "'sub'",
        ),
        (USER, {"tool_choice": {"name": "add"}, "tools": [add]}, "tool_choice"),
    ],
)
def test_bad_requests_raise_invalid_request(messages, options, words):
    with pytest.raises(InvalidRequest, match=words):
        Session(Scripted(turn(final="x"))).generate(messages, **options)


def test_bad_session_settings():
    with pytest.raises(InvalidRequest, match="max_tool_rounds"):
        Session(Scripted(), max_tool_rounds=-1)


# ---------------------------------------------------------------- stream and lockstep runs


def test_stream_yields_each_turn_then_results_then_the_response():
    generator = Scripted(turn(("add", '{"a": 2, "b": 3}')), turn(final="5"))
    events = list(Session(generator).stream(USER, tools=[add]))
    kinds = [type(event).__name__ for event in events]
    assert kinds == ["AssistantTurn", "ExecutedToolCall", "AssistantTurn", "SessionResponse"]
    assert events[1].result.content == "5" and events[-1].final == "5"
    assert events[-1].turns == [events[0], events[2]]


def test_advance_moves_runs_in_lockstep_batches_with_per_round_options():
    batches = []

    class Batched(Scripted):
        def generate_turns(self, requests, cancel):
            batches.append([(len(r.messages), r.options["params"]) for r in requests])
            return [turn(final="done") if len(r.messages) > 2 else
                    turn(("add", '{"a": 1, "b": 1}')) for r in requests]  # fmt: skip

    session = Session(Batched(), max_tool_rounds=2)
    runs = [session.start(USER, [add], params=lambda index: f"round {index}") for _ in range(2)]
    single = session.start(USER[1:], [add], max_tool_rounds=0, params="fixed")
    session.advance(runs)
    session.advance([single, *runs])
    assert batches == [[(2, "round 0")] * 2, [(1, "fixed"), (4, "round 1"), (4, "round 1")]]
    assert all(run.done for run in [*runs, single])
    assert [run.response.stop_reason for run in runs] == [STOP_FINAL, STOP_FINAL]
    assert single.response.stop_reason == STOP_MAX_TOOL_ROUNDS and not single.executed
    assert runs[0].response.usage.completion_tokens == 10


# ---------------------------------------------------------------- with the bundled model

TINY = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"


@pytest.mark.skipif(not TINY.is_dir(), reason="models/noesis-tiny not present")
def test_bundled_model_answers_through_the_session_with_its_calculator():
    from noesis.llm import LLM

    llm = LLM(str(TINY), device="cpu", dtype="float32", progress=False)
    tools = builtin_tools(["calculator", "convert_units", "day_of_week", "lookup_country"])
    question = [{"role": "user", "content": "What is 17*23?"}]
    response = llm.session().generate(question, tools=tools, deterministic=True)
    assert response.stop_reason == STOP_FINAL
    assert [(c.name, c.result.content) for c in response.tool_calls] == [("calculator", "391")]
    assert "391" in response.final
    assert (response.usage.generations, response.usage.tool_rounds) == (2, 1)
    # The transcript renders the same through the checkpoint's template and harmony.render.
    declared = tools.schemas()
    templated = llm.tokenizer.apply_chat_template(response.messages, declared, False)
    assert templated == harmony.render(response.messages, declared)
