"""Invariance: what a request gets must not depend on caching, chunking, batching or preemption."""

from __future__ import annotations

import pytest
from checkpoints import hf_recompute, noesis_greedy

from noesis import SamplingParams

PROMPTS = [
    [0, 5, 9, 77, 100, 21],
    list(range(40, 60)),
    [3, 14, 15, 92, 65],
    list(range(100, 111)),
]
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, ignore_eos=True)
STATIC_ROPE = ["llama", "mistral-swa", "qwen3", "phi3", "llama-yarn"]


def assert_idle(llm):
    """No request left behind: every KV page is back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.allocator.num_free == engine.allocator.num_pages


def greedy_params(max_tokens=24, **options):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


# ---- cached decode == full recompute -------------------------------------------------------------


@pytest.mark.parametrize("name", STATIC_ROPE)
def test_cached_decode_equals_transformers_recompute(checkpoints, name):
    """noesis decodes from its paged KV cache; transformers recomputes every step from scratch."""
    prompt = PROMPTS[0]
    tokens, logprobs = noesis_greedy(checkpoints.llm(name), prompt, 32)
    ref_tokens, rows = hf_recompute(checkpoints.reference(name), prompt, 32)
    assert tokens == ref_tokens
    worst = max(
        abs(lp - rows[i, t].item()) for i, (lp, t) in enumerate(zip(logprobs, tokens, strict=True))
    )
    assert worst <= 1e-4


@pytest.mark.parametrize("name", ["llama", "mistral-swa"])
def test_cached_decode_equals_own_recompute(checkpoints, name):
    """Each decoded token equals what a fresh prefill of prompt + tokens so far gives."""
    llm = checkpoints.llm(name)
    prompt = PROMPTS[1]
    tokens, logprobs = noesis_greedy(llm, prompt, 16)
    for i in range(16):
        fresh = llm.generate([prompt + tokens[:i]], greedy_params(1, logprobs=0))[0]
        assert fresh.token_ids == [tokens[i]], f"step {i}"
        assert abs(fresh.logprobs[0][tokens[i]] - logprobs[i]) <= 1e-5


# ---- chunked prefill == whole prefill ------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "qwen3"])
@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_equals_whole_prefill(checkpoints, name, chunk):
    prompt = PROMPTS[1]  # 20 tokens: several chunks, crossing the 8-token sliding window
    whole = noesis_greedy(checkpoints.llm(name), prompt, 24)
    chunked_llm = checkpoints.new_llm(name, max_num_batched_tokens=chunk)
    chunked = noesis_greedy(chunked_llm, prompt, 24)
    assert chunked[0] == whole[0]
    assert max(abs(a - b) for a, b in zip(chunked[1], whole[1], strict=True)) <= 1e-5
    assert_idle(chunked_llm)




@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope"])
def test_chunked_prefill_length_dependent_rope(checkpoints, name):
    """A 20-token prompt past the 16-token window, prefilled in chunks of 7."""
    prompt = PROMPTS[1]
    whole = noesis_greedy(checkpoints.llm(name), prompt, 24)
    chunked = noesis_greedy(checkpoints.new_llm(name, max_num_batched_tokens=7), prompt, 24)
    assert chunked[0] == whole[0]
    assert max(abs(a - b) for a, b in zip(chunked[1], whole[1], strict=True)) <= 1e-5


def test_chunked_prefill_of_a_batch(checkpoints):
    """A small token budget chunks several prompts at once, interleaved with decodes."""
    llm = checkpoints.new_llm("llama", max_num_batched_tokens=5)
    params = greedy_params()
    chunked = llm.generate(PROMPTS, params)
    whole = checkpoints.llm("llama").generate(PROMPTS, params)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


# ---- batched == one at a time ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral-swa", "phi3", "llama-dynamic", "phi3-longrope"])
def test_batched_equals_one_at_a_time_greedy(checkpoints, name):
    llm = checkpoints.llm(name)
    params = greedy_params(logprobs=1)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        for row, alone_row in zip(out.logprobs, alone.logprobs, strict=True):
            assert row.keys() == alone_row.keys()
            # padded batch attention reassociates float sums: parity-level, not bitwise
            assert max(abs(row[t] - alone_row[t]) for t in row) <= 1e-4
    assert_idle(llm)


def test_batched_equals_one_at_a_time_sampled(checkpoints):
    llm = checkpoints.llm("llama")
    params = [SamplingParams(seed=100 + i, **SAMPLED) for i in range(len(PROMPTS))]
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    # and sampling did sample: not the greedy continuation
    greedy = llm.generate(PROMPTS, greedy_params())
    assert [o.token_ids for o in batched] != [o.token_ids for o in greedy]


def test_staggered_arrivals_equal_one_at_a_time(checkpoints):
    """Continuous batching: requests join while others decode (and prefill in chunks)."""
    llm = checkpoints.new_llm("llama", max_num_batched_tokens=9)
    engine = llm.engine
    params = [greedy_params(), SamplingParams(seed=5, **SAMPLED)] * 2
    alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    ids, finished = [], {}
    for prompt, sp in zip(PROMPTS, params, strict=True):
        ids.append(engine.add_request(prompt, sp))
        for _ in range(3):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[i].token_ids for i in ids] == alone
    assert_idle(llm)


def test_seed_reproducible_across_batch_compositions(checkpoints):
    llm = checkpoints.llm("llama")
    target = SamplingParams(seed=1234, **SAMPLED)
    prompt = PROMPTS[0]
    alone = llm.generate([prompt], target)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.5, top_k=5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    mixes = [
        ([PROMPTS[1], prompt, PROMPTS[2]], [others[0], target, others[1]], 1),
        ([prompt, PROMPTS[3], PROMPTS[1], PROMPTS[2]], [target, *others], 0),
        ([PROMPTS[3], PROMPTS[2], prompt], [others[2], others[2], target], 2),
    ]
    for prompts, params, index in mixes:
        assert llm.generate(prompts, params)[index].token_ids == alone
    different_seed = SamplingParams(seed=4321, **SAMPLED)
    assert llm.generate([prompt], different_seed)[0].token_ids != alone


def test_requests_without_seed_differ(checkpoints):
    llm = checkpoints.llm("llama")
    params = SamplingParams(**SAMPLED)
    first, second = llm.generate([PROMPTS[0], PROMPTS[0]], params)
    assert first.token_ids != second.token_ids


# ---- prefix caching ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "mistral-swa",
        "qwen3",
    ],
)
def test_prefix_caching_gives_the_same_tokens(checkpoints, name):
    shared = list(range(40, 60))  # 20 tokens: five full 4-token pages, past the 16-token window
    prompts = [shared + [3, 4], shared + [7, 8, 9, 10, 11, 12], shared[:9]]
    expected = [noesis_greedy(checkpoints.llm(name), p, 16)[0] for p in prompts]
    llm = checkpoints.new_llm(name, enable_prefix_caching=True, page_size=4)
    assert [noesis_greedy(llm, p, 16)[0] for p in prompts] == expected
    assert llm.engine.prefix_cache.hit_tokens > 0
    assert not llm.engine.has_unfinished()


def test_prefix_caching_is_off_for_length_dependent_rope(checkpoints):
    """With dynamic NTK a prefix's rotation depends on the prompt length: no sharing."""
    shared = list(range(40, 60))
    prompts = [shared + [3, 4], shared + [7, 8, 9, 10, 11, 12], shared[:9]]
    expected = [noesis_greedy(checkpoints.llm("llama-dynamic"), p, 16)[0] for p in prompts]
    llm = checkpoints.new_llm("llama-dynamic", enable_prefix_caching=True, page_size=4)
    assert llm.engine.prefix_cache is None
    assert [noesis_greedy(llm, p, 16)[0] for p in prompts] == expected


