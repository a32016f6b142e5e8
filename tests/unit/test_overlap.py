"""Overlapped steps (the next step planned and launched before the last one is read back) give
every request exactly what the synchronous loop gives: tokens, logprobs, text, finish reasons,
pages returned. On a CPU the device work is synchronous, but the bookkeeping is the same."""

from __future__ import annotations

import pytest
from test_invariance import PROMPTS, SAMPLED, assert_idle, greedy_params

from noesis import SamplingParams
from noesis.kv.cache import page_bytes


@pytest.fixture(scope="module")
def overlapped(checkpoints):
    return checkpoints.new_llm("llama", overlap_steps=True)


def same_outputs(got, expected):
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]


def test_steps_really_overlap(overlapped):
    """The first step returns nothing (its token is not read yet) and leaves a step in flight;
    the second launches its decode from that step's tokens on the device."""
    engine = overlapped.engine
    launches = []
    real = engine.runner.launch

    def spy(plan, previous):
        launches.append(previous)
        return real(plan, previous)

    engine.runner.launch = spy
    try:
        engine.add_request(PROMPTS[0], greedy_params(max_tokens=4))
        assert engine.step() == [] and engine._inflight is not None
        outputs = engine.step()
        assert [len(o.token_ids) for o in outputs] == [1]
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.launch = real
    assert launches[0] is None and all(p is not None for p in launches[1:4])
    assert_idle(overlapped)


def test_penalized_rows_overlap_and_count_the_token_in_flight(checkpoints, overlapped):
    """A request with penalties no longer keeps the batch from overlapping its steps: the next
    step is launched from the previous one's tokens on the device, and its sampler counts the
    previous token once the forward is queued (read back inside the launch), so the tokens
    equal the synchronous loop's, alone and beside unpenalized requests."""
    engine = overlapped.engine
    penalized = SamplingParams(seed=7, temperature=0.8, max_tokens=12, presence_penalty=0.8,
                               frequency_penalty=0.6, repetition_penalty=1.3)  # fmt: skip
    params = [penalized, greedy_params(max_tokens=12), SamplingParams(seed=2, **SAMPLED),
              penalized]  # fmt: skip
    launches, real = [], engine.runner.launch

    def spy(plan, previous, read_back=None):
        launches.append((previous is not None, read_back is not None))
        return real(plan, previous, read_back)

    engine.runner.launch = spy
    try:
        got = overlapped.generate(PROMPTS, params)
        assert any(from_previous and reads for from_previous, reads in launches)
        launches.clear()
        alone = overlapped.generate(PROMPTS[:1], [penalized])
        assert launches[1:] and all(from_previous for from_previous, _ in launches[1:-1])
    finally:
        engine.runner.launch = real
    synchronous = checkpoints.llm("llama")
    same_outputs(got, synchronous.generate(PROMPTS, params))
    same_outputs(alone, synchronous.generate(PROMPTS[:1], [penalized]))
    assert_idle(overlapped)


@pytest.mark.parametrize(
    "params",
    [
        [greedy_params(max_tokens=n) for n in (3, 24, 1, 11)],
        [SamplingParams(seed=3 + i, **SAMPLED) for i in range(4)],
        [greedy_params(max_tokens=12, logprobs=2)] * 4,
        [SamplingParams(seed=5, temperature=0.9, max_tokens=16, presence_penalty=0.5,
                        frequency_penalty=0.4, repetition_penalty=1.2)] * 4,
    ],
    ids=["greedy-lengths", "seeded", "logprobs", "penalties"],
)
def test_overlap_matches_synchronous(checkpoints, overlapped, params):
    expected = checkpoints.llm("llama").generate(PROMPTS, params)
    same_outputs(overlapped.generate(PROMPTS, params), expected)
    assert_idle(overlapped)


def test_stop_token_found_while_next_step_runs(checkpoints, overlapped):
    """A stop id sampled at step k is seen only after step k+1 was launched for it: that step's
    token is dropped and the output ends exactly where the synchronous one does."""
    free = checkpoints.llm("llama").generate([PROMPTS[1]], greedy_params(max_tokens=20))[0]
    stop = free.token_ids[6]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])] * 2
    expected = checkpoints.llm("llama").generate([PROMPTS[1], PROMPTS[2]], params)
    got = overlapped.generate([PROMPTS[1], PROMPTS[2]], params)
    same_outputs(got, expected)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert len(got[0].token_ids) == free.token_ids.index(stop) + 1
    assert_idle(overlapped)


def test_stop_string_and_streamed_deltas(checkpoints, overlapped):
    full = checkpoints.llm("llama").generate(["The quick"], greedy_params(max_tokens=32))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    params = greedy_params(max_tokens=32, stop=[stop])
    expected = checkpoints.llm("llama").generate(["The quick"], params)[0]
    engine = overlapped.engine
    request_id = engine.add_request("The quick", params, delta=True)
    text, tokens, finished = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            text += out.text
            tokens += out.token_ids
            finished = out.finish_reason
    assert (text, tokens, finished) == (expected.text, expected.token_ids, "stop")
    assert_idle(overlapped)


