"""Harmony chat (noesis.tiny.chat): the lenient parser, the channel display, and the tool loop with
the bundled model through the engine and the `noesis chat` command."""

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from noesis import LLM, SamplingParams
from noesis.cli import main
from noesis.errors import InvalidRequest
from noesis.tiny import chat
from noesis.tiny.harmony import ParsedMessage

TARGET = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
needs_model = pytest.mark.skipif(not TARGET.is_dir(), reason="models/noesis-tiny not present")

ANALYSIS = "<|channel|>analysis<|message|>Use the calculator.<|end|>"
A = "analysis:Use the calculator."
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
    '<|message|>{"expression":"2+2"}<|call|>'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"


def _kinds(segments) -> list[str]:
    return [
        f"unparsed:{s.text}" if isinstance(s, chat.Unparsed) else f"{s.channel}:{s.content}"
        for s in segments
    ]


def test_parses_analysis_call_and_final():
    segments = chat.parse_stream(ANALYSIS + CALL + FINAL)
    assert _kinds(segments) == [
        "analysis:Use the calculator.",
        'commentary:{"expression":"2+2"}',
        "final:It is 4.",
    ]
    assert [s.stop for s in segments] == ["<|end|>", "<|call|>", "<|return|>"]
    assert chat.function_name(segments[1]) == "calculator"
    assert segments[1].constrain == "json"
    call = ("Use the calculator.", "calculator", '{"expression":"2+2"}')
    assert chat.next_action(segments) == call
    assert chat.next_action(chat.parse_stream(ANALYSIS + FINAL)) == "It is 4."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("no harmony at all", ["unparsed:no harmony at all"]),
        ("<|channel|>final<|message|>cut", ["final:cut"]),
        (ANALYSIS + "junk" + FINAL, [A, "unparsed:junk", "final:It is 4."]),
        (ANALYSIS + "<|start|>assistant<|chan", [A, "unparsed:<|start|>assistant<|chan"]),
        ("<|start|><|start|><|message|><|end|>", ["unparsed:<|start|>", ":"]),
        ("<|message|><|message|>x<|call|><|return|>", [":<|message|>x", "unparsed:<|return|>"]),
    ],
)  # fmt: skip
def test_malformed_output_is_kept_not_raised(text, expected):
    segments = chat.parse_stream(text)
    assert _kinds(segments) == expected
    out = io.StringIO()
    display = chat.Display(out, color=False)
    for segment in segments:
        display.segment(segment)
    assert out.getvalue().count("\n") == len(segments)


def test_display_labels_and_dims_analysis_on_a_terminal():
    segments = chat.parse_stream(ANALYSIS + CALL + FINAL[:-10])  # the final is cut off
    plain, colored = io.StringIO(), io.StringIO()
    for out, color in ((plain, False), (colored, True)):
        display = chat.Display(out, color=color)
        for segment in segments:
            display.segment(segment)
        display.line("tool result", "4")
    assert plain.getvalue().splitlines() == [
        "analysis    Use the calculator.",
        'tool call   calculator {"expression":"2+2"}',
        "final       It is 4. [cut off]",
        "tool result 4",
    ]
    assert "\033[2mUse the calculator.\033[22m" in colored.getvalue()
    assert "\033[2m" not in plain.getvalue()


def test_segments_are_shown_as_soon_as_complete():
    text = ANALYSIS + CALL
    deltas = [text[i : i + 7] for i in range(0, len(text), 7)]
    shown: list[tuple[int, ParsedMessage]] = []
    delivered = []

    def stream(prompt, params):
        assert params.skip_special_tokens is False and chat.RUN_ON_STOP in params.stop
        for delta in deltas:
            delivered.append(delta)
            yield delta

    llm = SimpleNamespace(stream=stream)
    segments = chat.stream_segments(
        llm, [1], SamplingParams(), lambda s: shown.append((len(delivered), s))
    )
    assert [s for _, s in shown] == segments and len(segments) == 2
    assert shown[0][0] < len(deltas)  # the analysis came out before the stream ended


