"""Tool-call dialects (noesis.dialects) on each family's chat template: prompts render as
transformers renders them, the parser reads rendered calls back and survives fuzzed streams, and
the turn grammar compiles for every tool_choice."""

from __future__ import annotations

import json
import random

import pytest
from dialect_checkpoints import FAMILIES, build_family_tokenizer

from noesis.dialects import DIALECTS, NAMES, TurnFormat, TurnOptions, detect, dialect_named
from noesis.dialects.parser import TextTurnParser, parse_text
from noesis.errors import ChatTemplateError, InvalidRequest
from noesis.harmony.parser import ParsedTurn
from noesis.sampling.params import SamplingParams
from noesis.structured import GrammarCompiler, GrammarError
from noesis.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
QUESTION = {"role": "user", "content": "What is the weather like in Paris?"}
CALLS = [
    {"id": "call_0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
]  # fmt: skip
EXPECTED = {"qwen25": "hermes", "qwen3": "hermes", "llama31": "llama3_json",
            "mistral03": "mistral", "r1_distill": "plain"}  # fmt: skip
CALLING = ("qwen25", "qwen3", "llama31", "mistral03")


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    dirs = {}
    for family in FAMILIES:
        dirs[family] = tmp_path_factory.mktemp(family)
        build_family_tokenizer(dirs[family], family)
    return dirs


@pytest.fixture(scope="module")
def formats(tokenizer_dirs) -> dict[str, TurnFormat]:
    return {f: TurnFormat.of(Tokenizer.from_dir(d)) for f, d in tokenizer_dirs.items()}


def _conversations(family: str) -> list[tuple[list[dict], dict]]:
    """(messages, template kwargs) cases: a question with tools, and a finished tool round."""
    calls = CALLS[:1] if family == "llama31" else CALLS  # Llama 3.1 renders one call a turn
    history = [
        QUESTION,
        {"role": "assistant", "content": "", "tool_calls": calls, "thinking": "Look it up."},
        *[
            {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
             "content": '{"temperature": 21}'}
            for c in calls
        ],
    ]  # fmt: skip
    cases = [([QUESTION], {}), (history, {})]
    if family == "qwen3":
        cases.append(([QUESTION], {"enable_thinking": False}))
    return cases


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompts_render_as_transformers_renders_them(family, tokenizer_dirs, formats):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    fmt = formats[family]
    tools = TOOLS if fmt.has_calls else None
    for messages, kwargs in _conversations(family)[: 1 if tools is None else None]:
        messages = fmt.template_messages(messages)
        expected = reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert fmt.tokenizer.apply_chat_template(messages, tools, **kwargs) == expected
        ids = fmt.tokenizer.encode_chat(messages, tools, **kwargs)
        assert ids == reference.encode(expected, add_special_tokens=False)


def test_each_family_gets_its_dialect_and_names_override_it(formats):
    assert {family: fmt.name for family, fmt in formats.items()} == EXPECTED
    assert formats["qwen3"].thinks and formats["r1_distill"].thinks
    assert not formats["qwen25"].thinks and not formats["llama31"].thinks
    assert detect("{{ messages }}", ["<tool_call>"]) is None  # a template without tool syntax
    assert detect(None, ["[TOOL_CALLS]"]) is DIALECTS["mistral"]  # no template: the vocabulary
    tokenizer = formats["r1_distill"].tokenizer
    assert TurnFormat.of(tokenizer, "hermes").name == "hermes"
    with pytest.raises(InvalidRequest, match="known: hermes, llama3_json, mistral"):
        dialect_named("qwen")
    assert "harmony" in NAMES


def test_think_mode_follows_the_generation_prompt(formats):
    qwen3, r1 = formats["qwen3"], formats["r1_distill"]
    assert qwen3.think_mode(qwen3.tokenizer.encode_chat([QUESTION])) == "optional"
    closed = qwen3.tokenizer.encode_chat([QUESTION], enable_thinking=False)
    assert qwen3.think_mode(closed) == "off"
    assert r1.think_mode(r1.tokenizer.encode_chat([QUESTION])) == "open"
    qwen25 = formats["qwen25"]
    assert qwen25.think_mode(qwen25.tokenizer.encode_chat([QUESTION])) == "off"


@pytest.mark.parametrize("family", CALLING)
def test_the_parser_reads_back_the_calls_the_template_renders(family, formats):
    fmt = formats[family]
    for messages, kwargs in _conversations(family)[1:2]:
        messages = fmt.template_messages(messages[:2])
        prompt = fmt.tokenizer.apply_chat_template(messages[:1], TOOLS, **kwargs)
        whole = fmt.tokenizer.apply_chat_template(messages, TOOLS, False, **kwargs)
        assert whole.startswith(prompt)
        reply = _drop_end_tokens(whole[len(prompt) :], fmt)
        turn = parse_text(fmt.dialect, reply, thinks=fmt.thinks)
        sent = messages[1]["tool_calls"]
        assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in sent
        ]
        assert not turn.issues and turn.final is None
        if family == "qwen3":
            assert turn.analysis == "Look it up."


