"""The contradiction sidecar: the bundled pair model's held-out accuracy; branch scores against the
context and the siblings; results through the runtime visible a step later; a slow or raising
scorer never delays a step; the binding gate prunes on its score and is unchanged without it."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import pytest
from checkpoints import build_checkpoint

from noesis import LLM, SamplingParams
from noesis.control.gate import BindingGate, Branch
from noesis.engine.outputs import RequestOutput
from noesis.sidecars.config import load_sidecars
from noesis.sidecars.contradiction import (
    DECISION,
    Contradiction,
    ContradictionScorer,
    ContradictionSidecar,
    latest_scores,
)
from noesis.sidecars.runtime import Cadence, Placement, SidecarRuntime, Window

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "noesis-contradiction"
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [0, 9, 8, 7]


@pytest.fixture(scope="module")
def scorer():
    return ContradictionScorer.load(MODEL)


def test_bundled_model_heldout_accuracy(scorer):
    """Pairs drawn as scripts/train_contradiction.py draws its held-out set (the corpus's held-out
    split, unseen answer frames), at another seed. The model card reports 0.932 on 8,368 pairs;
    this draw gave 0.927 (2026-11-28). The floor leaves room for sampling noise and a retrain at
    another seed; calling every differing pair of texts a contradiction scores 0.50 here."""
    sys.path.insert(0, str(REPO / "scripts"))
    import train_contradiction

    pairs = train_contradiction.dataset(7, "heldout", 250)
    assert len(pairs) > 1500
    assert train_contradiction.accuracy(scorer, pairs) >= 0.88
    by_kind = train_contradiction.per_kind(scorer, pairs)
    assert by_kind["paraphrase"] >= 0.95 and by_kind["denial"] >= 0.9
    assert by_kind["other_value"] >= 0.7  # its weakest kind (model card)
    assert ContradictionScorer.load(MODEL).num_parameters < 1_000_000
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 3_000_000


def test_sidecar_scores_a_branch_against_context_and_siblings(scorer):
    sidecar = ContradictionSidecar(scorer)
    sidecar.show(["a", "b", "c"], context="My name is Alice. What is my name?")
    assert sidecar.run(_window("a", "<think>hmm</think>")) is None  # nothing final yet
    agreeing = sidecar.run(_window("a", "Your name is Alice."))
    assert agreeing.context < 0.5 and agreeing.branches is None  # no sibling has answered
    other = sidecar.run(_window("b", "Your name is Bob."))
    assert other.context > 0.5 and other.branches > 0.5 and sidecar.decide(other) == DECISION
    same = sidecar.run(_window("c", "It is Alice."))
    # c agrees with a, not with b: the mean over both siblings sits between
    assert same.context < 0.5 and 0.2 < same.branches < 0.8
    assert other.score == max(other.context, other.branches)
    assert "contradiction" in str(other) and sidecar.decide(agreeing) is None
    alone = ContradictionSidecar(scorer).run(_window("z", "Your name is Bob."))
    assert alone == Contradiction(None, None) and alone.score == 0.0


def test_turn_cadence_takes_the_context_from_the_turn_window(scorer):
    sidecar = ContradictionSidecar(scorer, cadence=Cadence("turn"))
    turn = Window("r", "I have 12 apples. How many apples do I have?",
                  "I have 12 apples. How many apples do I have?", False)
    assert sidecar.run(turn) is None
    wrong = sidecar.run(_window("r", "You have 14 apples.", final=True))
    assert wrong.context > 0.5 and wrong.branches is None
    assert sidecar.run(_window("r", "You have 14 apples.", final=True)).context is None  # done


def test_results_through_the_runtime_arrive_at_the_next_step(scorer):
    sidecar = ContradictionSidecar(scorer, cadence=Cadence("request"))
    sidecar.show(["a", "b"], context="The meeting is on Friday. Which day is the meeting?")
    runtime = SidecarRuntime([sidecar])
    try:
        assert runtime.after_step([_output("a", "The meeting is on Friday.")]) == []
        _wait_completed(runtime, 1)
        (first,) = runtime.after_step([_output("b", "The meeting is on Monday.")])
        _wait_completed(runtime, 2)
        (second,) = runtime.after_step([])
    finally:
        runtime.close()
    assert (first.request_id, second.request_id) == ("a", "b")
    assert first.decision is None and second.decision == DECISION
    scores = latest_scores([first, second])
    assert scores["a"] < 0.5 < scores["b"]
    assert runtime.stats()["contradiction"]["decisions"] == {DECISION: 1}


class Stuck:
    """A scorer that holds its first call until released, or raises."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.started, self.release = fail, threading.Event(), threading.Event()

    def score(self, pairs):
        self.started.set()
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("scorer failed")
        return [0.9] * len(pairs)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("contradiction") / "llama", "llama")
    return LLM(str(path), device="cpu", dtype="float32", progress=False)