# ---- preemption ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "sampled"),
    [
        ("llama", False),
        ("llama", True),
        ("mistral-swa", False),
        ("llama-dynamic", False),
    ],
)
def test_preemption_gives_the_same_tokens(checkpoints, name, sampled):
    """A pool of 12 four-token pages cannot hold four 30-odd-token sequences at once."""
    from noesis.kv.cache import page_bytes

    reference = checkpoints.llm(name)
    if sampled:
        params = [SamplingParams(seed=7 + i, **SAMPLED) for i in range(len(PROMPTS))]
    else:
        params = [greedy_params()] * len(PROMPTS)
    uncontended = reference.generate(PROMPTS, params)
    per_page = page_bytes(reference.model_config, 4, reference.engine.loaded.dtype)
    tight = checkpoints.new_llm(name, page_size=4, kv_cache_memory=12 * per_page)
    assert tight.engine.allocator.num_pages == 12
    contended = tight.generate(PROMPTS, params)
    assert [o.token_ids for o in contended] == [o.token_ids for o in uncontended]
    assert [o.finish_reason for o in contended] == ["length"] * len(PROMPTS)
    assert sum(o.num_preemptions for o in contended) > 0
    assert all(o.num_preemptions == 0 for o in uncontended)
    assert_idle(tight)


