"""The binding gate's engine caller (noesis.control.branches): branches of one request, checked
every GATE_EVERY tokens, pruned within the group's cap (40% of its branches, and never below
`keep`), ended with finish_reason "pruned"; the server's best_of never returns a pruned branch."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from noesis import LLM, SamplingParams
from noesis.control import DefaultPolicy, NullPolicy
from noesis.control.branches import GATE_EVERY, BranchGate
from noesis.control.gate import Branch
from noesis.control.knobs import start_phi
from noesis.control.turns import TurnControl
from noesis.engine.outputs import RequestOutput
from noesis.errors import InvalidRequest
from noesis.planner.sequence import FinishReason
from noesis.sampling.metrics import TokenMetrics

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
PROMPT = [1, 5, 9, 42, 7]
LENGTH = 40
BRANCH = SamplingParams(temperature=1.0, seed=3, max_tokens=LENGTH, ignore_eos=True, metrics=True)


class Named(NullPolicy):
    """Names a fixed set of branches at every check, and records what it was shown."""

    name = "named"

    def __init__(self, names=None) -> None:
        self.names = names  # None: every branch shown
        self.shown: list[dict[str, Branch]] = []

    def should_prune(self, state, branches):
        self.shown.append(dict(branches))
        return list(branches) if self.names is None else [k for k in self.names if k in branches]


class Fake:
    """What the gate reads of a branch's RequestState."""

    def __init__(self, generated: int = 0, entropy: float = 0.5) -> None:
        self.seq = SimpleNamespace(token_ids=[0] * 3, prompt_len=3, finished=False,
                                   finish_reason=None)
        self.token_metrics: list = []
        self.text = ""
        self.entropy = entropy
        self.grow(generated)

    def grow(self, count: int) -> Fake:
        self.seq.token_ids += [0] * count
        self.token_metrics += [TokenMetrics(self.entropy, 0.0, 1.0, 0.5)] * count
        return self

    def end(self, reason: FinishReason = FinishReason.STOP, text: str = "") -> None:
        self.seq.finished, self.seq.finish_reason, self.text = True, reason, text


def gate_with(policy, ids, keep, tools=None, generated=0):
    states = {rid: Fake(generated) for rid in ids}
    gate = BranchGate()
    gate.add(states, keep, policy, policy.begin(start_phi(BRANCH)), tools)
    return gate, states


def grow_all(states, count):
    for state in states.values():
        if not state.seq.finished:
            state.grow(count)


def prune(gate, states, pending=()):
    """One check as the engine runs it: the named branches end "pruned"."""
    pruned = gate.observe({}, pending)
    for rid in pruned:
        states[rid].end(FinishReason.PRUNED)
    return pruned


def test_checks_every_gate_every_tokens_of_the_shortest_live_branch():
    policy = Named(names=[])
    gate, states = gate_with(policy, ["a", "b", "c"], keep=1, generated=GATE_EVERY)
    states["a"].seq.token_ids.pop()  # "a" is one token short
    assert prune(gate, states) == [] and policy.shown == []
    states["a"].grow(1)
    prune(gate, states)
    assert len(policy.shown) == 1 and set(policy.shown[0]) == {"a", "b", "c"}
    prune(gate, states)  # no new tokens: no second check
    assert len(policy.shown) == 1
    grow_all(states, GATE_EVERY)
    prune(gate, states)
    assert len(policy.shown) == 2


@pytest.mark.parametrize(("branches", "keep", "cap"), [(5, 1, 2), (5, 4, 1), (2, 1, 0), (10, 3, 4)])
def test_a_group_never_loses_more_than_40_percent_nor_goes_below_keep(branches, keep, cap):
    gate, states = gate_with(Named(), [f"r{i}" for i in range(branches)], keep)
    pruned = []
    for _ in range(5):
        grow_all(states, GATE_EVERY)
        pruned += prune(gate, states)
    assert len(pruned) == cap and len(set(pruned)) == cap
    assert branches - len(pruned) >= keep


