"""Grounded tool arguments (`x-noesis-grounded`): spans of the user's words become an enum the
sampler enforces; schemas without the keyword, and the prompt the model reads, are unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from noesis.harmony import parse_completion
from noesis.structured import GrammarCompiler, GrammarError
from noesis.structured.grounding import (
    GROUNDED,
    MAX_CANDIDATES,
    MAX_SPAN_WORDS,
    candidate_spans,
    ground,
    source_texts,
    user_texts,
)
from noesis.structured.harmony_grammar import harmony_turn_grammar
from noesis.structured.matcher import GrammarSpec
from noesis.tiny import harmony, tools
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
NORWAY = "How many people live in Norway?"
GROUNDED_STRING = {"type": "string", "description": "A name", GROUNDED: True}
# Pinned from the code before grounding existed: the built-ins' prompt and a plain schema's turn
# grammar. A change here means what the bundled model reads (or how plain schemas decode) drifted.
SEVEN_TOOLS_PROMPT_SHA256 = "49022d39d55e9c73e1c83f9484f23aa66b89e96163a39677d43aef4406eb8616"
PLAIN_GRAMMAR_SHA256 = "011743a560046d143e5f4d1e0a7a2074a42c986ac31d3a189b2e4f5fb321b3ed"
PLAIN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "d",
            "parameters": {
                "type": "object",
                "properties": {
                    "country": {"type": "string", "minLength": 1},
                    "field": {"type": "string", "enum": ["capital", "population"]},
                },
                "required": ["country", "field"],
            },
        },
    }
]
LOOKUP_COUNTRY = {"type": "function", "function": {"name": "lookup_country"}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def sha256(value) -> str:
    data = value if isinstance(value, str) else json.dumps(value)
    return hashlib.sha256(data.encode()).hexdigest()


def strip_extension(schema):
    if isinstance(schema, dict):
        return {k: strip_extension(v) for k, v in schema.items() if not k.startswith("x-noesis-")}
    if isinstance(schema, list):
        return [strip_extension(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer, 8192)


# ---------------------------------------------------------------- the keyword


def test_a_grounded_string_becomes_an_enum_of_spans_and_their_case_forms():
    resolved = ground(GROUNDED_STRING, user_texts([user(NORWAY)]))
    assert set(resolved) == {"description", "enum"}  # no x-noesis-* key reaches llguidance
    values = resolved["enum"]
    assert {"Norway", "norway", "NORWAY", "live in Norway", "Live In Norway"} <= set(values)
    assert "Norway?" not in values and "Nor" not in values  # whole words, no edge punctuation
    assert "Norbrekland" not in values


def test_spans_keep_inner_punctuation_and_stop_at_max_words():
    spans = candidate_spans(["Make 'quiet,  please' uppercase; what's 3.5?"])
    assert "quiet,  please" in spans and "quiet please" not in spans  # inner text as written
    assert "what's" in spans and "What's" in spans and "3.5" in spans
    assert not any("<|" in span for span in candidate_spans(["say a <|end|> b"]))
    assert candidate_spans(["a" + "." * 300 + "b"]) == ["a", "A", "b", "B"]  # no 302-char span
    long_text = " ".join(f"w{i}" for i in range(20))
    longest = max((s for s in candidate_spans([long_text])), key=lambda s: len(s.split()))
    assert len(longest.split()) == MAX_SPAN_WORDS


def test_candidates_are_capped_latest_user_message_first():
    huge = " ".join(f"word{i}" for i in range(2000))
    texts = user_texts([user(huge), {"role": "assistant", "content": "Zanzibar"}, user("Peru")])
    assert texts == ["Peru", huge]  # only users' words, latest first
    spans = candidate_spans(texts)
    assert len(spans) == MAX_CANDIDATES and spans[0] == "Peru"
    assert "Zanzibar" not in spans


def test_prefer_narrows_to_named_table_entries_else_keeps_every_span():
    schema = {"type": "string", GROUNDED: {"prefer": ["Norway", "Peru"]}}
    named = ground(schema, [NORWAY])["enum"]
    assert {v.casefold() for v in named} == {"norway"}
    unnamed = ground(schema, ["What is the capital of Atlantis?"])["enum"]
    assert "Atlantis" in unnamed and "capital" in unnamed


def test_the_propertys_own_keywords_still_apply_and_no_words_means_plain_schema():
    schema = {"type": "string", "maxLength": 6, "pattern": "^[A-Z][a-z]", GROUNDED: True}
    expected = {"How", "Many", "People", "Live", "In", "Norway"}  # title forms of 1 word
    assert set(ground(schema, [NORWAY])["enum"]) == expected
    plain = {"type": "string", "minLength": 1}
    assert ground({**plain, GROUNDED: True}, []) == plain
    assert ground({**plain, GROUNDED: False}, [NORWAY]) == plain


def test_nested_properties_are_grounded_and_bad_keyword_values_are_errors():
    names = {"type": "array", "items": GROUNDED_STRING}
    schema = {"type": "object", "properties": {"items": names}}
    assert "Norway" in ground(schema, [NORWAY])["properties"]["items"]["items"]["enum"]
    with pytest.raises(GrammarError, match=GROUNDED):
        ground({"type": "string", GROUNDED: "yes"}, [NORWAY])
    with pytest.raises(GrammarError, match=GROUNDED):
        ground({"type": "string", GROUNDED: {"prefer": "Norway"}}, [NORWAY])


def test_the_grammar_only_accepts_a_country_named_in_the_request(compiler, tokenizer):
    spec = GrammarSpec.lark(
        harmony_turn_grammar(tools.schemas(["lookup_country"]), "required", None, [user(NORWAY)])
    )
    header = "<|channel|>commentary to=functions.lookup_country <|constrain|>json<|message|>"

    def accepts(country: str) -> bool:
        matcher = compiler.matcher(spec)
        body = json.dumps({"country": country, "field": "population"}, separators=(",", ":"))
        ids = tokenizer.encode(header + body + "<|call|>", add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and matcher.is_accepting()

    assert accepts("Norway") and accepts("norway")
    assert not accepts("Norbrekland") and not accepts("Dotapan") and not accepts("Sweden")


def test_a_second_call_may_copy_the_first_calls_result(compiler, tokenizer):
    """A chain: the capital a look-up returned goes to the string tool. Tool results are
    grounding sources as the user's words are (source_texts), and nothing else is."""
    asked = "How many letters are in the capital of Losbrethmark?"
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
            "function": {"name": "lookup_country", "arguments": "{}"}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "c0", "content": "Gircothburg"}
    messages = [user(asked), call, result]
    assert source_texts(messages) == ["Gircothburg", asked] and user_texts(messages) == [asked]
    spec = GrammarSpec.lark(
        harmony_turn_grammar(tools.schemas(["string_tool"]), "required", None, messages)
    )
    header = "<|channel|>commentary to=functions.string_tool <|constrain|>json<|message|>"

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(spec)
        body = json.dumps({"operation": "length", "text": text}, separators=(",", ":"))
        ids = tokenizer.encode(header + body + "<|call|>", add_special_tokens=False)
        return all(matcher.accept_token(i) for i in ids) and matcher.is_accepting()

    assert accepts("Gircothburg") and accepts("Losbrethmark")
    assert not accepts("Gircothberg")