# ---- finishing: stop strings, max_tokens, stop ids, abort ----------------------------------------


def test_max_tokens_finishes_with_length(checkpoints):
    llm = checkpoints.llm("llama")
    out = llm.generate([PROMPTS[0]], greedy_params(max_tokens=7))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7 and out.finished
    assert_idle(llm)


def test_stop_string_trims_text(checkpoints):
    llm = checkpoints.llm("llama")
    full = llm.generate(["The quick"], greedy_params(max_tokens=32))[0]
    # a stop string that first occurs well inside the text: two characters from its middle
    start = next(i for i in range(len(full.text) // 2, len(full.text) - 2) if full.text[i] != " ")
    stop = full.text[start : start + 2]
    cut = full.text.find(stop)
    assert cut > 0, full.text
    out = llm.generate(["The quick"], greedy_params(max_tokens=32, stop=[stop, "never-seen"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(
        ["The quick"], greedy_params(max_tokens=32, stop=stop, include_stop_str_in_output=True)
    )[0]
    assert kept.text == full.text[: cut + len(stop)]
    assert_idle(llm)


def test_stream_with_stop_string_never_shows_the_stop(checkpoints):
    llm = checkpoints.llm("llama")
    full = llm.generate(["The quick"], greedy_params(max_tokens=32))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    params = greedy_params(max_tokens=32, stop=stop)
    deltas = list(llm.stream("The quick", params))
    out = llm.generate(["The quick"], params)[0]
    assert "".join(deltas) == out.text == full[: full.find(stop)]
    assert_idle(llm)


def test_stop_token_id_finishes_with_stop(checkpoints):
    llm = checkpoints.llm("llama")
    full = llm.generate([PROMPTS[0]], greedy_params(max_tokens=16))[0].token_ids
    index = next(i for i in range(3, 16) if full[i] not in full[:i])
    out = llm.generate([PROMPTS[0]], greedy_params(max_tokens=16, stop_token_ids=[full[index]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[: index + 1]


def test_stream_close_aborts_and_frees_pages(checkpoints):
    llm = checkpoints.llm("llama")
    stream = llm.stream(PROMPTS[1], greedy_params(max_tokens=64))
    received = [next(stream) for _ in range(3)]
    assert all(received)
    engine = llm.engine
    assert engine.allocator.num_free < engine.allocator.num_pages  # the request holds pages
    stream.close()
    assert_idle(llm)
    assert engine._requests == {}
    # the engine still serves requests afterwards
    assert llm.generate([PROMPTS[0]], greedy_params(max_tokens=4))[0].finish_reason == "length"


def test_abort_mid_batch_keeps_the_others(checkpoints):
    llm = checkpoints.llm("llama")
    engine = llm.engine
    params = greedy_params(max_tokens=12)
    expected = llm.generate(PROMPTS[:2], params)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        engine.step()
    aborted = engine.abort(ids[0])
    assert aborted.finish_reason == "abort" and aborted.finished
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {ids[1]}
    assert finished[ids[1]].token_ids == expected[1].token_ids
    assert_idle(llm)
