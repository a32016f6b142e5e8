"""The tool-use eval harness (noesis.tiny.harness): parity of the bundled pair with transformers,
the metrics on scripted outputs, the draft agreement algorithm, and a small real run."""

import dataclasses
import functools
import hashlib
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from noesis import LLM, SamplingParams
from noesis.cli import main
from noesis.errors import InvalidRequest
from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.session import AssistantTurn, ToolCall
from noesis.tiny import corpus, evaluate, harmony, harness, natural

MODELS = Path(__file__).resolve().parents[2] / "models"
PAIR = {"target": MODELS / "noesis-tiny", "draft": MODELS / "noesis-tiny-draft"}
needs_models = pytest.mark.skipif(
    not all(p.is_dir() for p in PAIR.values()), reason="models/noesis-tiny* not present"
)


@pytest.fixture(scope="module")
def bundled() -> dict[str, LLM]:
    return {
        name: LLM(str(path), device="cpu", dtype="float32", progress=False)
        for name, path in PAIR.items()
    }


# ---------------------------------------------------------------- parity with transformers


@needs_models
@pytest.mark.parametrize("name", ["target", "draft"])
def test_greedy_tokens_match_transformers(bundled, name):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(PAIR[name], dtype=torch.float32).eval()
    llm = bundled[name]
    examples = corpus.generate(1234, "heldout", 40)
    picked = [next(e for e in examples if e.expected_tool == tool) for tool in ("calculator", None)]
    picked.append(next(e for e in examples if e.task == "lookup_country"))
    prompts = [llm.render_chat(e.prompt_messages, e.tools) for e in picked]
    prompts.append(llm.render_chat(picked[0].messages_before_final, picked[0].tools))
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False
            )[0, len(prompt) :].tolist()
        assert out.token_ids == expected


# ---------------------------------------------------------------- metrics on scripted outputs


