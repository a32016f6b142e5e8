"""Harmony rendering: o200k_harmony ids equal openai_harmony's, the bundled model's ids equal the
template it was trained on (noesis.tiny.harmony.render), and the vocabulary loads offline."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from noesis.errors import InvalidRequest
from noesis.harmony import (
    GPT_OSS,
    NOESIS_TINY,
    HarmonyEncoding,
    Layout,
    Message,
    SystemConfig,
    UnsupportedTokenizer,
    VocabularyMissing,
    from_openai,
    prepare_offline,
    vocab,
)

oh = pytest.importorskip("openai_harmony")
TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """openai_harmony's gpt-oss encoding, loaded from the local copy that prepare_offline writes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(vocab.ENCODINGS_DIR_VAR, raising=False)
        prepare_offline(tmp_path_factory.mktemp("encodings"))
        yield oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def o200k():
    return HarmonyEncoding.o200k_harmony()


@pytest.fixture(scope="module")
def tiny():
    return HarmonyEncoding.from_file(TINY_DIR, NOESIS_TINY)


# ---------------------------------------------------------------- the vocabulary


def test_every_special_id_matches_openai_harmony(o200k, reference):
    specials = vocab.special_tokens()
    assert len(specials) == len(reference.special_tokens_set) == 1091
    assert set(specials) == reference.special_tokens_set
    for text, token_id in specials.items():
        assert reference.decode_utf8([token_id]) == text
        assert o200k.vocab.token_bytes(token_id) == text.encode()
    named = {"<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}
    assert all(o200k.vocab.special_id(t) == i for t, i in named.items())
    assert o200k.vocab.size == vocab.LAST_SPECIAL_ID + 1
    assert sorted(o200k.stop_tokens_for_assistant_actions()) == sorted(
        reference.stop_tokens_for_assistant_actions()
    )
    assert sorted(o200k.stop_tokens()) == sorted(reference.stop_tokens())


TEXTS = [
    "Hello, world! It's 2025-01-01 and I'm testing o200k.",
    "  leading spaces\n\n\ttabs\r\nCRLF and trailing   ",
    "数字 123456789 ünïcödé Ωμέγα — emoji 🌍👩‍👩‍👧 عربي",
    'def f(x):\n    return {"a": [1, 2.5, None]}  # code',
    "literal <|end|> and <|start|> spellings stay text",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_encoding_matches_openai_harmony(o200k, reference, text):
    ids = o200k.encode_text(text)
    assert ids == reference.encode(text, disallowed_special=())
    assert o200k.decode(ids) == text


def test_prepare_offline_writes_a_verified_copy_once(tmp_path, monkeypatch):
    monkeypatch.delenv(vocab.ENCODINGS_DIR_VAR, raising=False)
    directory = prepare_offline(tmp_path / "cache")
    copy = directory / vocab.VOCAB_FILE
    assert os.environ[vocab.ENCODINGS_DIR_VAR] == str(directory)
    assert vocab._intact(copy)
    stamp = copy.stat().st_mtime_ns
    prepare_offline(directory)
    assert copy.stat().st_mtime_ns == stamp  # intact: not rewritten
    copy.write_bytes(b"corrupt")
    prepare_offline(directory)
    assert vocab._intact(copy)  # a damaged copy is replaced


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(vocab.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(VocabularyMissing, match="pip install bpe-openai"):
        vocab.packaged_vocab_path()


OFFLINE_SCRIPT = """
import openai_harmony as oh
from noesis.harmony import prepare_offline
if {prepare}:
    prepare_offline()
encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
print(len(encoding.encode("offline")))
"""


@pytest.mark.parametrize("prepare", [True, False])
def test_openai_harmony_loads_without_network(tmp_path, prepare):
    """Every proxy points at a closed port and the download cache is empty: loading works only
    through prepare_offline (the control run, without it, must fail to fetch)."""
    dead = "http://127.0.0.1:9"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(REPO_SRC),
        "NOESIS_CACHE_DIR": str(tmp_path / "noesis"),
        "TIKTOKEN_RS_CACHE_DIR": str(tmp_path / "empty"),
        **{name: dead for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "https_proxy")},
    }
    script = textwrap.dedent(OFFLINE_SCRIPT.format(prepare=prepare))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    if prepare:
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "noesis" / "tiktoken" / vocab.VOCAB_FILE).is_file()
    else:
        assert result.returncode != 0


