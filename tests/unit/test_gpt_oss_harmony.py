"""gpt-oss end to end in Harmony on a tiny random checkpoint with the real o200k_harmony
vocabulary (tokenizer.json built offline by noesis.harmony.tokenizer_file): the tokenizer encodes
as tiktoken does, prompts render to openai-harmony's ids, turns with tools come back as Harmony
tool calls, and the server returns them through the official client.

A 200k-token vocabulary costs ~20 s to set up (the tokenizer built, a 12 MB tokenizer.json read)
and ~15 s more for llguidance's view of it: those tests are marked slow (`pytest -m slow
tests/unit/test_gpt_oss_harmony.py`). The CI tier checks the rendering switch on the bundled
tokenizer, which has Harmony's tokens in a small vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import build_gpt_oss_o200k

from noesis import LLM, SamplingParams
from noesis.harmony import GPT_OSS, vocab
from noesis.harmony.tokenizer_file import VOCAB_SIZE, is_o200k_harmony

oh = pytest.importorskip("openai_harmony")
TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? <|end|> stays text"},
    {
        "role": "assistant",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "18 C, clear"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_gpt_oss_o200k(tmp_path_factory.mktemp("gpt-oss-o200k"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(vocab.ENCODINGS_DIR_VAR, raising=False)
        vocab.prepare_offline(tmp_path_factory.mktemp("encodings"))
        yield oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def test_harmony_rendering_replaces_the_template():
    """What loading does for gpt-oss, on the bundled tokenizer: encode_chat and
    apply_chat_template render through noesis.harmony (gpt-oss's layout), the reasoning effort
    comes from the template kwargs, and a --chat-template override wins again."""
    from noesis.harmony import HarmonyEncoding
    from noesis.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY_DIR)
    assert not is_o200k_harmony(tokenizer.backend)
    encoding = HarmonyEncoding.from_tokenizer(tokenizer, GPT_OSS)
    templated = tokenizer.encode_chat(CONVERSATION, TOOLS)
    tokenizer.render_with_harmony(encoding)
    ids = tokenizer.encode_chat(CONVERSATION, TOOLS)
    assert ids == encoding.render_chat(CONVERSATION, TOOLS) != templated
    text = tokenizer.apply_chat_template(CONVERSATION[:2], reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: low" in text
    assert HarmonyEncoding.from_tokenizer(tokenizer).vocab is encoding.vocab  # shared, not rebuilt
    tokenizer.set_chat_template(tokenizer.chat_template or "{{ messages[0]['content'] }}")
    assert tokenizer.encode_chat(CONVERSATION, TOOLS) == templated


@pytest.mark.slow
def test_the_tokenizer_encodes_as_tiktoken(llm):
    tiktoken = vocab.o200k_harmony()
    backend = llm.tokenizer.backend
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert is_o200k_harmony(backend)
    for text in (
        "Hello world! It's 2026; ünïcödé café, 日本語 🙂\n\n\tindented   spaces",
        "def f(x):\n    return x**2  # I'M SHOUTING, don't they'll",
        " 1234567 3.14159 ++-- ... <|start|>assistant<|channel|>final",
    ):
        ours = llm.tokenizer.encode(text, add_special_tokens=False)
        assert ours == tiktoken.encode(text, allowed_special="all"), text
        assert llm.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.slow
def test_prompt_ids_equal_openai_harmony(llm, reference):
    """The chat path (encode_chat, what `noesis chat` and the server use) renders a conversation
    with instructions, tools, reasoning, a call and its result as openai-harmony does; a
    control-token spelling in a message stays text."""
    ids = llm.render_chat(CONVERSATION, TOOLS)
    developer = (
        oh.DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools(
            [
                oh.ToolDescription.new(
                    "get_weather", "Weather in a city", TOOLS[0]["function"]["parameters"]
                )
            ]
        )
    )
    tool = oh.Author.new(oh.Role.TOOL, "functions.get_weather")
    conversation = oh.Conversation.from_messages(
        [
            oh.Message.from_role_and_content(oh.Role.SYSTEM, _system(GPT_OSS.system)),
            oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer),
            oh.Message.from_role_and_content(oh.Role.USER, CONVERSATION[1]["content"]),
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Need the tool.").with_channel(
                "analysis"
            ),
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"city":"Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            oh.Message.from_author_and_content(tool, "18 C, clear")
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    expected = reference.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    assert ids == expected, reference.decode_utf8(expected)
    effort = llm.render_chat(CONVERSATION[:2], reasoning_effort="high")
    assert "Reasoning: high" in llm.tokenizer.decode(effort, skip_special_tokens=False)


def _system(config):
    return oh.SystemContent(
        model_identity=config.model_identity,
        knowledge_cutoff=config.knowledge_cutoff,
        conversation_start_date=config.current_date,
        reasoning_effort=oh.ReasoningEffort.MEDIUM,
        channel_config=oh.ChannelConfig(
            valid_channels=list(config.valid_channels), channel_required=True
        ),
    )


@pytest.mark.slow
def test_turn_format_is_harmony(llm):
    assert llm.turn_format.name == "harmony" and llm.harmony is not None
    assert llm.harmony.special.call == vocab.NAMED_SPECIAL_TOKENS["<|call|>"]


@pytest.mark.slow
def test_tool_call_turn(llm):
    turn = llm.generate_turn(
        [{"role": "user", "content": "Weather in Paris?"}],
        TOOLS,
        tool_choice="required",
        params=SamplingParams(temperature=0, max_tokens=24),
    )
    assert [call.name for call in turn.tool_calls] == ["get_weather"]
    assert turn.tool_calls[0].arguments.startswith('{"city":"')
