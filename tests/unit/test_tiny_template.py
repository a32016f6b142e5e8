"""The noesis-tiny chat template renders exactly what harmony.render writes, in gpt-oss's layout."""

import json
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.tiny import corpus, harmony
from noesis.tiny.template import CHAT_TEMPLATE
from noesis.tiny.tools import schemas

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"

EXPECTED = (
    "<|start|>system<|message|>" + harmony.SYSTEM_PROMPT + harmony.TOOLS_NOTE + "<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n"
    "// Evaluates an arithmetic expression with + - * / % ** and parentheses.\n"
    "type calculator = (_: {\n// The expression, e.g. (2+3)*4\nexpression: string,\n}) => any;\n\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>What is 17*23?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Use the calculator.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
    '<|message|>{"expression":"17*23"}<|call|>'
    "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>391<|end|>"
    "<|start|>assistant<|channel|>final<|message|>17*23 = 391.<|return|>"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 17*23?"},
    corpus.tool_call_message("Use the calculator.", "calculator", {"expression": "17*23"}),
    {"role": "tool", "tool_call_id": "call_0", "content": "391"},
    {"role": "assistant", "content": "17*23 = 391."},
]


def _raise(message: str) -> None:
    raise ValueError(message)


def _environments() -> list[jinja2.Environment]:
    plain = jinja2.Environment()
    hf_like = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    for env in (plain, hf_like):
        env.filters["tojson"] = lambda value, **_: json.dumps(value, separators=(",", ":"))
    return [plain, hf_like]


_COMPILED: dict[int, jinja2.Template] = {}


def _render(env: jinja2.Environment, messages, tools, add_generation_prompt: bool) -> str:
    if id(env) not in _COMPILED:
        _COMPILED[id(env)] = env.from_string(CHAT_TEMPLATE)
    return _COMPILED[id(env)].render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        raise_exception=_raise,
        strftime_now=lambda fmt: "2025-01-01",
    )


def test_reference_renderer_writes_the_gpt_oss_layout():
    assert harmony.render(MESSAGES, schemas(["calculator"])) == EXPECTED


@pytest.mark.parametrize("env", _environments(), ids=["plain", "sandbox-trim"])
def test_template_matches_the_reference_on_the_corpus(env):
    examples = corpus.generate(4, "train", 300) + corpus.generate(4, "heldout", 100)
    for example in examples:
        for messages, prompt in (
            (example.messages, False),
            (example.prompt_messages, True),
            (example.messages_before_final, True),
        ):
            expected = harmony.render(messages, example.tools, prompt)
            assert _render(env, messages, example.tools, prompt) == expected


@pytest.mark.parametrize("env", _environments(), ids=["plain", "sandbox-trim"])
def test_template_edge_cases(env):
    assert _render(env, MESSAGES, schemas(["calculator"]), False) == EXPECTED
    no_tools = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _render(env, no_tools, None, True) == harmony.render(no_tools, None, True)
    assert "<|start|>developer" not in _render(env, no_tools, [], True)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = _render(env, history, None, True)
    assert "Hello!<|end|>" in rendered and rendered.endswith("<|start|>assistant")
    odd_tool = {"type": "function", "function": {"name": "ping", "description": "Ping."}}
    typed = {
        "name": "t",
        "parameters": {
            "type": "object",
            "properties": {
                "xs": {"type": "array", "items": {"type": "integer"}},
                "d": {"default": 3},
            },
        },
    }
    assert _render(env, history, [odd_tool, typed], True) == harmony.render(
        history, [odd_tool, typed], True
    )
    with pytest.raises(ValueError, match="unexpected"):
        _render(env, [*history, {"role": "system", "content": "late"}], None, False)


def test_parse_completion_reads_channels_and_call():
    prompt = harmony.render(MESSAGES[:2], schemas(["calculator"]), add_generation_prompt=True)
    completion = EXPECTED[len(prompt) :].split("<|start|>functions")[0]
    encoding = HarmonyEncoding.from_file(MODEL_DIR, NOESIS_TINY)  # the one Harmony parser
    parsed = parse_text(encoding, completion)
    assert parsed.analysis == "Use the calculator."
    [call] = parsed.tool_calls
    assert call.recipient == "functions.calculator" and call.content_type == "json"
    assert call.arguments == '{"expression":"17*23"}' and parsed.messages[-1].stop == "call"
    final = parse_text(encoding, "<|channel|>final<|message|>17*23 = 391.<|return|>")
    assert final.final == "17*23 = 391." and final.tool_calls == []
    truncated = parse_text(encoding, "<|channel|>analysis<|message|>thinking")
    assert truncated.messages[0].stop == "truncated" and truncated.final is None