# ---------------------------------------------------------------- o200k: parity with openai_harmony


def reference_conversation(messages, tools, system: SystemConfig | None):
    """The same conversation built with openai_harmony's own objects."""
    out = []
    if system is not None:
        out.append(oh.Message.from_role_and_content(oh.Role.SYSTEM, _reference_system(system)))
    instructions = None
    if messages and messages[0]["role"] in ("system", "developer"):
        instructions, messages = messages[0]["content"], messages[1:]
    if instructions or tools:
        developer = oh.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([_reference_tool(t) for t in tools])
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names = {}
    for message in messages:
        out += _reference_turn(message, names)
    return oh.Conversation.from_messages(out)


def _reference_system(config: SystemConfig):
    efforts = {None: None, "low": "Low", "medium": "Medium", "high": "High"}
    channels = oh.ChannelConfig(
        valid_channels=list(config.valid_channels), channel_required=config.channel_required
    )
    return oh.SystemContent(
        model_identity=config.model_identity,
        knowledge_cutoff=config.knowledge_cutoff,
        conversation_start_date=config.current_date,
        reasoning_effort=efforts[config.reasoning_effort],
        channel_config=channels,
    )


def _reference_tool(tool):
    function = tool["function"]
    return oh.ToolDescription.new(
        function["name"], function.get("description", ""), parameters=function.get("parameters")
    )


def _reference_turn(message, names):
    role = message["role"]
    if role == "user":
        return [oh.Message.from_role_and_content(oh.Role.USER, message["content"])]
    if role == "tool":
        name = message.get("name") or names[message["tool_call_id"]]
        author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
        result = oh.Message.from_author_and_content(author, message["content"])
        return [result.with_channel("commentary").with_recipient("assistant")]
    out = []
    reasoning = message.get("reasoning") or message.get("thinking")
    if reasoning:
        out.append(
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning).with_channel("analysis")
        )
    calls = message.get("tool_calls") or []
    if not calls:
        final = oh.Message.from_role_and_content(oh.Role.ASSISTANT, message.get("content") or "")
        return out + [final.with_channel("final")]
    if message.get("content"):
        preamble = oh.Message.from_role_and_content(oh.Role.ASSISTANT, message["content"])
        out.append(preamble.with_channel("commentary"))
    for call in calls:
        names[call["id"]] = call["function"]["name"]
        request = oh.Message.from_role_and_content(oh.Role.ASSISTANT, call["function"]["arguments"])
        out.append(
            request.with_channel("commentary")
            .with_recipient(f"functions.{call['function']['name']}")
            .with_content_type("<|constrain|>json")
        )
    return out


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather for a city.\nUse metric units unless asked.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name", "examples": ["Paris"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days", "default": 1},
                "hourly": {"type": "boolean", "nullable": True},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Searches flights.",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "description": "Where to fly",
                    "properties": {
                        "from": {"type": "string", "title": "Origin"},
                        "to": {"type": "string"},
                        "stops": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["from", "to"],
                },
                "cabin": {"type": ["string", "null"], "default": "economy"},
                "budget": {
                    "description": "Max price",
                    "oneOf": [
                        {"type": "number", "description": "In dollars"},
                        {"type": "string", "enum": ["cheap", "any"], "default": "any"},
                    ],
                },
                "flex": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
                "tags": {"type": "array"},
                "extra": {"description": "Anything else"},
            },
            "required": ["route"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "Current time."}}
