"""Fault isolation in the engine: a failure one request explains ends that request alone (finish
reason "error", the others' tokens unchanged), a failure nobody explains raises EngineFault, and a
request whose grammar compiles waits outside the batch. Faults are injected into a private LLM."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from noesis import SamplingParams
from noesis.engine.async_engine import AsyncEngine
from noesis.engine.engine import MAX_LONE_FAILURES, EngineConfig, EngineFault
from noesis.engine.loop import EngineLoop
from noesis.engine.messages import EngineDead, Report
from noesis.engine.outputs import RequestOutput
from noesis.engine.stats import EngineStats
from noesis.engine.transport import EngineProcess, EngineThread
from noesis.structured import GrammarSpec
from noesis.structured.matcher import GrammarError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
CHOICES = [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True),
]
BAD = 1  # the index of the request the faults are injected into
FAULT_AT = 3  # ... once it has this many output tokens


@pytest.fixture
def llm(checkpoints):
    return checkpoints.new_llm("llama")


def solo_runs(llm) -> list[list[int]]:
    return [llm.generate([p], c)[0].token_ids for p, c in zip(PROMPTS, CHOICES, strict=True)]


def run_batch(llm, on_added=None):
    pairs = zip(PROMPTS, CHOICES, strict=True)
    ids = [llm.engine.add_request(p, c, stream=False) for p, c in pairs]
    if on_added is not None:
        on_added(ids)
    return llm._run_to_completion(ids, False)


def is_bad(seq, ids) -> bool:
    return seq.request_id == ids[BAD] and seq.num_output >= FAULT_AT


def assert_only_bad_failed(llm, outs, expected, words: str) -> None:
    for index, (out, tokens) in enumerate(zip(outs, expected, strict=True)):
        if index == BAD:
            assert out.finish_reason == "error" and words in out.error, out.error
            assert out.token_ids == tokens[:FAULT_AT]
        else:
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == tokens
    assert llm.engine.allocator.num_used == 0 and not llm.engine.has_unfinished()
    assert llm.engine.fault_counts["request_errors"] == 1


def test_a_step_that_fails_with_one_request_ends_that_request_alone(llm, monkeypatch):
    expected = solo_runs(llm)
    runner, launch, ids = llm.engine.runner, llm.engine.runner.launch, []

    def launch_unless_bad(plan, previous):
        if any(is_bad(item.seq, ids) for item in plan.scheduled):
            raise RuntimeError("injected fault")
        return launch(plan, previous)

    monkeypatch.setattr(runner, "launch", launch_unless_bad)
    outs = run_batch(llm, ids.extend)
    assert_only_bad_failed(llm, outs, expected, "injected fault")
    assert llm.engine.fault_counts["isolated_steps"] == 1


def test_nan_logits_in_one_row_end_that_request_alone(llm, monkeypatch):
    expected = solo_runs(llm)
    runner, forward, ids = llm.engine.runner, llm.engine.runner.forward_eager, []

    def poisoned(plan, previous=None):
        logits = forward(plan, previous)
        sampling = [item.seq for item in plan.scheduled if item.samples]
        for row, seq in enumerate(sampling):
            if is_bad(seq, ids):
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(runner, "forward_eager", poisoned)
    outs = run_batch(llm, ids.extend)
    assert_only_bad_failed(llm, outs, expected, "not finite")
    assert llm.engine.fault_counts["isolated_steps"] == 0  # caught by the sampler, no re-run


class BreakingMatcher:
    """A GrammarMatcher that delegates to a real one and raises at a chosen method after
    FAULT_AT accepted tokens."""

    def __init__(self, inner, breaks: str) -> None:
        self.inner = inner
        self.breaks = breaks
        self.accepted = 0

    def _check(self, method: str) -> None:
        if method == self.breaks and self.accepted >= FAULT_AT:
            raise RuntimeError(f"injected {method} failure")

    def accept_token(self, token_id: int) -> bool:
        self._check("accept_token")
        self.accepted += 1
        return self.inner.accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        self._check("fill_next_token_bitmask")
        self.inner.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def reset(self) -> None:
        self.inner.reset()

    def error(self) -> str | None:
        return self.inner.error()


@pytest.mark.parametrize("breaks", ["accept_token", "fill_next_token_bitmask"])
def test_a_grammar_matcher_that_raises_ends_its_request_alone(llm, breaks):
    grammar = GrammarSpec.regex("[a-z]{12}")
    constrained = SamplingParams(max_tokens=8, temperature=0, grammar=grammar)
    free = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2
    expected = [llm.generate([p], c)[0].token_ids for p, c in zip(PROMPTS[::2], free, strict=True)]
    engine = llm.engine
    ids = [engine.add_request(PROMPTS[0], free[0], stream=False),
           engine.add_request(PROMPTS[1], constrained, stream=False),
           engine.add_request(PROMPTS[2], free[1], stream=False)]
    seq = engine._requests[ids[1]].seq
    seq.matcher = BreakingMatcher(seq.matcher, breaks)
    outs = llm._run_to_completion(ids, False)
    assert [outs[0].token_ids, outs[2].token_ids] == expected
    assert outs[1].finish_reason == "error" and f"injected {breaks}" in outs[1].error
    assert engine.allocator.num_used == 0


def test_a_step_that_fails_for_every_request_is_an_engine_fault(llm, monkeypatch):
    def broken(plan, previous):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner, "launch", broken)
    for prompt, choice in zip(PROMPTS[:2], CHOICES[:2], strict=True):
        llm.engine.add_request(prompt, choice)
    with pytest.raises(EngineFault, match="device lost"):
        llm.engine.step()
    llm.engine.abort_all()
    assert llm.engine.allocator.num_used == 0


def test_lone_requests_that_keep_failing_become_an_engine_fault(llm, monkeypatch):
    def broken(plan, previous):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner, "launch", broken)
    for attempt in range(MAX_LONE_FAILURES):
        request_id = llm.engine.add_request(PROMPTS[0], CHOICES[0])
        if attempt < MAX_LONE_FAILURES - 1:  # blamed on the one request in the step
            (out,) = llm.engine.step()
            assert out.request_id == request_id and out.finish_reason == "error"
    with pytest.raises(EngineFault):
        llm.engine.step()
    llm.engine.abort_all()


# ---- requests whose grammar compiles -----------------------------------------------------------


def test_a_compiling_request_waits_outside_the_batch(llm, monkeypatch):
    engine = llm.engine
    compiler = engine.grammar_compiler()
    spec = GrammarSpec.regex("[a-z]{3,9}")
    compiled = compiler.submit(spec).result()
    pending: list[Future] = []

    def slow_submit(spec):
        pending.append(Future())
        return pending[-1]

    monkeypatch.setattr(compiler, "submit", slow_submit)
    params = SamplingParams(max_tokens=12, temperature=0, grammar=spec)
    good = engine.add_request(PROMPTS[0], params, wait_for_grammar=False)
    bad = engine.add_request(PROMPTS[1], params, wait_for_grammar=False)
    gone = engine.add_request(PROMPTS[2], params, wait_for_grammar=False)
    assert all(map(engine.is_compiling, (good, bad, gone))) and engine.num_compiling == 3
    assert not engine.has_unfinished() and engine.allocator.num_used == 0
    assert engine.poll_compiles() == ([], [])
    engine.abort(gone)
    pending[0].set_result(compiled)
    pending[1].set_exception(GrammarError("injected compile error"))
    admitted, rejected = engine.poll_compiles()
    assert admitted == [good] and [(i, str(e)) for i, e in rejected] == [
        (bad, "injected compile error")
    ]
    assert engine.num_compiling == 0
    (out,) = llm._run_to_completion([good], False)
    assert out.finish_reason == "stop" and out.text.isalpha() and 3 <= len(out.text) <= 9


def test_other_streams_run_while_a_grammar_compiles(checkpoints, monkeypatch):
    """Through the engine loop: a plain request streams to its end while another one's grammar
    is still compiling; then the grammar lands and that request runs too."""
    llm = checkpoints.new_llm("llama")
    compiler = llm.engine.grammar_compiler()
    spec = GrammarSpec.regex("[a-z]{4}")
    compiled = compiler.submit(spec).result()
    gate: Future = Future()
    monkeypatch.setattr(compiler, "submit", lambda spec: gate)

    async def main():
        engine = AsyncEngine(EngineThread(llm.engine), max_in_flight=4)
        engine.start()
        try:
            (waiting,) = engine.add(PROMPTS[0], [SamplingParams(max_tokens=8, grammar=spec)])
            (plain,) = engine.add(PROMPTS[1], [CHOICES[0]])
            out = await asyncio.wait_for(plain.result(), 20)
            assert len(out.token_ids) == 8 and not waiting._request.added.done()
            gate.set_result(compiled)
            constrained = await asyncio.wait_for(waiting.result(), 20)
            assert constrained.text.isalpha() and len(constrained.text) == 4
        finally:
            await engine.shutdown()

    asyncio.run(main())


# ---- a fresh engine process after a crash -----------------------------------------------------


def test_a_dead_engine_process_is_replaced_and_the_server_side_goes_on(checkpoints):
    path = str(checkpoints.path("llama"))
    config = EngineConfig(device="cpu", dtype="float32", progress=False, max_model_len=64)
    backend = EngineProcess.spawn(path, config, "warning")
    expected = checkpoints.llm("llama").generate([PROMPTS[0]], CHOICES[0])[0].token_ids

    async def main():
        engine = AsyncEngine(backend, max_in_flight=4)
        engine.start()
        try:
            (victim,) = engine.add(PROMPTS[1], [SamplingParams(max_tokens=50, ignore_eos=True)])
            await victim.started()
            backend._process.kill()  # a crash nobody reported: the pipe just closes
            with pytest.raises(EngineDead):
                await asyncio.wait_for(victim.result(), 20)
            with pytest.raises(EngineDead, match="restarting"):
                engine.add(PROMPTS[0], [CHOICES[0]])
            for _ in range(600):  # the fresh process loads the model again
                if engine.alive:
                    break
                await asyncio.sleep(0.1)
            assert engine.alive and engine.num_restarts == 1 and engine.backend is not backend
            (after,) = engine.add(PROMPTS[0], [CHOICES[0]])
            return (await asyncio.wait_for(after.result(), 20)).token_ids
        finally:
            await engine.shutdown()
            engine.backend.close()

    try:
        assert asyncio.run(main()) == expected
    finally:
        backend.close()


class StepFailsOnce:
    """Just enough of an Engine for the EngineLoop: one request, and a step that raises."""

    num_compiling = 0

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add_request(self, token_ids, params, request_id, delta, wait_for_grammar) -> str:
        self.ids.append(request_id)
        return request_id

    def is_compiling(self, request_id: str) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return bool(self.ids)

    def step(self):
        raise RuntimeError("device lost")

    def abort(self, request_id):
        return None

    def abort_all(self):
        ids, self.ids = self.ids, []
        return [RequestOutput(i, None, [], "", [], "abort", None, True) for i in ids]


@pytest.mark.parametrize("exit_on_fault", [False, True])
def test_the_engine_loop_reports_a_failed_step_then_exits_only_when_asked(exit_on_fault):
    commands = [[("add", "r1", [1], SamplingParams())], [("stop",)]]
    reports: list[Report] = []
    loop = EngineLoop(StepFailsOnce(), lambda timeout: commands.pop(0), reports.append,
                      stats=lambda engine: EngineStats(), exit_on_fault=exit_on_fault)
    if exit_on_fault:
        with pytest.raises(EngineFault):
            loop.run()
    else:
        loop.run()
    failed = [r for r in reports if r.failed]
    assert len(failed) == 1 and failed[0].failed == ["r1"]
    assert "device lost" in str(failed[0].error)
    assert len(commands) == (1 if exit_on_fault else 0)  # a faulted loop reads nothing more
