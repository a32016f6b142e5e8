"""Per-token knobs (noesis.control.knobs): the Φ fast loop inside one generation. On synthetic
metric streams: the clamp, the hysteresis, fail-soft on NaN, greedy and top_p = 1 left alone,
a conversation's Φ carried into its next generation. On a tiny model: a knob change lands on the
very next token sampled (a step later with overlapped steps), and only for the rows it steers."""

import dataclasses
import math

import pytest

from noesis.control import DefaultPolicy, NullPolicy
from noesis.control.knobs import TokenControl, TokenKnobs
from noesis.control.turns import TurnControl
from noesis.engine.config import CONTROL_NAMES, EngineConfig
from noesis.errors import ConfigError, InvalidSamplingParams
from noesis.sampling.metrics import TokenMetrics
from noesis.sampling.params import SamplingParams

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


def m(entropy: float) -> TokenMetrics:
    return TokenMetrics(entropy, 0.1, 0.9, 0.5)


def knobs_for(params=SAMPLED, policy=None) -> TokenKnobs:
    knobs = TokenControl(policy or DefaultPolicy()).knobs(params)
    assert knobs is not None
    return knobs


def feed(knobs: TokenKnobs, entropies) -> list[tuple[float, float]]:
    """(temperature, top_p) the sampler would use for the token after each one fed."""
    out = []
    for h in entropies:
        knobs.observe(None if h is None else m(h))
        out.append((knobs.temperature, knobs.top_p))
    return out


def test_knobs_move_one_clamped_step_after_the_hysteresis_never_above_the_request():
    knobs = knobs_for()
    seen = feed(knobs, [0.5] * 30 + [3.0] * 12)
    assert set(seen[:33]) == {(0.8, 0.9)}  # calm, then three uncertain tokens: no move yet
    assert seen[33] == pytest.approx((0.8 * 0.9, 0.9 * 0.9))  # the 4th: one 10% step
    for (t0, p0), (t1, p1) in zip(seen, seen[1:], strict=False):
        assert t1 >= t0 * 0.9 - 1e-12 and p1 >= p0 * 0.9 - 1e-12  # never more than the clamp
    confident = feed(knobs, [0.0] * 200)
    assert max(t for t, _ in confident) <= 0.8 and max(p for _, p in confident) <= 0.9
    assert confident[-1] == pytest.approx((0.8, 0.9))  # back up, capped at the request's own


def test_nan_metrics_fail_soft_to_the_request_knobs():
    knobs = knobs_for()
    feed(knobs, [0.5] * 30 + [3.0] * 8)
    assert knobs.temperature < 0.8
    knobs.observe(TokenMetrics(math.nan, math.nan, math.nan, math.nan))
    assert (knobs.temperature, knobs.top_p) == (0.8, 0.9)
    knobs.observe(None)  # a row the engine could not read metrics for
    assert knobs.state.phi.fail_softs == 2 and knobs.state.belief.tokens == 38


def test_what_the_request_did_not_allow_is_never_moved():
    control = TokenControl(DefaultPolicy())
    assert control.knobs(SamplingParams(temperature=0.0)) is None  # greedy stays greedy
    assert control.knobs(dataclasses.replace(SAMPLED, control=False)) is None  # opted out
    assert TokenControl(None).knobs(SAMPLED) is None  # no policy: nothing to move
    full = knobs_for(SamplingParams(temperature=0.7, top_p=1.0))
    seen = feed(full, [0.5] * 30 + [3.0] * 12)
    assert seen[-1][0] < 0.7 and {p for _, p in seen} == {1.0}  # no nucleus Φ would add


def test_a_conversation_carries_its_phi_into_the_next_generation():
    turn = TurnControl(DefaultPolicy())
    params = turn.params(SAMPLED)
    assert params.control is turn and params.metrics
    first = TokenControl(None).knobs(params)  # the engine asks the conversation, not its own
    feed(first, [0.5] * 30 + [3.0] * 8)
    turn.observe_turn([m(9.0)] * 38, 38, called=False)  # fed per token already: not again
    assert turn.state.belief.tokens == 38
    again = turn.params(SAMPLED)
    assert (again.temperature, again.top_p) == (0.8, 0.9)  # the engine applies Φ, not params
    second = TokenControl(None).knobs(again)
    assert (second.temperature, second.top_p) == (first.temperature, first.top_p) != (0.8, 0.9)


def test_a_trace_records_a_conversations_control_as_on_with_its_state():
    """(How the state comes back: tests/unit/test_telemetry.py.)"""
    import json

    from noesis.control.record import RecordedControl
    from noesis.telemetry.trace import params_from_dict, params_to_dict

    params = TurnControl(DefaultPolicy()).params(SAMPLED)
    recorded = json.loads(json.dumps(params_to_dict(params, seed=5)))
    assert recorded["control"] is True and recorded["control_state"]["policy"] == "default"
    assert isinstance(params_from_dict(recorded).control, RecordedControl)
    assert params_to_dict(SAMPLED, 5)["control"] is True and "control_state" not in params_to_dict(
        SAMPLED, 5)
    assert params_to_dict(dataclasses.replace(SAMPLED, control=False), 5)["control"] is False