def test_a_group_waits_for_branches_whose_grammar_still_compiles():
    policy = Named()
    gate, states = gate_with(policy, ["a", "b", "c"], keep=1, generated=GATE_EVERY)
    assert prune(gate, states, pending={"a", "b", "c"}) == [] and gate.groups  # kept
    assert prune(gate, states, pending={"c"}) == [] and not policy.shown  # not all run yet
    assert len(prune(gate, states)) == 1  # all three run: checked
    for state in states.values():
        if not state.seq.finished:
            state.end()
    assert prune(gate, states) == [] and not gate.groups  # all ended: forgotten


def test_finished_branches_are_scored_but_never_pruned():
    policy = Named()
    gate, states = gate_with(policy, ["done", "x", "y", "z", "w"], keep=1)
    states["done"] = done = states["done"]
    done.entropy = 0.1
    done.grow(2)
    done.end(text="<|channel|>final<|message|>The answer is 42.")
    grow_all(states, GATE_EVERY)
    pruned = prune(gate, states)
    shown = policy.shown[-1]
    assert shown["done"].mean_entropy == pytest.approx(0.1) and "done" not in pruned
    assert shown["done"].answer == "The answer is 42." and shown["x"].answer is None
    assert len(pruned) == 2  # floor(0.4 * 5)


def test_the_contradiction_sidecars_scores_reach_the_branches():
    policy = Named(names=[])
    gate, _ = gate_with(policy, ["a", "b", "c"], keep=1, generated=GATE_EVERY)
    gate.observe({"a": 0.9})  # (two branches could never lose one: unchecked)
    assert policy.shown[0]["a"].contradiction == 0.9 and policy.shown[0]["b"].contradiction is None


def test_a_group_is_checked_when_made():
    policy = NullPolicy()
    with pytest.raises(InvalidRequest, match="keep"):
        gate_with(policy, ["a", "b"], keep=3)
    gate, _ = gate_with(policy, ["a", "b"], keep=1)
    with pytest.raises(InvalidRequest, match="already"):
        gate.add({"b": Fake(), "c": Fake()}, 1, policy, policy.begin(start_phi(BRANCH)))


