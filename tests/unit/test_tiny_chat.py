"""`noesis chat` for Harmony models (noesis.chat): the channel display over Session.stream's events,
the tool loop on scripted turns, and with the bundled model through the engine and the command."""

import io
import threading
from pathlib import Path

import pytest

from noesis import LLM, SamplingParams, chat
from noesis.cli import main
from noesis.errors import InvalidRequest
from noesis.harmony import NOESIS_TINY, HarmonyEncoding, HarmonyStreamParser, ParsedTurn
from noesis.harmony.parser import spelled_ids
from noesis.session import AssistantTurn, ToolCall

TARGET = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
needs_model = pytest.mark.skipif(not TARGET.is_dir(), reason="models/noesis-tiny not present")

ANALYSIS = "<|channel|>analysis<|message|>Use the calculator.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
    '<|message|>{"expression":"2+2"}<|call|>'
)
FINAL = "<|channel|>final<|message|>It is 4.<|return|>"


@pytest.fixture(scope="module")
def encoding() -> HarmonyEncoding:
    return HarmonyEncoding.from_file(TARGET, NOESIS_TINY)


class Scripted:
    """A TurnGenerator streaming scripted Harmony text through the one parser, a turn per text."""

    def __init__(self, encoding: HarmonyEncoding, texts: list[str]) -> None:
        self.encoding, self.texts, self.seen = encoding, iter(texts), []

    def generate_turn(self, messages, tools, **options):
        raise AssertionError("the chat streams its turns")

    def stream_turn(self, messages, tools, *, tool_choice, deterministic, cancel, **options):
        self.seen.append((list(messages), tools, options))
        ids = spelled_ids(self.encoding, next(self.texts))
        parser, parsed = HarmonyStreamParser(self.encoding), ParsedTurn()
        for event in [*parser.feed_all(ids), *parser.finish()]:
            parsed.add(event)
            yield event
        calls = [ToolCall("", c.name, c.arguments) for c in parsed.tool_calls]
        return AssistantTurn(parsed.analysis, calls, parsed.final, 1, len(ids), "stop")


def _reply(encoding, texts, tools="builtin", **options):
    llm, out = Scripted(encoding, texts), io.StringIO()
    history = [{"role": "user", "content": "What is 2+2?"}]
    final = chat.reply(
        llm, history, chat.tool_registry(tools), chat.Display(out, color=False), **options
    )
    return final, out.getvalue().splitlines(), history, llm


def test_a_call_runs_and_its_result_goes_back(encoding):
    final, lines, history, llm = _reply(encoding, [ANALYSIS + CALL, FINAL], params=SamplingParams())
    assert final == "It is 4."
    assert lines == [
        "analysis    Use the calculator.",
        'tool call   calculator {"expression":"2+2"}',
        "tool result 4",
        "final       It is 4.",
    ]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[2]["content"] == "4" and all("thinking" not in m for m in history)
    second_prompt = llm.seen[1][0]
    assert second_prompt[1]["thinking"] == "Use the calculator."  # analysis of this turn kept
    assert [t["function"]["name"] for t in llm.seen[0][1]] == list(chat.DEFAULT_TOOLS)
    assert llm.seen[0][2] == {"params": SamplingParams()}


@pytest.mark.parametrize(
    ("texts", "tools", "last"),
    [
        ([CALL] * 4, "builtin", "stopped     4 generations without a final answer"),
        ([ANALYSIS], "builtin", "stopped     no final answer in the model's output"),
        ([CALL], "none", "stopped     the model called a tool, but no tools are declared"),
    ],
)
def test_the_loop_stops_with_a_clear_line(encoding, texts, tools, last):
    final, lines, history, _ = _reply(encoding, texts, tools)
    assert final is None and lines[-1] == last


def test_malformed_and_cut_off_output_is_shown_not_raised(encoding):
    text = "stray<|start|>assistant<|channel|>final<|message|>It is"
    final, lines, _, _ = _reply(encoding, [text])
    assert lines[0].startswith("unparsed    ") and "stray" in lines[0]
    assert lines[-1] == "final       It is [cut off]" and final == "It is"