def _drop_end_tokens(text: str, fmt: TurnFormat) -> str:
    for token_id in fmt._end_ids():
        text = text.replace(fmt.tokenizer.decode([token_id], skip_special_tokens=False), "")
    return text


# Generations as each family writes them: reasoning, text, parallel calls, odd spacing.
SAMPLES = {
    "hermes": '<think>\nCheck the weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": '
    '"get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"a": 1, "b": "}"}, "name": "add"}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa\\"ris", "unit": '
    '"celsius"}}; {"name": "add", "parameters": {"a": [1, {"b": 2}]}}',
    "mistral": 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}, "id": "abcdefghi"}, {"name": "add", "arguments": "{\\"a\\": 1}"}]',
}
SAMPLE_CALLS = {
    "hermes": [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": "}"})],
    "llama3_json": [("get_weather", {"city": 'Pa"ris', "unit": "celsius"}),
                    ("add", {"a": [1, {"b": 2}]})],
    "mistral": [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1})],
}  # fmt: skip


def _summary(turn: ParsedTurn):
    calls = [(c.name, json.loads(c.arguments)) for c in turn.tool_calls]
    return turn.analysis, turn.final, calls, len(turn.issues)


def _fed(dialect, chunks) -> ParsedTurn:
    parser = TextTurnParser(DIALECTS[dialect], thinks=True)
    turn = ParsedTurn()
    for event in [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish():
        turn.add(event)
    return turn


@pytest.mark.parametrize("dialect", list(SAMPLES))
def test_streamed_parses_equal_the_whole_at_every_split(dialect):
    text = SAMPLES[dialect]
    whole = _fed(dialect, [text])
    analysis, final, calls, issues = _summary(whole)
    assert calls == SAMPLE_CALLS[dialect] and issues == 0
    assert analysis == ("Check the weather." if dialect == "hermes" else "")
    assert final == {"hermes": "Let me look.", "mistral": "Sure.", "llama3_json": None}[dialect]
    for cut in range(1, len(text)):
        assert _summary(_fed(dialect, [text[:cut], text[cut:]])) == _summary(whole), cut
    assert _summary(_fed(dialect, list(text))) == _summary(whole)


def test_arguments_stream_as_deltas_once_the_name_is_known():
    parser = TextTurnParser(DIALECTS["hermes"])
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    events = parser.feed(head)
    assert events[0].recipient == "functions.get_weather"
    assert "".join(e.text for e in events[1:]) == '{"city": "Pa'
    events = parser.feed('ris"}}\n</tool_call>')
    assert [type(e).__name__ for e in events] == ["ContentDelta", "MessageEnd"]
    assert events[0].text == 'ris"}' and events[1].stop == "call"


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "<|python_tag|>", "{",
    "}", "[", "]", '"', "\\", ",", ";", ":", '"name"', '"arguments"', '"parameters"', " ", "\n",
    "Paris", "é", "日本", '{"name": "add", "arguments": {"a": 1}}', "null", "<", "</tool",
]  # fmt: skip