@pytest.mark.parametrize("fail", [False, True])
def test_slow_or_raising_sidecar_never_delays_a_step(llm, fail):
    """Counted, not timed: every step runs while the scorer is stuck in its first call; the
    tokens are those of a run without sidecars; windows past the queue are dropped and counted;
    a failure under the open policy decides nothing."""
    alone = llm.generate([PROMPT], PARAMS)[0].token_ids
    stuck = Stuck(fail)
    sidecar = ContradictionSidecar(stuck, cadence=Cadence("tokens", every=1),
                                   placement=Placement(queue_size=1))
    runtime = SidecarRuntime([sidecar])
    engine = llm.engine
    engine.sidecars = runtime
    try:
        request_id = engine.add_request(PROMPT, PARAMS, delta=True)
        sidecar.show([request_id, "sibling"], context="Which day is the meeting?")
        steps, tokens, results = 0, [], []
        while engine.has_unfinished():
            outputs = engine.step()
            steps += 1
            results += engine.sidecar_results
            tokens += [t for out in outputs for t in out.token_ids]
    finally:
        engine.sidecars = None
    assert tokens == alone and steps >= len(alone) and not results
    stats = runtime.stats()["contradiction"]
    assert stats["windows"] >= 3 and stats["drops"] == stats["windows"] - 2
    stuck.release.set()
    runtime.close()
    runtime.lanes["contradiction"].threads[0].join(10)
    late = runtime.after_step([])
    assert len(late) == 2
    assert all(r.decision is None and "scorer failed" in r.error for r in late) if fail else \
        all(r.decision == DECISION for r in late)


def test_gate_prunes_the_branch_the_sidecar_says_contradicts():
    # Four answers, all different strings: self-consistency penalizes every branch alike, so
    # nothing is pruned on it. The sidecar says branch 3 contradicts the others.
    branches = {i: Branch(0.3, answer) for i, answer in
                enumerate(["It is 42.", "The answer is 42.", "42.", "It is 17."])}
    gate = BindingGate()
    assert gate.prune(branches) == [] and gate.prune(branches) == []
    scored = {i: Branch(0.3, b.answer, contradiction=0.1) for i, b in branches.items()}
    scored[3] = Branch(0.3, "It is 17.", contradiction=0.95)
    gate = BindingGate()
    assert gate.prune(scored) == []  # hysteresis: weak once
    assert gate.prune(scored) == [3]
    # Branches the sidecar has not answered yet keep the exact-string fallback.
    mixed = {0: Branch(0.3, "42", contradiction=0.0), 1: Branch(0.3, "42"), 2: Branch(0.3, "7")}
    scores = BindingGate().scores(mixed)
    assert scores[0] == pytest.approx(-0.3) and scores[1] == pytest.approx(-0.3 - 0.5)
    assert scores[2] == pytest.approx(-0.3 - 1.0)


def test_gate_without_the_sidecar_scores_as_before():
    branches = {0: Branch(0.2, "42", True), 1: Branch(0.4, "42", None), 2: Branch(1.0, "7", False),
                3: Branch(math.inf)}
    scores = BindingGate().scores(branches)
    # "42" twice of three answers: each agrees with half of the others; "7" with none
    assert scores == {0: pytest.approx(-0.2 - 0.5 + 1), 1: pytest.approx(-0.4 - 0.5),
                      2: pytest.approx(-1.0 - 1 - 1), 3: -math.inf}


def test_config_lists_and_builds_the_contradiction_sidecar(tmp_path):
    file = tmp_path / "sidecars.toml"
    file.write_text("[sidecars.contradiction]\nthreshold = 0.7\nworkers = 2\n")
    (spec,) = load_sidecars(file).sidecars
    assert spec.kind == "contradiction" and spec.cadence.kind == "clause"
    assert Path(spec.model).resolve() == MODEL.resolve() and spec.threshold == 0.7
    assert spec.describe().startswith("contradiction: contradiction, model ")
    runtime = load_sidecars(file).build()
    try:
        sidecar = runtime.lanes["contradiction"].sidecar
        assert isinstance(sidecar, ContradictionSidecar) and sidecar.threshold == 0.7
    finally:
        runtime.close()


def _window(request_id: str, text: str, final: bool = False) -> Window:
    return Window(request_id, text, text, final)


def _output(request_id: str, text: str) -> RequestOutput:
    return RequestOutput(request_id, None, [], text, [1, 2, 3], "stop", None, True)


def _wait_completed(runtime: SidecarRuntime, count: int) -> None:
    deadline = time.monotonic() + 10
    while runtime.stats()["contradiction"]["completed"] < count and time.monotonic() < deadline:
        time.sleep(0.005)
