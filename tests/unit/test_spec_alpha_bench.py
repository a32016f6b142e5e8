"""benchmarks/spec_alpha.py's oracle and bookkeeping, without an engine: the oracle proposes the
reference at rate alpha (and a different token otherwise), the acceptance estimator and the
predicted speedup are the formulas the table claims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import spec_alpha  # noqa: E402

from noesis.speculative.proposer import Proposals  # noqa: E402


class CountingProposer:
    """Stands in for the draft: proposes zeros and counts its calls and releases."""

    def __init__(self) -> None:
        self.calls, self.released = 0, []

    def propose(self, request_ids, histories, depths, sampling=None):
        self.calls += 1
        return Proposals.from_lists([[0] * d for d in depths], max(depths, default=0))

    def release(self, request_id) -> None:
        self.released.append(request_id)


def oracle(alpha: float, references: dict, inner=None) -> spec_alpha.Oracle:
    timer = spec_alpha.StepTimer(torch.device("cpu"))
    return spec_alpha.Oracle(
        inner or CountingProposer(), references, alpha, 50, seed=1, timer=timer
    )


def test_oracle_proposes_the_reference_at_rate_alpha_and_runs_its_proposer():
    reference = list(range(10, 40))
    full, none = oracle(1.0, {"a": reference}), oracle(0.0, {"a": reference})
    out = full.propose(["a"], [reference[:5]], [4])
    assert out.to_lists() == [reference[5:9]]
    assert full.inner.calls == 1 and len(full.timer.seconds) == 1
    assert full.planted == {"a": [4]}
    wrong = none.propose(["a"], [reference[:5]], [4]).to_lists()[0]
    assert all(t != r and 0 <= t < 50 for t, r in zip(wrong, reference[5:9], strict=True))
    assert none.planted == {"a": [0]}
    half = oracle(0.65, {"a": reference * 40})
    hits = total = 0
    for _ in range(300):
        guess = half.propose(["a"], [reference[:5]], [4]).to_lists()[0]
        hits += sum(g == r for g, r in zip(guess, reference[5:9], strict=True))
        total += 4
    assert 0.6 < hits / total < 0.7
    half.release("a")
    assert half.inner.released == ["a"]


def test_oracle_pads_short_rows_and_notes_a_history_off_the_reference():
    reference = list(range(10, 30))
    o = oracle(1.0, {"a": reference, "b": reference})
    out = o.propose(["a", "b"], [reference[:3], [1, 2, 3]], [2, 0])
    assert out.proposed.shape == (2, 2) and out.num_proposed.tolist() == [2, 0]
    assert o.diverged == {"b"} and o.planted == {"a": [2]}


def test_acceptance_counts_tested_tokens_and_agreement():
    outcomes = [("a", 4, 4), ("a", 4, 1), ("b", 4, 0)]  # tested 4, 2, 1
    planted = {"a": [4, 1], "b": [2]}
    result = spec_alpha.acceptance(outcomes, planted)
    assert result["alpha_measured"] == pytest.approx(5 / 7)
    assert result["tokens_per_verify"] == pytest.approx((5 + 3) / 3)
    assert result["agree"] == "2/3" and result["proposed"] == 12


def test_predicted_speedup_is_expected_tokens_over_step_cost():
    assert spec_alpha.predicted(0.5, 2, 0.0, 1.0) == pytest.approx(1.75)
    assert spec_alpha.predicted(0.8, 4, 0.1, 1.2) == pytest.approx((1 - 0.8**5) / 0.2 / (0.4 + 1.2))


def test_lookup_replay_finds_the_copied_listing():
    class Chars:  # one token per character: the replay needs only encode
        def encode(self, text):
            return [ord(c) for c in text]

    replay = spec_alpha.lookup_replay(Chars(), 4)
    assert 0.5 < replay["lookup_alpha"] < 1.0 and replay["lookup_tokens_per_step"] > 1.5


def test_draft_variants_parse_bits_and_head_rows():
    args = spec_alpha.parse(["--draft", "/some/draft", "--draft-variants", "16, 16:32768,16:300"])
    got = spec_alpha.variants(args)
    assert [(v.tag, v.path, v.vocab) for v in got] == [
        ("draft", "/some/draft", None),
        ("draft/32k", "/some/draft", 32768),
        ("draft/300", "/some/draft", 300),
    ]
    for bad in ("3", "4:x", "16:"):
        args.draft_variants = bad
        if bad == "16:":  # an empty head size is the whole head
            assert spec_alpha.variants(args)[0].vocab is None
            continue
        with pytest.raises(SystemExit, match="BITS"):
            spec_alpha.variants(args)
