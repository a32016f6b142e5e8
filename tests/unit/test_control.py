"""The control plane (noesis.control) on synthetic metric streams: belief, the Φ controller's clamp,
hysteresis and fail-soft, the think budget's exits, emit-vs-tool, the binding gate's cap, and the
Session applying a policy (knobs relative to the request's, tool_choice through the grammar)."""

import math
from pathlib import Path

import pytest

from noesis.control import BeliefState, DefaultPolicy, NullPolicy, Phase, make_policy
from noesis.control.budget import ThinkBudget
from noesis.control.efe import Decision, EfeConfig, tool_vs_emit
from noesis.control.gate import BindingGate, Branch
from noesis.control.phi import Phi, PhiConfig, PhiController
from noesis.control.turns import TurnControl
from noesis.errors import InvalidRequest
from noesis.sampling.metrics import TokenMetrics
from noesis.sampling.params import SamplingParams
from noesis.session import STOP_FINAL, STOP_MAX_TOOL_ROUNDS, AssistantTurn, Session, ToolCall

BASE = Phi(temperature=0.8, top_p=0.9, verify_width=4, think_budget=64)


def m(entropy: float, margin: float = 0.5) -> TokenMetrics:
    return TokenMetrics(entropy, 0.1, 0.9, margin)


def drive(entropies, config=None, base=BASE):
    """Feed a stream of entropies; the knobs after each token."""
    belief, phi = BeliefState(), PhiController(base, config)
    out = []
    for h in entropies:
        metrics = None if h is None else m(h)
        belief.observe(metrics)
        out.append(phi.update(metrics, belief))
    return out, phi


# ---------------------------------------------------------------- belief


def test_belief_tracks_entropy_and_switches_phase_with_hysteresis():
    belief = BeliefState()
    for _ in range(10):
        belief.observe(m(2.0))
    assert belief.phase is Phase.EXPLORE and belief.entropy_ema == pytest.approx(2.0)
    for _ in range(3):
        belief.observe(m(0.6))  # between the thresholds: the phase holds
    assert belief.phase is Phase.EXPLORE
    for _ in range(20):
        belief.observe(m(0.0))
    assert belief.phase is Phase.EXPLOIT
    assert belief.variance == pytest.approx(0.0)
    assert not belief.observe(m(float("nan"))) and belief.tokens == 33


def test_tool_reliability_counts_failures_retries_and_timeouts():
    belief = BeliefState()
    assert belief.reliability() == 0.5  # the prior
    belief.observe_tool("calc", True, 1, None)
    belief.observe_tool("calc", True, 1, None)
    assert belief.reliability("calc") == pytest.approx(3 / 4)
    belief.observe_tool("web", False, 3, "timeout")
    web = belief.tools["web"]
    assert (web.calls, web.successes, web.retries, web.timeouts) == (1, 0, 2, 1)
    assert belief.reliability("web") < 1 / 3 < belief.reliability("calc")


# ---------------------------------------------------------------- Φ


def test_phi_moves_at_most_the_clamp_and_only_after_the_hysteresis():
    calm = [0.5] * 40
    knobs, _ = drive(calm + [3.0] * 12)
    assert all(k == BASE for k in knobs[:43])  # 40 calm + 3 uncertain: below the hysteresis
    moved = knobs[43]
    assert moved.temperature == pytest.approx(0.8 * 0.9)  # one 10% step, no more
    assert moved.top_p == pytest.approx(0.9 * 0.9)
    assert moved.think_budget == round(64 * 1.1) and moved.verify_width == 3
    for before, after in zip(knobs, knobs[1:], strict=False):
        assert after.temperature >= before.temperature * 0.9 - 1e-9


def test_phi_never_moves_while_the_direction_flips_inside_the_hysteresis():
    phi = PhiController(BASE)
    pattern = [2.0, 2.0, 2.0, 0.1, 0.1, 0.1, 1.0] * 10  # up 3, down 3, neutral: never 4 in a row
    for ema in pattern:
        belief = BeliefState(entropy_ema=ema, baseline=1.0)
        assert phi.update(m(ema), belief) == BASE
    jitter, _ = drive([0.5] * 30 + [1.0, 0.0] * 20)  # the EMA stays inside the band
    assert all(k == BASE for k in jitter)


def test_phi_stays_within_the_request_and_greedy_stays_greedy():
    knobs, _ = drive([0.5] * 30 + [4.0] * 200)
    assert min(k.temperature for k in knobs) >= 0.5 * BASE.temperature - 1e-9  # the floor
    assert max(k.temperature for k in knobs) <= BASE.temperature
    greedy = Phi(0.0, 1.0, 4, 64)
    knobs, _ = drive([0.5] * 30 + [4.0] * 50 + [0.0] * 50, base=greedy)
    assert all(k.temperature == 0.0 and k.top_p <= 1.0 for k in knobs)