# ---------------------------------------------------------------- nothing else changes


def test_schemas_without_the_keyword_give_todays_grammar_text():
    before = harmony_turn_grammar(PLAIN_TOOLS, "required")
    after = harmony_turn_grammar(PLAIN_TOOLS, "required", None, [user(NORWAY)])
    assert after == before and sha256(after) == PLAIN_GRAMMAR_SHA256
    schema = PLAIN_TOOLS[0]["function"]["parameters"]
    assert ground(schema, [NORWAY]) is schema


def test_the_built_in_declarations_render_as_before(tokenizer):
    from noesis.harmony.layout import FunctionTool, functions_namespace

    declared = tools.schemas(list(tools.TOOLS))
    assert len(declared) == 7 and any(GROUNDED in json.dumps(d) for d in declared)
    ids = tokenizer.encode_chat([user(NORWAY)], declared, True)
    assert sha256(ids) == SEVEN_TOOLS_PROMPT_SHA256
    stripped = strip_extension(declared)
    assert ids == tokenizer.encode_chat([user(NORWAY)], stripped, True)
    assert harmony.render([user(NORWAY)], declared) == harmony.render([user(NORWAY)], stripped)
    gpt_oss = [FunctionTool.from_openai(t) for t in declared]
    plain = [FunctionTool.from_openai(t) for t in stripped]
    assert functions_namespace(gpt_oss) == functions_namespace(plain)


# ---------------------------------------------------------------- sampling under the grammar


def forced_countries(llm, cases: list[tuple[float, int, bool, str]]) -> list[str]:
    """The country argument of each (temperature, seed, grounded, ask), generated in one batch
    (seeded requests sample what they would alone: test_invariance.py)."""
    from noesis.sampling.params import SamplingParams
    from noesis.turns import turn_params

    declared = tools.schemas(["lookup_country"])
    prompts, params = [], []
    for temperature, seed, grounded, ask in cases:
        messages = [user(ask)]
        base = SamplingParams(temperature=temperature, seed=seed, max_tokens=96)
        grounding = messages if grounded else None
        params.append(
            turn_params(base, llm.harmony, declared, LOOKUP_COUNTRY, None, messages=grounding)
        )
        prompts.append(llm.render_chat(messages, declared))
    countries = []
    for out in llm.generate(prompts, params):
        turn = parse_completion(llm.harmony, out.token_ids)
        assert turn.tool_calls and turn.messages[-1].stop == "call", out.text
        countries.append(json.loads(turn.tool_calls[0].arguments)["country"])
    return countries