EMPTY = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, SEARCH, NOW, EMPTY]


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALL = {
    "role": "assistant",
    "reasoning": "The user wants the weather; call the tool.",
    "content": None,
    "tool_calls": [_call("c1", "get_weather", '{"city":"Paris"}')],
}
CASES = {
    "default_system": (GPT_OSS.system, [{"role": "user", "content": "Hi there"}], None),
    "identity_date_high": (
        SystemConfig(
            model_identity="You are Ada.",
            knowledge_cutoff=None,
            current_date="2025-08-05",
            reasoning_effort="high",
        ),
        [{"role": "user", "content": "What day is it?"}],
        None,
    ),
    "low_two_channels_optional": (
        SystemConfig(
            model_identity=None,
            reasoning_effort="low",
            valid_channels=("analysis", "final"),
            channel_required=False,
        ),
        [{"role": "user", "content": "2+2?"}],
        None,
    ),
    "instructions_only": (
        GPT_OSS.system,
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
        None,
    ),
    "instructions_and_tools": (
        SystemConfig(current_date="2025-01-31"),
        [
            {"role": "developer", "content": "Use tools wisely."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        TOOLS,
    ),
    "multi_turn_analysis": (
        GPT_OSS.system,
        [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "reasoning": "Any color works.", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "thinking": "Pick a different one.", "content": "Green."},
            {"role": "user", "content": "Thanks! ¿Y en español?"},
        ],
        None,
    ),
    "tool_call_pending_result": (
        GPT_OSS.system,
        [
            {"role": "user", "content": "Weather in Paris?"},
            CALL,
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'},
        ],
        TOOLS,
    ),
    "tool_call_then_final": (
        SystemConfig(reasoning_effort="low"),
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            CALL,
            {"role": "tool", "name": "get_weather", "content": "21C clear"},
            {"role": "assistant", "content": "It is 21°C and clear in Paris."},
            {"role": "user", "content": "And Rome?"},
        ],
        [WEATHER],
    ),
    "parallel_calls_with_preamble": (
        GPT_OSS.system,
        [
            {"role": "user", "content": "Flights and weather, please <|end|> literally."},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [
                    _call("a", "search_flights", '{"route":{"from":"SFO","to":"NRT"}}'),
                    _call("b", "get_weather", '{"city":"東京"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "3 flights"},
            {"role": "tool", "tool_call_id": "b", "content": "晴れ 25°C"},
        ],
        TOOLS,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_render_matches_openai_harmony(o200k, reference, case):
    system, messages, tools = CASES[case]
    encoding = HarmonyEncoding(o200k.vocab, Layout(system=system))
    ids = encoding.render_chat(messages, tools)
    expected = reference.render_conversation_for_completion(
        reference_conversation(messages, tools, system), oh.Role.ASSISTANT
    )
    assert ids == expected, (encoding.render_chat_text(messages, tools), reference.decode(expected))
    assert encoding.render_chat_text(messages, tools) == reference.decode_utf8(expected)


def test_training_form_matches_openai_harmony(o200k, reference):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids = o200k.render_chat(messages, for_completion=False)
    conversation = reference_conversation(messages, None, GPT_OSS.system)
    assert ids == reference.render_conversation_for_training(conversation)
    assert ids[-1] == o200k.special.return_


def test_harmony_level_messages_match_openai_harmony(o200k, reference):
    """Headers the chat conversion never writes: a user name, a bare content type, a recipient
    on a non-assistant message."""
    ours = [
        Message("user", "hi", name="alice"),
        Message("assistant", "{}", channel="final", content_type="json"),
        Message("developer", "note", recipient="assistant"),
        Message(
            "assistant",
            "x",
            channel="commentary",
            recipient="functions.f",
            content_type="<|constrain|>",
        ),
    ]
    theirs = oh.Conversation.from_messages(
        [
            oh.Message.from_author_and_content(oh.Author.new(oh.Role.USER, "alice"), "hi"),
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, "{}")
            .with_channel("final")
            .with_content_type("json"),
            oh.Message.from_role_and_content(oh.Role.DEVELOPER, "note").with_recipient("assistant"),
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, "x")
            .with_channel("commentary")
            .with_recipient("functions.f")
            .with_content_type("<|constrain|>"),
        ]
    )
    expected = reference.render_conversation_for_completion(theirs, oh.Role.ASSISTANT)
    assert o200k.render_conversation(ours) == expected


def test_recipient_after_channel_is_what_gpt_oss_writes(o200k):
    layout = Layout(recipient_after_channel=True)
    encoding = HarmonyEncoding(o200k.vocab, layout)
    messages = from_openai(CASES["tool_call_pending_result"][1], TOOLS, layout)
    text = encoding.render_conversation_text(messages)
    assert (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
    ) in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text


# ---------------------------------------------------------------- noesis-tiny: the trained template


def _corpus_examples():
    from noesis.tiny import corpus

    return [corpus.example(7, split, i) for split in ("train", "heldout") for i in range(60)]


def test_tiny_render_equals_its_training_template(tiny):
    from noesis.tiny import harmony as tiny_harmony

    backend = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    examples = _corpus_examples()
    assert {e.task for e in examples} >= {"calculator", "greeting", "recall", "lookup_country"}
    assert any(len(e.tools) == 0 for e in examples) and any(e.tool_result for e in examples)
    for example in examples:
        for messages, prompt in (
            (example.messages, False),
            (example.prompt_messages, True),
            (example.messages_before_final, True),
        ):
            text = tiny_harmony.render(messages, example.tools, add_generation_prompt=prompt)
            assert tiny.render_chat_text(messages, example.tools, for_completion=prompt) == text
            ids = tiny.render_chat(messages, example.tools, for_completion=prompt)
            assert ids == backend.encode(text, add_special_tokens=False).ids
            assert tiny.decode(ids) == text


def test_tiny_layout_stops_and_specials(tiny):
    assert tiny.stop_tokens_for_assistant_actions() == (7, 8)
    assert tiny.special.start == 2 and tiny.special.endoftext == 0


# ---------------------------------------------------------------- bad input


def test_tokenizer_without_harmony_tokens_is_rejected():
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    from tokenizers import decoders

    plain.decoder = decoders.ByteLevel()
    with pytest.raises(UnsupportedTokenizer, match="<\\|start\\|>"):
        HarmonyEncoding.from_tokenizer(plain)
    plain.decoder = decoders.WordPiece()
    with pytest.raises(UnsupportedTokenizer, match="byte-level"):
        HarmonyEncoding.from_tokenizer(plain)


@pytest.mark.parametrize(
    "messages, tools, problem",
    [
        ([{"role": "wizard", "content": "x"}], None, "unknown chat role"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, "first"),
        ([{"role": "tool", "content": "42"}], None, "tool_call_id"),
        ([{"content": "no role"}], None, "role"),
        ([{"role": "user", "content": 5}], None, "content"),
        ([{"role": "user", "content": "a"}], [{"type": "function", "function": {}}], "name"),
        ([{"role": "user", "content": "a"}], [{"type": "retrieval"}], "not supported"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], None, "name"),
    ],
)
def test_bad_chat_input_names_the_problem(tiny, messages, tools, problem):
    with pytest.raises(InvalidRequest, match=problem):
        tiny.render_chat(messages, tools)


def test_bad_config_names_the_problem(tiny):
    with pytest.raises(InvalidRequest, match="reasoning_effort"):
        SystemConfig(reasoning_effort="extreme")
    with pytest.raises(InvalidRequest, match="next_role"):
        tiny.render_conversation([Message("user", "hi")], next_role="robot")
    with pytest.raises(InvalidRequest, match="tool's name"):
        Message("tool", "42")
