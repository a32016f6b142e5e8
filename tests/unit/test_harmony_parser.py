"""The streaming Harmony parser: well-formed output, every tolerated deviation, UTF-8 split across
tokens, random token streams that must never raise, and render -> parse round trips."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from noesis.harmony import (
    GPT_OSS,
    NOESIS_TINY,
    ContentDelta,
    HarmonyEncoding,
    HarmonyStreamParser,
    MessageEnd,
    MessageStart,
    ParseIssue,
    from_openai,
    parse_completion,
)

TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
SPECIAL = re.compile(r"(<\|[a-z_0-9]+\|>)")


@pytest.fixture(scope="module")
def tiny():
    return HarmonyEncoding.from_file(TINY_DIR, NOESIS_TINY)


@pytest.fixture(scope="module")
def o200k():
    pytest.importorskip("tiktoken")
    return HarmonyEncoding.o200k_harmony()


@pytest.fixture(params=["tiny", "o200k"])
def encoding(request):
    return request.getfixturevalue(request.param)


def ids(encoding, text):
    """Token ids of text in which `<|...|>` spellings are special tokens."""
    out = []
    for part in SPECIAL.split(text):
        special = encoding.vocab.special_id(part) if part else None
        out += [special] if special is not None else encoding.encode_text(part)
    return out


def events(encoding, text, role="assistant"):
    parser = HarmonyStreamParser(encoding, role)
    return [e for t in ids(encoding, text) for e in parser.feed(t)] + parser.finish()


def parse(encoding, text, role="assistant"):
    return parse_completion(encoding, ids(encoding, text), role)


# ---------------------------------------------------------------- well-formed output


def test_events_of_a_well_formed_turn(encoding):
    text = (
        "<|channel|>analysis<|message|>Think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    )
    got = events(encoding, text)
    starts = [e for e in got if isinstance(e, MessageStart)]
    assert starts == [
        MessageStart("assistant", "analysis", None, None),
        MessageStart("assistant", "final", None, None),
    ]
    assert [e.stop for e in got if isinstance(e, MessageEnd)] == ["end", "return"]
    deltas = [e for e in got if isinstance(e, ContentDelta)]
    assert "".join(d.text for d in deltas if d.channel == "analysis") == "Think."
    assert "".join(d.text for d in deltas if d.channel == "final") == "Done."
    assert not [e for e in got if isinstance(e, ParseIssue)]


def test_tool_call(encoding):
    turn = parse(
        encoding,
        "<|channel|>analysis<|message|>Need the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json"
        '<|message|>{"country":"Chile"}<|call|>',
    )
    assert turn.analysis == "Need the tool."
    [call] = turn.tool_calls
    assert (call.name, call.recipient, call.channel) == ("lookup", "functions.lookup", "commentary")
    assert (call.arguments, call.content_type) == ('{"country":"Chile"}', "json")
    assert turn.final is None and not turn.issues
    assert turn.messages[-1].stop == "call"


# ---------------------------------------------------------------- tolerated deviations


def test_tool_call_on_the_analysis_channel(encoding):
    turn = parse(
        encoding, "<|channel|>analysis to=functions.calc <|constrain|>json<|message|>{}<|call|>"
    )
    [call] = turn.tool_calls
    assert (call.name, call.channel, call.arguments) == ("calc", "analysis", "{}")
    assert turn.analysis == "" and not turn.issues


@pytest.mark.parametrize(
    "header, channel, recipient",
    [
        ("<|channel|>final json", "final", None),
        ("<|channel|>commentary to=functions.calc json", "commentary", "functions.calc"),
        ("<|channel|>commentary json to=functions.calc", "commentary", "functions.calc"),
    ],
)
def test_content_type_without_constrain(encoding, header, channel, recipient):
    turn = parse(encoding, f'{header}<|message|>{{"x": 1}}<|call|>')
    [message] = turn.messages
    assert (message.channel, message.recipient, message.content_type) == (
        channel,
        recipient,
        "json",
    )
    assert message.content == '{"x": 1}' and not turn.issues


@pytest.mark.parametrize(
    "header",
    [
        "<|channel|>commentary to=functions.calc <|constrain|>json",
        " to=functions.calc<|channel|>commentary <|constrain|>json",
        " to=functions.calc<|channel|>commentary<|constrain|>json",
    ],
)
def test_channel_and_recipient_in_either_order(encoding, header):
    turn = parse(encoding, f"{header}<|message|>{{}}<|call|>")
    [call] = turn.tool_calls
    assert (call.name, call.channel, call.content_type) == ("calc", "commentary", "json")
    assert not turn.issues


def test_stray_return_after_end(encoding):
    turn = parse(encoding, "<|channel|>final<|message|>Hi.<|end|><|return|>")
    assert turn.final == "Hi." and not turn.issues
    # A stop that follows no message's end is reported.
    turn = parse(encoding, "<|return|>", role=None)
    assert [i.raw for i in turn.issues] == ["<|return|>"]


def test_first_header_already_in_the_prompt_or_repeated(encoding):
    body = "<|channel|>final<|message|>Hi.<|return|>"
    for text, role in [
        (body, "assistant"),  # the prompt ended in <|start|>assistant
        ("<|start|>assistant" + body, "assistant"),  # ... and the model wrote it again
        ("assistant" + body, "assistant"),  # ... or repeated just the role
        ("<|start|>assistant" + body, None),  # the parser starts outside any message
    ]:
        turn = parse(encoding, text, role)
        assert turn.final == "Hi." and not turn.issues, text
        assert turn.messages[0].role == "assistant"


def test_text_outside_any_message(encoding):
    turn = parse(
        encoding,
        "<|channel|>final<|message|>A<|end|> stray words <|start|>assistant<|channel|>final"
        "<|message|>B<|return|>trailing",
    )
    assert turn.final == "B"
    assert [i.raw for i in turn.issues] == [" stray words ", "trailing"]
    assert all(i.message == "text outside any message" for i in turn.issues)
    # whitespace between messages is not an issue
    assert not parse(encoding, "<|channel|>final<|message|>A<|end|>\n").issues


def test_end_of_sequence_inside_a_message(encoding):
    got = events(encoding, "<|channel|>final<|message|>Partial answ<|endoftext|>")
    assert got[-1] == MessageEnd("eos")
    turn = parse(encoding, "<|channel|>final<|message|>Partial answ<|endoftext|>")
    assert turn.final == "Partial answ" and turn.messages[0].stop == "eos"
    turn = parse(encoding, "<|channel|>final<|message|>Cut")  # the length limit hit
    assert turn.final == "Cut" and turn.messages[0].stop == "truncated"


def test_header_without_start(encoding):
    turn = parse(
        encoding,
        "<|channel|>analysis<|message|>a<|end|>assistant<|channel|>final<|message|>B<|return|>",
    )
    assert turn.final == "B"
    assert [i.message for i in turn.issues] == ["message header without <|start|>"]


def test_malformed_headers_become_issues(encoding):
    turn = parse(
        encoding, "<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>"
    )
    assert turn.final == "ok"
    assert turn.issues[0].message.startswith("message header closed by <|end|>")
    assert turn.issues[0].raw == "<|channel|>final"
    turn = parse(encoding, "<|channel|>final bogus words<|message|>x<|return|>")
    assert turn.final == "x" and turn.issues[0].raw == "<|channel|>final bogus words"
    turn = parse(encoding, "<|channel|><|message|>x<|return|>")
    assert turn.messages[0].channel is None and "empty channel" in turn.issues[0].message
    turn = parse(
        encoding,
        "<|start|>assistant<|channel|>ana<|start|>assistant<|channel|>final<|message|>y<|return|>",
        None,
    )
    assert turn.final == "y" and turn.issues[0].raw == "assistant<|channel|>ana"
    turn = parse(encoding, "<|channel|>final<|message|>z", None)
    assert turn.issues[0].message == "message header without <|start|>"


def test_special_tokens_inside_content_are_issues(encoding):
    turn = parse(encoding, "<|channel|>final<|message|>a<|channel|>b<|startoftext|>c<|return|>")
    assert turn.final == "abc"
    assert [i.raw for i in turn.issues] == ["<|channel|>", "<|startoftext|>"]
    turn = parse(
        encoding,
        "<|channel|>final<|message|>a<|start|>assistant<|channel|>final<|message|>b<|return|>",
    )
    assert [m.stop for m in turn.messages] == ["truncated", "return"]
    assert "not closed" in turn.issues[0].message


def test_unknown_token_ids_are_issues(encoding):
    parser = HarmonyStreamParser(encoding)
    for bad in (-1, encoding.vocab.size, 10**12):
        [issue] = parser.feed(bad)
        assert isinstance(issue, ParseIssue) and issue.raw == str(bad)


# ---------------------------------------------------------------- UTF-8


def test_characters_split_across_tokens_are_emitted_whole(encoding):
    text = "Grüße 🌍🚀 東京 — café ñ"
    tokens = ids(encoding, "<|channel|>final<|message|>" + text + "<|return|>")
    split = [t for t in tokens if _invalid_utf8(encoding.vocab.token_bytes(t))]
    assert split, "no token splits a character; the test would prove nothing"
    parser = HarmonyStreamParser(encoding)
    deltas = [e.text for t in tokens for e in parser.feed(t) if isinstance(e, ContentDelta)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_invalid_utf8_becomes_replacement_characters(encoding):
    orphan = next(
        t for t in range(encoding.vocab.size) if _invalid_utf8(encoding.vocab.token_bytes(t))
    )
    tokens = ids(encoding, "<|channel|>final<|message|>a") + [orphan, orphan]
    tokens += ids(encoding, "b<|return|>")
    turn = parse_completion(encoding, tokens)
    assert turn.final.startswith("a") and turn.final.endswith("b") and "\ufffd" in turn.final


def _invalid_utf8(data):
    if data is None:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# ---------------------------------------------------------------- fuzz


@pytest.mark.parametrize("seed", range(4))
def test_random_token_streams_never_raise(encoding, seed):
    rng = random.Random(seed)
    special = encoding.special
    structural = [
        special.start,
        special.end,
        special.message,
        special.channel,
        special.constrain,
        special.return_,
        special.call,
        special.endoftext,
    ]
    words = ids(encoding, "assistant final analysis commentary to=functions.x json user 🌍")
    for _ in range(150):
        pool = rng.choice([structural + words, list(range(-3, encoding.vocab.size + 3))])
        tokens = [
            rng.choice(pool) if rng.random() < 0.7 else rng.randrange(-5, encoding.vocab.size + 5)
            for _ in range(rng.randrange(0, 80))
        ]
        parser = HarmonyStreamParser(encoding, rng.choice(["assistant", None]))
        stream = [e for t in tokens for e in parser.feed(t)] + parser.finish()
        _check_well_nested(stream)


def _check_well_nested(stream):
    open_message = False
    for event in stream:
        if isinstance(event, MessageStart):
            assert not open_message
            open_message = True
        elif isinstance(event, ContentDelta):
            assert open_message and event.text
        elif isinstance(event, MessageEnd):
            assert open_message
            open_message = False
        else:
            assert isinstance(event, ParseIssue) and isinstance(event.raw, str)
    assert not open_message


# ---------------------------------------------------------------- round trips


def _corpus(count=40):
    from noesis.tiny import corpus

    return [corpus.example(11, split, i) for split in ("train", "heldout") for i in range(count)]


@pytest.mark.parametrize("layout_name", ["tiny", "o200k"])
def test_render_then_parse_round_trip(request, layout_name):
    encoding = request.getfixturevalue(layout_name)
    for example in _corpus():
        harmony = from_openai(example.messages, example.tools, encoding.layout)
        turn = parse_completion(encoding, encoding.render_conversation(harmony, False), role=None)
        assert not turn.issues
        kept = harmony if encoding.layout is NOESIS_TINY else _gpt_oss_kept(harmony)
        assert len(turn.messages) == len(kept)
        for parsed, message in zip(turn.messages, kept, strict=True):
            assert parsed.role == (message.name or message.role)
            assert (parsed.channel, parsed.recipient) == (message.channel, message.recipient)
            assert parsed.content == message.content
            expected_type = (
                message.content_type.removeprefix("<|constrain|>") if message.content_type else None
            )
            assert parsed.content_type == expected_type
        assert turn.messages[-1].stop == "return" and turn.final == example.final_answer


def _gpt_oss_kept(harmony):
    from noesis.harmony.render import _drop_past_analysis

    assert GPT_OSS.drop_past_analysis
    return _drop_past_analysis(harmony)


def test_completion_round_trip_recovers_the_turn(tiny):
    """What the model is trained to write after the prompt parses back into the example's
    analysis, tool call and final answer."""
    for example in _corpus(30):
        prompt = tiny.render_chat(example.prompt_messages, example.tools)
        full = tiny.render_chat(example.messages, example.tools, for_completion=False)
        assert full[: len(prompt)] == prompt
        turn = parse_completion(tiny, full[len(prompt) :])
        assert not turn.issues and turn.final == example.final_answer
        assistant = example.messages[len(example.prompt_messages)]
        assert turn.analysis.startswith(assistant.get("thinking") or "")
        if example.expected_tool:
            [call] = turn.tool_calls
            assert call.name == example.expected_tool
            assert json.loads(call.arguments) == example.expected_arguments
        else:
            assert turn.tool_calls == []


@pytest.mark.slow
def test_bundled_model_output_parses(tiny):
    """Render with this module, generate greedily with noesis-tiny, parse: a clean turn each."""
    from noesis import LLM
    from noesis.sampling.params import SamplingParams
    from noesis.tiny import corpus

    llm = LLM(str(TINY_DIR), device="cpu")
    examples = [corpus.example(0, "heldout", i) for i in range(4)]
    prompts = [tiny.render_chat(e.prompt_messages, e.tools) for e in examples]
    params = SamplingParams(max_tokens=120, temperature=0.0, skip_special_tokens=False)
    for example, output in zip(examples, llm.generate(prompts, params), strict=True):
        turn = parse_completion(tiny, output.token_ids)
        assert not turn.issues
        assert turn.final is not None or [c.name for c in turn.tool_calls] == [
            example.expected_tool
        ]