class ScriptedLLM:
    """Stands in for an LLM as the runs' TurnGenerator: renders each request with harmony.render,
    answers with `respond(prompt text)`, read by the one parser; n characters count as n tokens."""

    def __init__(self, respond):
        self.respond = respond
        self.batches: list[int] = []
        self.requests = []

    def generate_turns(self, requests, cancel):
        self.batches.append(len(requests))
        self.requests += requests
        return [self._turn(r) for r in requests]

    def _turn(self, request):
        assert request.options["params"].greedy
        prompt = harmony.render(request.messages, request.tools, True)
        text = self.respond(prompt)
        parsed = parse_text(_encoding(), text)
        calls = [ToolCall(f"c{i}", c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
        ids = [0] * len(text)
        return AssistantTurn(parsed.analysis, calls, parsed.final, 1, len(ids), "stop", [1], ids)


@functools.cache
def _encoding() -> HarmonyEncoding:
    return HarmonyEncoding.from_file(PAIR["target"], NOESIS_TINY)


TOOL_RESULT = "to=assistant<|channel|>commentary"


def _reference_turn(example: corpus.Example, prompt: str) -> str:
    """What a perfect model writes next: the corpus conversation, up to its next call or return."""
    full = example.text()
    assert full.startswith(prompt)
    rest = full[len(prompt) :]
    end = min(i + len(t) for t in (harmony.CALL, harmony.RETURN) if (i := rest.find(t)) != -1)
    return rest[:end]


def _picked():
    examples = corpus.generate(9, "heldout", 200)
    perfect = next(e for e in examples if e.expected_tool == "calculator")
    broken = next(e for e in examples if e.expected_tool == "lookup_country")
    no_tool = next(e for e in examples if e.task == "recall" and e.tools)
    return perfect, broken, no_tool


def test_metrics_on_scripted_outputs():
    picked = perfect, broken, no_tool = _picked()
    wrong_tool = no_tool.tools[0]["function"]["name"]
    call_header = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    refusal = "<|channel|>final<|message|>I could not look that up.<|return|>"

    def respond(prompt: str) -> str:
        example = next(e for e in picked if e.prompt_messages[-1]["content"] in prompt)
        after_result = prompt.rfind(TOOL_RESULT) > prompt.rfind("<|start|>user")
        if example is perfect:
            return _reference_turn(example, prompt)
        if example is broken and not after_result:
            return call_header.format("lookup_country") + '{"country": <|call|>'
        if example is broken:  # pass 2 gets the real result, pass 3 an error from the bad call
            if example.tool_result in prompt:
                return _reference_turn(example, prompt)
            assert "error: arguments are not valid JSON" in prompt
            return refusal
        if not after_result:
            return call_header.format(wrong_tool) + "{}<|call|>"
        return f"<|channel|>final<|message|>So: {example.expected_answer}.<|return|>"

    llm = ScriptedLLM(respond)
    config = harness.EvalConfig()
    result = harness.run(llm, list(picked), config, None)
    summary = result.summary
    assert llm.batches == [3, 5]  # pass 1; then passes 2 and 3 together (2 supplied, 3 own)
    assert summary["examples"] == 3
    assert summary["tool_selection_accuracy"] == pytest.approx(2 / 3)
    assert summary["call_json_rate"] == pytest.approx(2 / 3)  # the broken call is not JSON
    assert summary["call_validity"] == pytest.approx(1 / 3)  # {} lacks required arguments
    assert summary["call_arguments_correct"] == pytest.approx(1 / 3)
    assert summary["final_answer_accuracy"] == pytest.approx(2 / 3)  # no_tool never answered
    assert summary["end_to_end_accuracy"] == pytest.approx(2 / 3)  # broken's error answer
    calls = [s.call.called for s in result.scores]
    assert calls == ["calculator", "lookup_country", wrong_tool]
    first = [respond(harmony.render(e.prompt_messages, e.tools, True)) for e in _picked()]
    tokens = [s.tokens_to_answer for s in result.scores]
    assert tokens[1] == len(first[1]) + len(refusal)
    assert all(t > len(f) for t, f in zip(tokens, first, strict=True))
    assert summary["mean_tokens_to_answer"] == pytest.approx(sum(tokens) / 3)
    assert len(result.continuations) == 3 + 2  # every first turn, and each supplied final


def test_decoding_hooks_wrap_the_generator_and_unknown_ones_are_refused(monkeypatch):
    llm = ScriptedLLM(lambda prompt: "<|channel|>final<|message|>ok<|return|>")
    refused = r"unknown constraint 'json' \(available: harmony, grounded\)"
    with pytest.raises(InvalidRequest, match=refused):
        harness.evaluate_tools(llm, harness.EvalConfig(n=1, constraint="json"))
    with pytest.raises(InvalidRequest, match=r"unknown controller 'entropy'"):
        harness.turn_generator(llm, controller="entropy")
    seen = []

    class Upper:
        def __init__(self, inner):
            self.inner = inner

        def generate_turns(self, requests, cancel):
            seen.append(len(requests))
            turns = self.inner.generate_turns(requests, cancel)
            return [dataclasses.replace(t, final=t.final.replace("ok", "OK")) for t in turns]

    monkeypatch.setitem(harness.CONTROLLERS, "upper", Upper)
    report = harness.evaluate_tools(llm, harness.EvalConfig(n=2, controller="upper"))
    assert seen == [2, 2] and report["controller"] == "upper" and report["constraint"] is None


def test_the_harmony_constraint_is_the_plain_schema_turn_grammar():
    """Every request runs constrained to a well-formed turn over the example's declared tools,
    ungrounded (the figures so far were measured so); unconstrained by default."""
    llm = ScriptedLLM(lambda prompt: "<|channel|>final<|message|>ok<|return|>")
    harness.evaluate_tools(llm, harness.EvalConfig(n=3, constraint="harmony"))
    examples = corpus.generate(1234, "heldout", 3)
    assert {r.options["constrained"] for r in llm.requests} == {True}
    assert {r.options["grounded"] for r in llm.requests} == {False}
    assert [r.tools for r in llm.requests[:3]] == [e.tools or None for e in examples]
    harness.evaluate_tools(llm, harness.EvalConfig(n=1))
    assert llm.requests[-1].options["constrained"] is False


def test_sampled_requests_get_stable_distinct_seeds():
    seeds = {harness.request_seed(0, f"heldout-1234-{i}", s) for i in range(50) for s in "ab"}
    assert len(seeds) == 100
    assert harness.request_seed(0, "x", "first") == harness.request_seed(0, "x", "first")
    assert harness.request_seed(1, "x", "first") != harness.request_seed(0, "x", "first")


# ---------------------------------------------------------------- draft agreement


class TableDraft:
    """A draft that predicts the target's token except at `misses` on the target's path (and
    something arbitrary off it), generating greedily like the engine."""

    def __init__(self, prompt_len: int, target: list[int], misses: set[int]):
        self.prompt_len, self.target, self.misses = prompt_len, target, misses
        self.rounds = 0

    def next_token(self, ids: list[int]) -> int:
        i = len(ids) - self.prompt_len
        if ids[self.prompt_len :] != self.target[:i] or i >= len(self.target):
            return 999  # off the target's path
        return self.target[i] + (1 if i in self.misses else 0)

    def generate(self, prompts, params):
        self.rounds += 1
        outs = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = list(prompt)
            for _ in range(p.max_tokens):
                ids.append(self.next_token(ids))
            outs.append(SimpleNamespace(token_ids=ids[len(prompt) :]))
        return outs


@pytest.mark.parametrize("misses", [set(), {0}, {5, 6, 7}, {3, 19}, set(range(20))])
def test_draft_agreement_equals_teacher_forced_count(misses):
    rng = random.Random(len(misses))
    prompt, target = [1, 2, 3], [rng.randrange(100) for _ in range(20)]
    draft = TableDraft(len(prompt), target, misses)
    assert harness.draft_agreement(draft, [(prompt, target), (prompt[:1], [])]) == (
        20 - len(misses),
        20,
    )
    assert draft.rounds == 1 + len(misses - {19})  # a miss at the last token needs no restart


# ---------------------------------------------------------------- real runs


@needs_models
def test_harness_on_the_bundled_pair(bundled):
    # One conversation: the summaries' arithmetic over several is test_metrics_on_scripted_outputs'
    config = harness.EvalConfig(n=1, sampled=SamplingParams(temperature=0.7), seed=3)
    report = harness.evaluate_tools(bundled["target"], config, bundled["draft"])
    assert list(report["runs"]) == ["greedy", "t=0.7 seed=3"]
    for label, summary in report["runs"].items():
        [score] = report["scores"][label]
        assert summary["tool_selection_accuracy"] == float(score["call"]["selection_correct"])
        for key in ("tool_selection_accuracy", "final_answer_accuracy", "end_to_end_accuracy"):
            assert 0.0 <= summary[key] <= 1.0
        assert summary["mean_tokens_to_answer"] > 10
    agreement = report["draft_greedy_agreement"]
    assert 0 < agreement["agreed_tokens"] <= agreement["target_tokens"]
    assert agreement["rate"] == agreement["agreed_tokens"] / agreement["target_tokens"]
    assert set(report["definitions"]) >= {"draft_greedy_agreement", "call_validity"}
    examples = corpus.generate(config.corpus_seed, config.split, config.n)
    llm = bundled["target"]
    again = harness.run(llm, examples, config, config.sampled)
    assert evaluate.to_json(again.scores) == report["scores"]["t=0.7 seed=3"]  # seeded
    assert not llm.engine.has_unfinished()


@needs_models
def test_eval_tools_command(tmp_path, capsys):
    path = tmp_path / "eval.json"
    argv = ["eval", "tools", "--device", "cpu", "--n", "1", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tool-selection accuracy" in out and "Definitions:" in out
    report = json.loads(path.read_text())
    assert report["command"] == "noesis " + " ".join(argv)
    assert report["model"].endswith("noesis-tiny") and report["dtype"] == "float32"
    assert report["examples"] == 1 and list(report["runs"]) == ["greedy"]


# ---------------------------------------------------------------- golden outcomes

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "tiny_eval_golden.json"


@needs_models
def test_the_eval_through_the_session_keeps_the_recorded_outcomes(bundled):
    """Per item, the generated turns, scores and end-to-end outcome equal those the harness gave
    before it ran through the Session (recorded in tests/data, see its provenance)."""
    golden = json.loads(GOLDEN.read_text())
    digest = hashlib.sha256((PAIR["target"] / "model.safetensors").read_bytes()).hexdigest()
    assert digest == golden["model_sha256"], (
        "the bundled model changed since the golden outcomes were recorded: re-record them with "
        "scripts/tiny/record_eval_golden.py (only after retraining)"
    )
    fields = {f.name for f in dataclasses.fields(natural.NaturalExample)}
    examples = [
        (natural.NaturalExample if e["_natural"] else corpus.Example)(
            **{k: tuple(v) if k == "entities" else v for k, v in e.items() if k in fields}
        )
        for e in golden["examples"]
    ]
    llm = bundled["target"]
    result = harness.run(llm, examples, harness.EvalConfig(), None)

    def decode(turn) -> str:
        return llm.tokenizer.decode(turn.token_ids, skip_special_tokens=False)

    for trace, score in zip(result.traces, result.scores, strict=True):
        expected = golden["greedy"][trace.example.id]
        got = dataclasses.asdict(score)
        assert got.pop("end_to_end") == expected["end_to_end"]
        assert got == expected["score"]
        assert decode(trace.own.turns[0]) == expected["first_text"]
        supplied = trace.supplied and decode(trace.supplied.turns[0])
        assert supplied == expected["supplied_text"]
        own = decode(trace.own.turns[-1]) if len(trace.own.turns) > 1 else None
        assert own == expected["own_text"]
