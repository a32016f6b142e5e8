"""benchmarks/control_ladder.py's report: each share with its Wilson interval and count (None
where nothing counts), the printed line, and the Quality@Tokens PNG written without a plotting
package. Synthetic runs: no model."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ladder():
    path = BENCHMARKS / "control_ladder.py"
    spec = importlib.util.spec_from_file_location("control_ladder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_carry_a_wilson_interval_and_their_count(ladder):
    share = ladder.rate("missed_tool_calls", [True, False, False, None])
    assert share["missed_tool_calls"] == pytest.approx(1 / 3) and share["missed_tool_calls_n"] == 3
    low, high = share["missed_tool_calls_ci"]
    assert 0 < low < 1 / 3 < high < 1
    assert ladder.rate("unnecessary_tool_calls", []) == {
        "unnecessary_tool_calls": None, "unnecessary_tool_calls_ci": None,
        "unnecessary_tool_calls_n": 0}  # fmt: skip


def run(ladder, rung: str, mode: str, correct: list[bool], tokens: list[float]) -> dict:
    mean, low, high = ladder.mean_interval(tokens)
    e2e = ladder.rate("end_to_end_accuracy", correct)
    e2e["end_to_end_ci"] = e2e.pop("end_to_end_accuracy_ci")
    return {"rung": rung, "mode": mode, **e2e, **ladder.rate("call_validity", [True] * 4),
            **ladder.rate("unnecessary_tool_calls", []),
            **ladder.rate("missed_tool_calls", [False, True]),
            "mean_tokens_to_answer": mean, "tokens_ci": [low, high], "per_example_tokens": tokens,
            "tool_header_forbidden": None, "seconds": 1.0}  # fmt: skip


def test_the_line_and_the_png(ladder, tmp_path):
    runs = [run(ladder, "baseline", "t=0.7", [True, False, True], [80.0, 90.0, 100.0]),
            run(ladder, "+phi", "t=0.7", [True, True, True], [60.0, 70.0, 80.0])]  # fmt: skip
    ladder._compare(runs)
    assert runs[1]["tokens_vs_baseline"]["change"] == pytest.approx(70 / 90 - 1)
    line = ladder._line(runs[1])
    assert "e2e 100.0% [" in line and "unnecessary -" in line and "missed 50.0% [" in line
    png = tmp_path / "qat.png"
    ladder.write_png(runs, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_rung_of_the_ladder_has_a_colour_in_the_plot(ladder):
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    from quality_at_tokens import COLOURS, RUNGS

    assert list(ladder.RUNGS) == RUNGS and len(COLOURS) == len(RUNGS)


def test_shares_count_optional_calls_apart_and_every_call(ladder):
    """Synthetic traces over control-split examples: an optional call is no error, a chain's
    invalid second call shows in every-call validity, not in first-try validity."""
    from types import SimpleNamespace

    from noesis.tiny import corpus, evaluate

    examples = corpus.control_examples(1234, 200)
    optional = next(e for e in examples if e.tool_optional)
    chain = next(e for e in examples if e.later_calls)
    direct = next(e for e in examples if e.expected_tool is None and e.tools)

    def call(name, arguments):
        return SimpleNamespace(name=name, arguments=arguments)

    first = call(chain.expected_tool, json.dumps(chain.expected_arguments))
    turns = {
        optional.id: [SimpleNamespace(tool_calls=[call(optional.expected_tool, "{}")], final=None)],
        chain.id: [SimpleNamespace(tool_calls=[first], final=None),
                   SimpleNamespace(tool_calls=[call(chain.later_calls[0]["tool"], "{")],
                                   final=None)],
        direct.id: [SimpleNamespace(tool_calls=[], final="hi")],
    }  # fmt: skip
    traces, scores = [], []
    for example in (optional, chain, direct):
        own = SimpleNamespace(turns=turns[example.id])
        traces.append(SimpleNamespace(example=example, own=own))
        score = evaluate.score_call(example, own.turns[0])
        scores.append(evaluate.ExampleScore(example.id, example.task, example.expected_tool,
                                            score, None, 10, True))  # fmt: skip
    shares = ladder.shares(traces, scores)
    assert shares["optional_tool_calls"] == 1.0 and shares["optional_tool_calls_n"] == 1
    assert shares["missed_tool_calls"] == 0.0 and shares["missed_tool_calls_n"] == 1
    assert shares["unnecessary_tool_calls"] == 0.0 and shares["unnecessary_tool_calls_n"] == 1
    assert shares["call_validity"] == pytest.approx(1 / 2)  # {} lacks the optional's arguments
    assert shares["every_call_validity"] == pytest.approx(1 / 3)
    assert shares["end_to_end_accuracy"] == 1.0 and "end_to_end_ci" in shares
    assert shares["by_task"]["two_calls"]["end_to_end_accuracy_n"] == 1
    assert shares["by_task"][optional.task]["mean_tokens_to_answer"] == 10
    line = ladder._line({**shares, "rung": "+exit", "mode": "greedy", "tokens_ci": [1.0, 2.0],
                         "mean_tokens_to_answer": 1.5, "tool_header_forbidden": None,
                         "seconds": 1.0})  # fmt: skip
    assert "optional 100.0% [" in line and "every call 33.3% [" in line