@pytest.mark.parametrize("deltas", [[], [" ", "\n"], ["<|end|>", "x"], ["<|start|>", "<|start|>"]])
def test_streaming_odd_text_never_raises(deltas):
    llm = SimpleNamespace(stream=lambda prompt, params: iter(deltas))
    shown = []
    segments = chat.stream_segments(llm, [1], SamplingParams(), shown.append)
    assert shown == segments
    assert chat.next_action(segments) is None


def test_tool_declarations():
    assert [t["function"]["name"] for t in chat.tool_declarations("builtin")] == list(
        chat.DEFAULT_TOOLS
    )
    assert chat.tool_declarations("none") == []
    assert [t["function"]["name"] for t in chat.tool_declarations("string_tool, calculator")] == [
        "string_tool",
        "calculator",
    ]
    with pytest.raises(InvalidRequest, match="unknown tools"):
        chat.tool_declarations("calculator,shell")
    declared = chat.tool_declarations("calculator")
    assert chat.run_declared(declared, "calculator", '{"expression":"6*7"}') == "42"
    assert chat.run_declared(declared, "string_tool", "{}").startswith("error: ")


def test_is_harmony():
    harmony_ids = {"<|start|>": 2, "<|end|>": 3, "<|message|>": 4, "<|channel|>": 5}
    assert chat.is_harmony(SimpleNamespace(token_to_id=harmony_ids.get))
    assert not chat.is_harmony(SimpleNamespace(token_to_id={"<|start|>": 2}.get))


# ---------------------------------------------------------------- with the bundled model


@pytest.fixture(scope="module")
def target() -> LLM:
    return LLM(str(TARGET), device="cpu", dtype="float32", progress=False)


@needs_model
def test_tool_loop_reaches_the_final_answer(target):
    history = [{"role": "user", "content": "What is 17 times 23?"}]
    out = io.StringIO()
    final = chat.run_turn(
        target, history, chat.tool_declarations("builtin"), SamplingParams(temperature=0.0),
        chat.Display(out, color=False),
    )  # fmt: skip
    assert final is not None and "391" in final
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["analysis", "tool", "tool", "final"]
    assert lines[1].startswith("tool call   calculator {") and lines[2] == "tool result 391"
    roles = [m["role"] for m in history]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert history[2] == {"role": "tool", "name": "calculator", "content": "391"}
    assert all("thinking" not in m for m in history)  # past turns keep no analysis
    assert target.engine.has_unfinished() is False


@needs_model
def test_tool_loop_stops_at_the_step_limit(target):
    history = [{"role": "user", "content": "What is 17 times 23?"}]
    out = io.StringIO()
    final = chat.run_turn(
        target, history, chat.tool_declarations("builtin"), SamplingParams(temperature=0.0),
        chat.Display(out, color=False), max_steps=1,
    )  # fmt: skip
    assert final is None
    assert out.getvalue().splitlines()[-1] == "stopped     1 generations without a final answer"
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]


@needs_model
def test_chat_command_defaults_to_the_bundled_model_and_its_tools(capsys, monkeypatch):
    monkeypatch.delenv("NOESIS_MODEL", raising=False)
    assert main(["chat", "--device", "cpu", "-t", "0", "What is 6 times 7?"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == 'tool call   calculator {"expression":"6*7"}'
    assert lines[2] == "tool result 42"
    assert lines[-1].startswith("final") and "42" in lines[-1]
    assert main(["chat", "--device", "cpu", "-t", "0", "--tools", "none", "What is 6*7?"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["analysis", "final"]  # no calculator declared


def test_chat_command_keeps_plain_chat_for_other_models(checkpoints, capsys):
    model = str(checkpoints.path("llama"))
    argv = ["chat", "--model", model, "--device", "cpu", "--max-tokens", "4", "--seed", "0", "hi"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "analysis" not in out and out.endswith("\n")
    assert main([*argv[:-1], "--tools", "builtin", "hi"]) == 1
    assert "--tools needs a Harmony model" in capsys.readouterr().err