def test_phi_fails_soft_to_the_request_when_metrics_misbehave():
    knobs, phi = drive([0.5] * 30 + [4.0] * 20 + [None])
    assert knobs[-2] != BASE and knobs[-1] == BASE and phi.fail_softs == 1
    nan = TokenMetrics(float("nan"), 0.0, 1.0, 1.0)
    assert phi.update(nan, BeliefState()) == BASE and phi.fail_softs == 2


def test_phi_hysteresis_is_configurable():
    knobs, _ = drive([0.5] * 30 + [3.0] * 3, PhiConfig(hysteresis=3))
    assert knobs[-1].temperature < BASE.temperature


# ---------------------------------------------------------------- think budget


def test_think_budget_exits_when_spent_or_when_confident():
    budget = ThinkBudget(6)
    assert [budget.observe(m(1.0, margin=0.1)) for _ in range(6)] == [False] * 5 + [True]
    assert budget.reason == "budget"
    budget = ThinkBudget(100)
    fired = [budget.observe(m(0.0, margin=0.99)) for _ in range(5)]
    assert fired == [False, False, False, True, True] and budget.reason == "confident"
    budget = ThinkBudget(100)
    assert not any(budget.observe(m(0.0, margin=0.99 if i % 3 else 0.2)) for i in range(30))


# ---------------------------------------------------------------- emit vs tool


def test_emit_vs_tool_allows_before_evidence_forbids_after_a_good_round_forces_when_lost():
    belief = BeliefState()
    assert tool_vs_emit(belief).decision is Decision.ALLOW
    for _ in range(10):
        belief.observe(m(0.05))
    belief.observe_tool("calc", True, 1, None)
    belief.end_round(True)
    # Without a margin a confident model is forbidden its next call after a good round; the
    # default wants as clear a case as forcing (two-call questions need that next call)
    scores = tool_vs_emit(belief, EfeConfig(forbid_margin=0.0))
    assert scores.decision is Decision.FORBID and scores.g_emit < scores.g_tool
    assert tool_vs_emit(belief).decision is Decision.ALLOW
    costly = EfeConfig(tool_cost=1.5)  # a call that costs far more than guessing on
    assert tool_vs_emit(belief, costly).decision is Decision.FORBID
    lost = BeliefState()
    for _ in range(10):
        lost.observe(m(4.0))
    assert tool_vs_emit(lost).decision is Decision.FORCE


# ---------------------------------------------------------------- binding gate


def test_gate_prunes_incoherent_branches_with_a_cap_and_hysteresis():
    gate = BindingGate()
    branches = {i: Branch(0.2, "42", True) for i in range(6)}
    branches |= {6: Branch(3.0, "7", False), 7: Branch(2.5, "9", None)}
    branches |= {8: Branch(2.8, "8", False), 9: Branch(2.9, "6", False)}
    assert gate.prune(branches) == []  # weak once: not yet (hysteresis)
    pruned = gate.prune(branches)
    assert len(pruned) == math.floor(0.4 * len(branches)) == 4
    assert set(pruned) == {6, 7, 8, 9}
    few = {0: Branch(0.1, "a"), 1: Branch(5.0, "b")}
    gate = BindingGate()
    gate.prune(few)
    assert gate.prune(few) == []  # 40% of two branches rounds down to none


# ---------------------------------------------------------------- policies in the Session


def test_policies_by_name():
    assert isinstance(make_policy("default"), DefaultPolicy)
    assert isinstance(make_policy("none"), NullPolicy) and make_policy(None) is None
    with pytest.raises(InvalidRequest, match="unknown control 'x' .*default, none"):
        make_policy("x")


def test_turn_control_scales_the_request_knobs_and_asks_for_metrics():
    control = TurnControl(DefaultPolicy())
    first = control.params(SamplingParams(temperature=0.7, top_p=0.95, seed=3))
    assert (first.temperature, first.top_p, first.seed, first.metrics) == (0.7, 0.95, 3, True)
    control.observe_turn([m(0.5)] * 30 + [m(4.0)] * 4, 34, called=False)
    second = control.params(SamplingParams(temperature=0.7, top_p=0.95, seed=4))
    assert second.temperature == pytest.approx(0.63) and second.top_p == pytest.approx(0.855)
    greedy = TurnControl(DefaultPolicy())
    greedy.params(SamplingParams(temperature=0.0))
    greedy.observe_turn([m(0.5)] * 30 + [m(4.0)] * 8, 38, called=False)
    assert greedy.params(SamplingParams(temperature=0.0)).temperature == 0.0
    greedy.observe_turn([], 5, called=False)  # a generator without metrics: fail-soft
    assert greedy.state.phi.phi == greedy.state.phi.base and greedy.state.phi.fail_softs == 1