def test_display_labels_and_dims_analysis_on_a_terminal(encoding):
    out = io.StringIO()
    display = chat.Display(out, color=True)
    parser = HarmonyStreamParser(encoding)
    for event in parser.feed_all(spelled_ids(encoding, ANALYSIS + CALL)):
        display.event(event)
    first, second = out.getvalue().splitlines()
    assert first == "\033[1manalysis    \033[22m\033[2mUse the calculator.\033[22m"
    assert second.endswith('calculator {"expression":"2+2"}')


def test_tool_registry():
    assert chat.tool_registry("builtin").names == list(chat.DEFAULT_TOOLS)
    assert chat.tool_registry("none").names == []
    assert chat.tool_registry("string_tool, calculator").names == ["string_tool", "calculator"]
    with pytest.raises(InvalidRequest, match="unknown tools"):
        chat.tool_registry("calculator,shell")


# ---------------------------------------------------------------- with the bundled model


@pytest.fixture(scope="module")
def target() -> LLM:
    return LLM(str(TARGET), device="cpu", dtype="float32", progress=False)


@needs_model
def test_tool_loop_reaches_the_final_answer(target):
    history = [{"role": "user", "content": "What is 17 times 23?"}]
    out = io.StringIO()
    final = chat.reply(
        target, history, chat.tool_registry("builtin"), chat.Display(out, color=False),
        params=SamplingParams(temperature=0.0),
    )  # fmt: skip
    assert final is not None and "391" in final
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["analysis", "tool", "tool", "final"]
    assert lines[1].startswith("tool call   calculator {") and lines[2] == "tool result 391"
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[2]["name"] == "calculator" and history[2]["content"] == "391"
    assert target.engine.has_unfinished() is False


@needs_model
def test_closing_the_stream_aborts_the_generation(target):
    events = target.session().stream([{"role": "user", "content": "What is 17 times 23?"}])
    next(events)
    events.close()
    assert target.engine.has_unfinished() is False
    cancel = threading.Event()
    cancel.set()
    turn = target.generate_turn([{"role": "user", "content": "Hi"}], cancel=cancel)
    assert turn.finish_reason == "cancelled"


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


@needs_model
def test_chat_command_runs_sidecars(capsys, monkeypatch, tmp_path):
    """--sidecars FILE: the intent sidecar's guess warms the isolated calculator."""
    from noesis.tools.executor import ToolExecutor

    warmed, warm = [], ToolExecutor.warm
    monkeypatch.setattr(ToolExecutor, "warm",
                        lambda self, name: warmed.append(name) or warm(self, name))
    monkeypatch.delenv("NOESIS_MODEL", raising=False)
    config = tmp_path / "sidecars.toml"
    config.write_text("[sidecars.intent]\n")
    argv = ["chat", "--device", "cpu", "-t", "0", "--sidecars", str(config), "What is 6 times 7?"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[2] == "tool result 42"
    assert warmed and set(warmed) == {"calculator"}


def test_a_filtered_answer_says_so(encoding):
    class Filtered(Scripted):
        def stream_turn(self, *args, **kwargs):
            turn = yield from super().stream_turn(*args, **kwargs)
            turn.finish_reason = "content_filter"
            return turn

    llm, out = Filtered(encoding, [ANALYSIS + FINAL]), io.StringIO()
    history = [{"role": "user", "content": "What is 2+2?"}]
    chat.reply(llm, history, chat.tool_registry("builtin"), chat.Display(out, color=False))
    assert out.getvalue().splitlines()[-1] == "stopped     the safety sidecar ended the answer"


def test_chat_command_keeps_plain_chat_for_other_models(checkpoints, capsys):
    model = str(checkpoints.path("llama"))
    argv = ["chat", "--model", model, "--device", "cpu", "--max-tokens", "4", "--seed", "0", "hi"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "analysis" not in out and out.endswith("\n")
    assert main([*argv[:-1], "--tools", "builtin", "hi"]) == 1
    assert "--tools needs a Harmony model" in capsys.readouterr().err