@pytest.mark.parametrize("dialect", list(SAMPLES) + ["plain"])
def test_the_parser_never_raises_on_fuzzed_streams(dialect):
    """Random marker, JSON and text fragments, cut anywhere, fed in random chunks: every stream
    parses, and a stream without markers comes back as its text."""
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 24)))
        if rng.random() < 0.5:  # mutate a well-formed sample
            sample = SAMPLES.get(dialect, SAMPLES["hermes"])
            start = rng.randint(0, len(sample))
            text = sample[:start] + text + sample[rng.randint(start, len(sample)) :]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        turn = _fed(dialect, chunks)
        for call in turn.tool_calls:  # arguments as written: JSON, or an issue says they're not
            assert _is_json(call.arguments) or turn.issues
    plain = "Just words, nothing else: 1 < 2."
    assert _fed(dialect, [plain[:5], plain[5:]]).final == plain


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def compilers(formats):
    return {
        family: GrammarCompiler.from_tokenizer(fmt.tokenizer, 384)
        for family, fmt in formats.items()
    }


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("family", CALLING)
def test_turn_grammars_compile_for_every_tool_choice(family, formats, compilers):
    fmt = formats[family]
    prompt = fmt.tokenizer.encode_chat([QUESTION], TOOLS)
    for choice in ("auto", "none", "required", NAMED):
        for parallel in (True, False):
            options = TurnOptions(choice, parallel_tool_calls=parallel, thinking_budget=16)
            params = fmt.params(SamplingParams(), prompt, TOOLS, options)
            assert not params.skip_special_tokens
            compilers[family].compile(params.grammar)
    response_format = {"type": "json_object"}
    params = fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions("auto", response_format))
    compilers[family].compile(params.grammar)
    assert fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions(), False).grammar is None
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(GrammarError):
            fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions(bad))
    with pytest.raises(GrammarError, match="thinking_budget"):
        fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions(thinking_budget=-1))


def test_tools_on_a_family_without_tool_syntax_name_the_fix(formats):
    fmt = formats["r1_distill"]
    prompt = fmt.tokenizer.encode_chat([QUESTION])
    with pytest.raises(InvalidRequest, match="--tool-dialect"):
        fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions())
    assert fmt.params(SamplingParams(), prompt, TOOLS, TurnOptions("none")).grammar is not None


def test_mistral_call_ids_become_the_nine_characters_its_template_wants(formats):
    messages = formats["mistral03"].template_messages(_conversations("mistral03")[1][0])
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in messages[2:]] == ids
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "unit": "celsius"
    }  # fmt: skip


def test_a_chat_template_file_and_a_dialect_name_come_from_the_command_line(
    tmp_path, tokenizer_dirs
):
    from noesis import cli

    path = tmp_path / "qwen.jinja"
    path.write_text(FAMILIES["qwen25"][0])
    for command in ("chat", "serve"):
        argv = [command, "--model", "m", "--chat-template", str(path), "--tool-dialect", "hermes"]
        options = cli._template_options(cli._parser().parse_args(argv))
        assert options == {"chat_template": FAMILIES["qwen25"][0], "tool_dialect": "hermes"}
    tokenizer = Tokenizer.from_dir(tokenizer_dirs["r1_distill"])
    assert TurnFormat.of(tokenizer).name == "plain"
    tokenizer.set_chat_template(path.read_text())
    assert TurnFormat.of(tokenizer).name == "hermes"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tokenizer.set_chat_template("{% if %}")


def test_grounded_arguments_narrow_every_dialect_to_the_users_words(formats):
    city = {"type": "string", "x-noesis-grounded": True}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": city}, "required": ["city"]}}}  # fmt: skip
    for family in CALLING:
        fmt = formats[family]
        prompt = fmt.tokenizer.encode_chat([QUESTION], [tool])
        options = TurnOptions("required", messages=[QUESTION])
        grammar = fmt.params(SamplingParams(), prompt, [tool], options).grammar.source
        assert '"enum": [' in grammar and '"Paris"' in grammar and "x-noesis" not in grammar


def test_request_fields_reach_the_chat_template():
    from noesis.server.errors import APIError
    from noesis.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [QUESTION], "reasoning_effort": "low",
        "documents": [{"title": "t", "text": "x"}],
        "chat_template_kwargs": {"enable_thinking": False},
    })  # fmt: skip
    assert body.template_kwargs() == {
        "enable_thinking": False, "documents": [{"title": "t", "text": "x"}],
        "reasoning_effort": "low",
    }  # fmt: skip
    assert body.parallel_tool_calls and body.thinking_budget is None
    bad = body.model_copy(update={"chat_template_kwargs": {"add_generation_prompt": False}})
    with pytest.raises(APIError, match="add_generation_prompt"):
        bad.template_kwargs()