class LoopingModel:
    """Calls `add` whenever the turn grammar allows a tool call, else answers; its tokens are
    near-certain. Records each request's tool_choice and params."""

    def __init__(self):
        self.requests = []

    def generate_turn(self, messages, tools, *, tool_choice, deterministic, cancel, **options):
        self.requests.append((tool_choice, options.get("params")))
        metrics = [m(0.05, 0.95)] * 8 if options.get("params") and options["params"].metrics else []
        if tool_choice == "none":
            return AssistantTurn("", [], "3", 1, 8, "stop", [1], [0] * 8, metrics)
        call = ToolCall("", "add", '{"a": 1, "b": 2}')
        return AssistantTurn("", [call], None, 1, 8, "tool_calls", [1], [0] * 8, metrics)


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@pytest.mark.parametrize("control", [None, "none"])
def test_without_control_the_loop_runs_to_the_round_limit(control):
    model = LoopingModel()
    response = Session(model, max_tool_rounds=3, control=control).generate(
        [{"role": "user", "content": "1+2?"}], tools=[add]
    )
    assert response.stop_reason == STOP_MAX_TOOL_ROUNDS and len(response.tool_calls) == 3
    assert [choice for choice, _ in model.requests] == ["auto"] * 4


def test_control_forbids_the_tool_header_after_a_good_round_where_its_margin_allows():
    """Through the turn grammar: a policy whose EFE-lite forbids without a margin stops the loop
    after the first good round; the default policy (forbidding needs a clear case) lets the
    model make its next call, as a two-call question needs."""
    model = LoopingModel()
    messages = [{"role": "user", "content": "1+2?"}]
    default = Session(model, max_tool_rounds=3, control="default").generate(messages, tools=[add])
    assert default.stop_reason == STOP_MAX_TOOL_ROUNDS
    assert [choice for choice, _ in model.requests] == ["auto"] * 4
    model.requests.clear()
    eager = DefaultPolicy(efe=EfeConfig(forbid_margin=0.0))
    session = Session(model, max_tool_rounds=3, control=eager)
    response = session.generate(messages, tools=[add])
    assert response.stop_reason == STOP_FINAL and response.final == "3"
    assert [choice for choice, _ in model.requests] == ["auto", "none"]
    assert all(params.metrics for _, params in model.requests)
    model.requests.clear()
    opted_out = session.generate(messages, tools=[add], control=False)
    assert opted_out.stop_reason == STOP_MAX_TOOL_ROUNDS and model.requests[0][1] is None
    required = session.generate(messages, tools=[add], tool_choice="required")
    assert required.stop_reason == STOP_FINAL  # a forced first call stands; then Φ's choice


class DirectAnswers:
    """Answers every request directly; records the requests (the harness batches them)."""

    def __init__(self):
        self.requests = []

    def generate_turns(self, requests, cancel):
        self.requests += requests
        metrics = [m(0.1, 0.9)] * 4
        return [AssistantTurn("", [], "ok", 1, 4, "stop", [1], [0] * 4, metrics) for _ in requests]


def test_the_eval_harness_runs_a_policy_through_its_session():
    from noesis.tiny import harness

    model = DirectAnswers()
    config = harness.EvalConfig(n=3, controller="default", constraint="harmony")
    report = harness.evaluate_tools(model, config)
    greedy = report["runs"]["greedy"]
    assert report["controller"] == "default" and greedy["tool_header_forbidden"] == 0.0
    assert all(r.options["params"].metrics and r.options["params"].greedy for r in model.requests)
    assert greedy["missed_tool_calls"] is not None and "unnecessary_tool_calls" in greedy
    assert greedy["end_to_end_accuracy"] is not None and greedy["mean_tokens_to_answer"] == 4
    with pytest.raises(InvalidRequest, match="unknown controller 'x'.*default, none"):
        harness.evaluate_tools(model, harness.EvalConfig(n=1, controller="x"))


def test_the_cli_offers_the_policies():
    from noesis.cli import main

    for flag in ("--control", "--controller"):
        with pytest.raises(SystemExit):
            main(["eval", "tools", flag, "bogus"])


BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="models/noesis-tiny not present")
def test_the_think_budget_caps_the_analysis_then_resumes_the_turn():
    from noesis import LLM
    from noesis.control.think import BudgetedTurns
    from noesis.session import TurnRequest
    from noesis.tiny import corpus

    llm = LLM(str(BUNDLED), device="cpu", dtype="float32", progress=False)
    generator = BudgetedTurns(llm, budget=3)
    example = next(e for e in corpus.generate(1234, "heldout", 8) if e.task == "lookup_country")
    params = SamplingParams(temperature=0.0, max_tokens=48, metrics=True)
    request = TurnRequest(example.prompt_messages, example.tools, "auto", False,
                          {"params": params, "grounded": True})  # fmt: skip
    (turn,) = generator.generate_turns([request])
    header, close = generator.header, generator.close
    assert turn.token_ids[: len(header)] == header
    cut = len(header) + 3
    assert turn.token_ids[cut : cut + len(close)] == close  # the model had more to say
    assert turn.analysis == llm.tokenizer.decode(turn.token_ids[len(header) : cut])
    assert [c.name for c in turn.tool_calls] == ["lookup_country"]  # the grammar resumed
    assert len(turn.token_metrics) == len(turn.token_ids) == turn.completion_tokens
    assert turn.token_metrics[len(header)] is not None and turn.token_metrics[0] is None