def test_the_bundled_model_forced_to_pick_a_country_picks_one_from_the_request():
    from noesis.llm import LLM

    llm = LLM(str(MODEL_DIR), progress=False)
    # A garbled request: without the keyword the same sampling invents names ("Norweor",
    # "Norwegeria", ...); with it, only the user's words.
    garbled = "how many ppl live in the kingdom of norwey"
    cases = [(1.0, seed, True, NORWAY) for seed in range(4)] + [(0.0, 0, True, NORWAY)]
    cases += [(1.0, seed, False, garbled) for seed in range(4)]
    cases += [(1.0, seed, True, garbled) for seed in range(2)]
    countries = forced_countries(llm, cases)
    assert {c.casefold() for c in countries[:5]} == {"norway"}, countries[:5]
    invented = countries[5:9]
    assert any(c.casefold() not in garbled for c in invented), invented
    copied = countries[9:]
    assert all(c.casefold() in garbled for c in copied), copied


@pytest.fixture(scope="module")
def random_harmony_model(tmp_path_factory) -> Path:
    """Random weights over noesis-tiny's tokenizer and chat template: whatever it writes comes
    from the grammar, not from training."""
    from checkpoints import build_checkpoint

    out = tmp_path_factory.mktemp("random-harmony")
    build_checkpoint(
        out, vocab_size=8192, max_position_embeddings=1024, bos_token_id=1,
        eos_token_id=[7, 8, 0], std=0.02,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(MODEL_DIR / name, out / name)
    return out


def test_random_weights_forced_to_pick_a_country_copy_it_from_the_request(random_harmony_model):
    from noesis.llm import LLM
    from noesis.sampling.params import SamplingParams

    llm = LLM(str(random_harmony_model), progress=False)
    schema = tools.TOOLS["lookup_country"].parameters
    prompt = llm.render_chat([user(NORWAY)], tools.schemas(["lookup_country"]))
    prompt += llm.tokenizer.encode(
        "<|channel|>commentary to=functions.lookup_country <|constrain|>json<|message|>",
        add_special_tokens=False,
    )

    def sample(seed: int, resolved: dict) -> str:
        grammar = GrammarSpec.json_schema(resolved, compact=True)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48, grammar=grammar)
        (out,) = llm.generate([prompt], params)
        return out.text

    for seed in range(4):
        country = json.loads(sample(seed, ground(schema, [NORWAY])))["country"]
        assert country.casefold() == "norway", country
    # The same weights under the plain schema write names the request never had.
    written = [_country_written(sample(seed, strip_extension(schema))) for seed in range(4)]
    assert not any(country.casefold() in NORWAY.casefold() for country in written), written


def _country_written(text: str) -> str:
    """The country string's characters, complete or not, from `{"country":"...`."""
    head = '{"country":"'
    assert text.startswith(head), text
    return text[len(head) :].split('"')[0]


# ---------------------------------------------------------------- defaults


def test_chat_declares_all_seven_built_in_tools_for_the_bundled_model(monkeypatch, tokenizer):
    from noesis import chat, cli
    from noesis.harmony import HarmonyEncoding
    from noesis.sampling.params import SamplingParams

    seen = {}

    def reply(llm, history, tools, display, **options):
        seen.update(declared=tools.schemas(), options=options)

    monkeypatch.setattr(chat, "reply", reply)
    args = cli._parser().parse_args(["chat", "--model", str(MODEL_DIR)])
    harmony_encoding = HarmonyEncoding.from_tokenizer(tokenizer)
    llm = type("FakeLLM", (), {"tokenizer": tokenizer, "harmony": harmony_encoding})()
    cli._chat_reply(args, llm, SamplingParams(temperature=0.0))([], "Make 'quiet please' uppercase")
    names = [tool["function"]["name"] for tool in seen["declared"]]
    assert names == list(tools.DECLARATION_ORDER) and sorted(names) == sorted(tools.TOOLS)
    # Constrained and grounded (LLM.generate_turn's default): arguments copy the user's words.
    assert seen["options"]["constrained"] is True and "grounded" not in seen["options"]


def test_voice_declares_all_seven_built_in_tools_for_unrouted_questions():
    from noesis.voice.config import DEFAULTS

    catch_all = next(rule for rule in DEFAULTS["rules"] if rule["tasks"] == ["*"])
    assert catch_all["tools"] == list(tools.DECLARATION_ORDER)


def test_plain_turn_params_are_unchanged_without_the_conversation():
    from noesis.sampling.params import SamplingParams
    from noesis.turns import harmony_encoding, turn_params

    encoding = harmony_encoding(Tokenizer.from_dir(MODEL_DIR))
    declared = tools.schemas(list(tools.TOOLS))
    base = SamplingParams()
    without = turn_params(base, encoding, declared, "auto", None)
    assert without.grammar.source == harmony_turn_grammar(strip_extension(declared), "auto")
    grounded = turn_params(base, encoding, declared, "auto", None, messages=[user(NORWAY)])
    assert dataclasses.replace(grounded, grammar=without.grammar) == without
    assert grounded.grammar.source != without.grammar.source