@pytest.fixture(scope="module")
def bundled_free():
    """The bundled model with no control policy of its own."""
    return LLM(str(BUNDLED), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def bundled():
    """The bundled Harmony model: its sampled distributions differ with temperature (a random
    tiny checkpoint's are near uniform at any), and its tokenizer spells Harmony."""
    return LLM(str(BUNDLED), device="cpu", dtype="float32", progress=False,
               control=DefaultPolicy())


def test_schema_validity_reads_a_harmony_branchs_complete_tool_calls(bundled):
    from noesis.harmony.parser import spelled_ids
    from noesis.turns import harmony_encoding

    encoding = harmony_encoding(bundled.tokenizer)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    policy = NullPolicy()
    gate = BranchGate(encoding)
    gate.add({"ok": Fake(), "bad": Fake()}, 1, policy, policy.begin(start_phi(BRANCH)), tools)
    group = gate.groups["ok"]

    def call(arguments: str, closed: bool = True) -> list[int]:
        text = ("<|channel|>commentary to=functions.add <|constrain|>json<|message|>" + arguments
                + ("<|call|>" if closed else ""))
        return spelled_ids(encoding, text)

    assert gate._schema_valid(group, call(json.dumps({"a": 2}))) is True
    assert gate._schema_valid(group, call(json.dumps({"a": "two"}))) is False
    assert gate._schema_valid(group, call("{not json")) is False
    assert gate._schema_valid(group, call(json.dumps({"a": 2}), closed=False)) is None


# ---------------------------------------------------------------- in the engine


def run(engine, ids):
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return [outputs[rid] for rid in ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_prunes_what_the_policy_names_within_the_cap(checkpoints, overlap):
    policy = Named()
    llm = checkpoints.new_llm("llama", control=policy, overlap_steps=overlap)
    engine = llm.engine
    ids = [engine.add_request(PROMPT, dataclasses.replace(BRANCH, seed=i)) for i in range(5)]
    assert engine.add_branches(ids, keep=2)
    outs = run(engine, ids)
    reasons = [out.finish_reason for out in outs]
    assert reasons.count("pruned") == 2 and reasons.count("length") == 3  # floor(0.4 * 5)
    for out in outs:
        if out.finish_reason == "pruned":  # stopped at the first check, a step or two after
            assert GATE_EVERY <= len(out.token_ids) <= GATE_EVERY + 2
            assert len(out.token_metrics) == len(out.token_ids)
        else:
            assert len(out.token_ids) == LENGTH
    shown = policy.shown[0]
    assert set(shown) == set(ids) and all(b.mean_entropy > 0 for b in shown.values())
    assert engine.branches.pruned_total == 2 and not engine.branches.groups  # forgotten at the end


def test_survivors_are_the_tokens_they_would_have_been(checkpoints):
    """Pruning a branch frees its slot; the others' tokens do not change (seeded rows)."""
    llm = checkpoints.new_llm("llama", control=Named())
    engine = llm.engine
    alone = [out.token_ids for out in
             llm.generate([PROMPT] * 3, [dataclasses.replace(BRANCH, seed=i) for i in range(3)])]
    ids = [engine.add_request(PROMPT, dataclasses.replace(BRANCH, seed=i)) for i in range(3)]
    engine.add_branches(ids, keep=2)
    outs = run(engine, ids)
    assert [o.finish_reason for o in outs].count("pruned") == 1
    for out, tokens in zip(outs, alone, strict=True):
        assert out.token_ids == tokens[: len(out.token_ids)]


def test_the_default_policy_gates_real_branches_and_keeps_its_bounds(bundled):
    engine = bundled.engine
    hot = [dataclasses.replace(BRANCH, seed=i, temperature=t)
           for i, t in enumerate((0.5, 0.5, 3.0, 3.0, 3.0))]
    ids = [engine.add_request("Hello there, what is", p) for p in hot]
    engine.add_branches(ids, keep=1)
    outs = run(engine, ids)
    pruned = [o.request_id for o in outs if o.finish_reason == "pruned"]
    assert len(pruned) <= 2
    # The three hot branches sample far flatter distributions (about 4 nats per token against
    # the cool ones' 1 or less), so the gate's -entropy score names them, after its hysteresis.
    assert pruned and set(pruned) <= set(ids[2:])


def test_nothing_to_gate_without_a_policy_and_metrics_are_required(checkpoints):
    engine = checkpoints.llm("llama").engine  # no control policy
    ids = [engine.add_request(PROMPT, BRANCH) for _ in range(3)]
    assert engine.add_branches(ids, keep=1) is False
    for rid in ids:
        engine.abort(rid)
    gated = checkpoints.new_llm("llama", control=Named()).engine
    plain = dataclasses.replace(BRANCH, metrics=False)
    ids = [gated.add_request(PROMPT, plain) for _ in range(3)]
    with pytest.raises(InvalidRequest, match="metrics"):
        gated.add_branches(ids, keep=1)
    with pytest.raises(InvalidRequest, match="differ"):
        gated.add_branches([ids[0], ids[0]], keep=1)
    assert gated.add_branches(ids[:1], keep=1) is False  # one branch: nothing to prune
    for rid in ids:
        gated.abort(rid)
    # A conversation's own policy gates where the engine has none
    ids = [engine.add_request(PROMPT, BRANCH) for _ in range(3)]
    assert engine.add_branches(ids, keep=1, policy=Named()) is True
    run(engine, ids)


# ---------------------------------------------------------------- the server


def test_best_of_never_returns_a_pruned_branch():
    from noesis.engine.outputs import best_of

    def out(rid, logprob, reason):
        return RequestOutput(rid, None, [1], "", [5], reason, [{5: logprob}], True)

    outputs = [out("a", -3.0, "stop"), out("b", -0.1, "pruned"), out("c", -1.0, "length")]
    assert [o.request_id for o in best_of(outputs, 3, 1)] == ["c"]
    assert [o.request_id for o in best_of(outputs, 3, 2)] == ["c", "a"]


def test_the_server_gates_best_of_only_with_its_control_on_and_not_opted_out():
    from noesis.server.app import ServerState
    from noesis.server.protocol import CompletionRequest

    body = CompletionRequest(model="m", prompt="Hi", best_of=3)
    state = SimpleNamespace(config=SimpleNamespace(engine=SimpleNamespace(control="default")))
    assert ServerState.gates_branches(state, body)
    assert not ServerState.gates_branches(state, CompletionRequest(model="m", prompt="Hi",
                                                                   best_of=3, control=False))
    state.config.engine.control = None
    assert not ServerState.gates_branches(state, body)


def test_best_of_through_the_server_prunes_extra_branches_and_returns_n(checkpoints):
    """The whole path: the body's best_of, the server's metrics and branches command, the
    engine loop, the gate, best_of's ranking; the pruned branches are billed, never returned."""
    import openai
    from starlette.testclient import TestClient

    from noesis.engine.config import EngineConfig
    from noesis.engine.transport import EngineThread
    from noesis.server.app import create_app
    from noesis.server.config import ServeConfig

    policy = Named()
    llm = checkpoints.new_llm("llama", control=policy)
    config = ServeConfig("m", engine=EngineConfig(control="default"), engine_process=False)
    app = create_app(config, EngineThread(llm.engine))
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        reply = client.completions.create(model="m", prompt=PROMPT, best_of=5, n=2,
                                          max_tokens=LENGTH, temperature=1.0, seed=4,
                                          extra_body={"ignore_eos": True})
        metrics = http.get("/metrics").text
    assert len(reply.choices) == 2 and {c.finish_reason for c in reply.choices} == {"length"}
    assert llm.engine.branches.pruned_total == 2 and policy.shown
    assert LENGTH * 3 < reply.usage.completion_tokens < LENGTH * 4  # 3 whole, 2 cut short
    assert 'noesis_requests_total{finish_reason="pruned"} 2.0' in metrics


def test_the_contradiction_sidecar_scores_the_engines_branches(checkpoints):
    """A real contradiction sidecar beside the gate: the engine shows it the group and its
    context, and its scores (a step or more later) are what the gate's next check reads."""
    from noesis.sidecars.contradiction import ContradictionScorer, ContradictionSidecar
    from noesis.sidecars.runtime import Cadence, SidecarRuntime

    model = BUNDLED.parent / "noesis-contradiction"
    sidecar = ContradictionSidecar(ContradictionScorer.load(model), cadence=Cadence("tokens", 4))
    runtime = SidecarRuntime([sidecar])
    policy = Named(names=[])
    engine = checkpoints.new_llm("llama", control=policy).engine
    engine.sidecars = runtime
    try:
        ids = [engine.add_request(PROMPT, dataclasses.replace(BRANCH, seed=i), delta=True)
               for i in range(3)]
        assert engine.add_branches(ids, keep=1, context="What is the answer?")
        while engine.has_unfinished():
            engine.step()
            deadline = time.monotonic() + 10  # let every offered window be scored
            stats = runtime.stats()["contradiction"]
            while (stats["completed"] + stats["drops"] + stats["errors"] < stats["windows"]
                   and time.monotonic() < deadline):
                time.sleep(0.001)
                stats = runtime.stats()["contradiction"]
    finally:
        engine.sidecars = None
        runtime.close()
    last = policy.shown[-1]
    assert len(policy.shown) >= 2 and set(last) == set(ids)
    assert all(0.0 <= b.contradiction <= 1.0 for b in last.values())


def test_branched_turns_pick_the_likeliest_unpruned_branch(bundled_free):
    """The ladder's +gate rung: each sampled turn runs as best_of branches gated by the
    conversation's policy (a Session's TurnControl), the turn is the most likely branch the gate
    left; a greedy turn runs once; with no policy at all it is refused."""
    from noesis.control.branched import BranchedTurns
    from noesis.session import TurnRequest
    from noesis.tiny import corpus

    example = corpus.generate(1234, "heldout", 1)[0]
    sampled = SamplingParams(temperature=0.7, seed=5, max_tokens=40)

    def request(params):
        return TurnRequest(example.prompt_messages, example.tools, "auto", False,
                           {"params": params})

    generator = BranchedTurns(bundled_free, best_of=4)
    (turn,) = generator.generate_turns([request(TurnControl(Named()).params(sampled))])
    assert generator.pruned == 1 and generator.decoded > turn.completion_tokens  # 1 of 4
    assert turn.finish_reason in ("tool_calls", "stop", "length")
    before = generator.decoded
    greedy = dataclasses.replace(sampled, temperature=0.0)
    (once,) = generator.generate_turns([request(TurnControl(Named()).params(greedy))])
    assert generator.decoded - before == once.completion_tokens  # one branch, not four
    with pytest.raises(ValueError, match="control"):
        generator.generate_turns([request(sampled)])  # no policy: the LLM has none either