def test_control_values_are_checked():
    with pytest.raises(InvalidSamplingParams, match="control"):
        SamplingParams(control="default")
    with pytest.raises(ConfigError, match="control must be default, none"):
        EngineConfig(control="bogus")
    with pytest.raises(ConfigError, match="got int"):
        EngineConfig(control=3)
    assert EngineConfig(control=DefaultPolicy()).control.name == "default"


def test_the_engine_config_names_every_policy():
    from noesis.control import POLICIES

    assert tuple(POLICIES) == CONTROL_NAMES


# ---------------------------------------------------------------- on a tiny model


class Switch(NullPolicy):
    """After `at` usable tokens, a nucleus of one token: the row turns greedy mid-generation."""

    name = "switch"

    def __init__(self, at: int) -> None:
        self.at = at

    def next_phi(self, state, metrics):
        state.belief.observe(metrics)
        base = state.phi.base
        if state.belief.tokens >= self.at:
            return dataclasses.replace(base, top_p=base.top_p * 1e-6)
        return base


PROMPT = [1, 5, 9, 42, 7]
SWITCH_AT = 4
LENGTH = 12


@pytest.fixture(scope="module")
def greedy_from(checkpoints):
    llm = checkpoints.llm("llama")

    def continuation(prefix: list[int], count: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
        return llm.generate([prefix], params)[0].token_ids

    return continuation


@pytest.mark.parametrize("overlap", [False, True])
def test_a_knob_change_lands_within_the_generation(checkpoints, greedy_from, overlap):
    llm = checkpoints.new_llm("llama", control=Switch(SWITCH_AT), overlap_steps=overlap)
    params = SamplingParams(temperature=1.0, top_p=0.99, seed=11, max_tokens=LENGTH,
                            ignore_eos=True)  # fmt: skip
    steered, free = llm.generate([PROMPT, PROMPT],
                                 [params, dataclasses.replace(params, control=False)])
    assert steered.token_metrics is None  # metrics computed for the knobs, not returned
    lands = SWITCH_AT + overlap  # overlapped: the step in flight was launched with the old knobs
    assert steered.token_ids[:lands] == free.token_ids[:lands]  # the same noise, the same knobs
    head = steered.token_ids[:lands]
    assert steered.token_ids[lands:] == greedy_from(PROMPT + head, LENGTH - lands)
    assert free.token_ids[lands:] != greedy_from(PROMPT + head, LENGTH - lands)
    assert head != greedy_from(PROMPT, lands)  # sampled, not greedy, before the switch
    assert llm.session().policy is llm.control  # the LLM's policy steers its sessions too


# ---------------------------------------------------------------- where it is switched on


def test_the_control_flags():
    from noesis.cli import _control_options, _parser

    parser = _parser()
    chat = parser.parse_args(["chat", "--control", "default"])
    serve = parser.parse_args(["serve", "--control", "none"])
    assert _control_options(chat) == {"control": "default"}
    assert _control_options(serve) == {"control": "none"}
    assert _control_options(parser.parse_args(["chat"])) == {}
    for flag in ("--control", "--controller"):  # the old spelling, as the README gave it
        args = parser.parse_args(["eval", "tools", flag, "think-budget"])
        assert args.control == "think-budget"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--control", "think-budget"])  # a tool-loop controller


def test_a_server_request_opts_out_with_a_body_field():
    from noesis.server.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    steered = ChatCompletionRequest(**body).sampling_params(8, None)
    left = ChatCompletionRequest(**body, control=False).sampling_params(8, None)
    assert [p.control for p in steered] == [True, True]
    assert [p.control for p in left] == [False, False]


def test_a_session_run_opted_out_turns_the_generators_control_off_too():
    from noesis.session import AssistantTurn, Session

    seen = []

    class Answers:
        def generate_turn(self, messages, tools, *, tool_choice, deterministic, cancel, **options):
            seen.append(options)
            return AssistantTurn("", [], "ok", 1, 1, "stop")

    session = Session(Answers(), control="default")
    messages = [{"role": "user", "content": "hi"}]
    session.generate(messages, params=SAMPLED, control=False)
    session.generate(messages, params=SAMPLED)
    assert seen[0] == {"params": SAMPLED, "control": False}
    assert isinstance(seen[1]["params"].control, TurnControl) and "control" not in seen[1]


def test_an_llm_turn_opts_out_with_a_keyword(checkpoints):
    llm = checkpoints.new_llm("llama", control="default")
    messages = [{"role": "user", "content": "hi"}]
    _, steered = llm._turn_inputs(messages, None, "auto", False, SAMPLED)
    _, left = llm._turn_inputs(messages, None, "auto", False, SAMPLED, control=False)
    assert steered.control is True and left.control is False
    assert llm.engine.control.knobs(steered) is not None and llm.engine.control.knobs(left) is None