def test_abort_while_a_step_is_in_flight(checkpoints, overlapped):
    engine = overlapped.engine
    alone = checkpoints.llm("llama").generate([PROMPTS[2]], greedy_params(max_tokens=16))[0]
    doomed = engine.add_request(PROMPTS[0], greedy_params(max_tokens=16), stream=False)
    kept = engine.add_request(PROMPTS[2], greedy_params(max_tokens=16), stream=False)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    aborted = engine.abort(doomed)
    assert aborted.finish_reason == "abort" and -1 not in aborted.token_ids
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
    assert list(results) == [kept] and results[kept].token_ids == alone.token_ids
    assert_idle(overlapped)


def test_preemption_and_prefix_cache_with_overlap(checkpoints):
    reference = checkpoints.llm("llama")
    per_page = page_bytes(reference.model_config, 4, reference.engine.loaded.dtype)
    tight = checkpoints.new_llm("llama", page_size=4, kv_cache_memory=12 * per_page,
                                overlap_steps=True)
    params = [SamplingParams(seed=7 + i, **SAMPLED) for i in range(len(PROMPTS))]
    contended = tight.generate(PROMPTS, params)
    same_outputs(contended, reference.generate(PROMPTS, params))
    assert sum(o.num_preemptions for o in contended) > 0
    assert_idle(tight)

    cached = checkpoints.new_llm("llama", page_size=4, enable_prefix_caching=True,
                                 overlap_steps=True)
    history = PROMPTS[1] + PROMPTS[3]
    turns = [history[: 8 + 4 * i] for i in range(5)]
    for prompt in turns:  # each turn re-uses the pages the previous one cached
        same_outputs(cached.generate([prompt], [greedy_params(max_tokens=9)]),
                     reference.generate([prompt], [greedy_params(max_tokens=9)]))
    assert cached.engine.prefix_cache.hit_tokens > 0
    assert_idle(cached)


def test_constrained_steps_read_back_inside_the_next_launch():
    """A grammar needs each sampled token on the host before the next mask, but only the
    sampler waits for the mask: the next step's forward is queued first, then the step in
    flight is read back (its matchers advanced) and the masks filled. Results equal the
    synchronous engine's (the bundled model, whose tokenizer the grammar compiler reads)."""
    from test_engine_structured import BUNDLED, SCHEMAS

    from noesis import LLM
    from noesis.structured import GrammarSpec

    def run(overlap):
        llm = LLM(str(BUNDLED), device="cpu", dtype="float32", progress=False,
                  overlap_steps=overlap)
        read_backs = []
        real = llm.engine.runner.launch

        def spy(plan, previous, read_back=None):
            read_backs.append(read_back is not None)
            return real(plan, previous, read_back)

        llm.engine.runner.launch = spy
        prompt = llm.tokenizer.encode("Give me data:", add_special_tokens=False)
        params = [SamplingParams(seed=11 + i, temperature=1.0, max_tokens=40,
                                 grammar=GrammarSpec.json_schema(schema, compact=True))
                  for i, schema in enumerate(SCHEMAS)]
        params.append(greedy_params(max_tokens=20))
        outputs = llm.generate([prompt] * len(params), params)
        while llm.engine.has_unfinished():  # a grammar completed while its next step ran
            assert llm.engine.step() == []
        assert_idle(llm)
        return outputs, sum(read_backs)

    (overlapped, read_backs), (synchronous, none) = run(True), run(False)
    same_outputs(overlapped, synchronous)
    assert read_backs >= 10 and none == 0


def test_a_failed_launch_loses_nothing_else(checkpoints, overlapped, monkeypatch):
    """A step that fails while another is in flight: the step in flight is still read back, the
    one request of the failed step (re-run alone, failing again) ends with an error, and the
    engine serves the next request exactly and returns every page."""
    engine = overlapped.engine
    expected = checkpoints.llm("llama").generate([PROMPTS[3]], greedy_params(max_tokens=10))[0]
    engine.add_request(PROMPTS[0], greedy_params(max_tokens=30), stream=False)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    real = engine.runner.forward_eager

    def broken(plan, previous=None):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "forward_eager", broken)
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and "injected" in failed.error
    assert len(failed.token_ids) == 2  # the tokens of the two steps before
    monkeypatch.setattr(engine.runner, "forward_eager", real)
    assert engine.abort_all() == []
    assert overlapped.generate([PROMPTS[3]], greedy_params(max_tokens=10))[0].token_ids == \
        expected.token_ids
    assert_idle(overlapped)
