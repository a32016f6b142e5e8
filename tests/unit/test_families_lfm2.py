"""LFM2 (short convolutions between attention layers) against transformers on a tiny random
checkpoint (fp32, CPU): 32 greedy tokens identical and logprobs within 1e-4 of transformers'
cached generate, alone and batched with mixed lengths through prefills cut into chunks (a
conv layer then continues from its stored state) and preemption (a resumed sequence starts over
in a fresh state slot); prefix caching is off for it, with the reason logged.
"""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import hf_generate, noesis_greedy

from noesis import SamplingParams
from noesis.errors import ConfigError
from noesis.models.config import ModelConfig

PROMPTS = {"one": [7], "short": [0, 5, 9, 77, 100, 21], "long": list(range(30, 50))}
NEW_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def references(checkpoints):
    cache = {}

    def get(prompt: list[int]):
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = hf_generate(checkpoints.reference("lfm2"), prompt, NEW_TOKENS)
        return cache[tuple(prompt)]

    return get


def assert_matches(tokens, logprobs, reference):
    ref_tokens, ref_rows = reference
    assert tokens == ref_tokens, f"noesis {tokens}\ntransformers {ref_tokens}"
    worst = max(
        abs(lp - ref_rows[i, t].item())
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))
    )
    assert worst <= TOL, f"max |logprob difference| {worst:.3g}"


@pytest.mark.parametrize("prompt_name", ["one", "long"])  # "short" runs in the batch below
def test_greedy_parity(checkpoints, references, prompt_name):
    prompt = PROMPTS[prompt_name]
    tokens, logprobs = noesis_greedy(checkpoints.llm("lfm2"), prompt, NEW_TOKENS)
    assert_matches(tokens, logprobs, references(prompt))


def test_batched_chunked_and_preempted(checkpoints, references, caplog):
    """Three sequences at once in 4-token pages, prefills cut into 8-token chunks, a pool of 24
    pages (96 tokens) for the ~140 they need: some are preempted and start over. Prefix caching
    is asked for and refused, with the reason in the log."""
    prompts = [PROMPTS["short"], PROMPTS["long"], PROMPTS["long"][:13] + [3, 4, 5]]
    page = 2 * 2 * 16 * 4 * 4  # attention layers x (k, v) x kv_size x page_size x fp32
    with caplog.at_level(logging.WARNING, logger="noesis"):
        llm = checkpoints.new_llm(
            "lfm2",
            page_size=4,
            max_num_batched_tokens=8,
            kv_cache_memory=24 * page,
            enable_prefix_caching=True,
        )
    assert "prefix caching is off: the short-convolution layers" in caplog.text
    assert llm.engine.prefix_cache is None and llm.engine.kv.num_pages == 24
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        logprobs = [row[t] for row, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert_matches(out.token_ids, logprobs, references(prompt))
    assert sum(out.num_preemptions for out in outs) > 0
    assert not llm.engine.has_unfinished()


def test_the_conv_state_is_read(checkpoints, references):
    """Teeth for the tests above: with each decode's stored inputs zeroed before it runs, the
    tokens after the prompt leave transformers' (so the parity tests check the state)."""
    llm = checkpoints.llm("lfm2")
    states = [s.inputs for s in llm.engine.kv.conv.layers]
    conv = llm.engine.loaded.model.model.layers[0].conv
    decode = conv._decode

    def forgetful(inputs, stored, slots):
        stored.zero_()
        return decode(inputs, stored, slots)

    conv._decode = forgetful
    try:
        tokens, logprobs = noesis_greedy(llm, PROMPTS["long"], 4)
    finally:
        del conv._decode
    ref_tokens, ref_rows = references(PROMPTS["long"])
    assert abs(logprobs[0] - ref_rows[0, tokens[0]].item()) <= TOL  # the prefill's own logits
    assert (
        max(
            abs(lp - ref_rows[i, t].item())
            for i, (t, lp) in enumerate(zip(tokens[1:], logprobs[1:], strict=True), 1)
        )
        > 100 * TOL
    )
    assert all(s.shape[1:] == (2, 64) for s in states)


def test_config_spellings():
    """config.json as the released checkpoints spell it: block_ff_dim, full_attn_idxs,
    norm_eps, tie_embedding; the MLP width as transformers derives it."""
    base = {
        "architectures": ["Lfm2ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 2048,
        "num_hidden_layers": 6,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "block_ff_dim": 12288,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "full_attn_idxs": [2, 5],
        "norm_eps": 1e-5,
        "tie_embedding": True,
        "conv_L_cache": 3,
        "rope_theta": 1e6,
    }
    config = ModelConfig.from_hf(base)
    assert config.intermediate_size == 8192  # 2/3 of 12288, a multiple of 256
    assert config.conv_layers == (0, 1, 3, 4) and config.attention_layers == (2, 5)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5 and config.conv_kernel == 3
    assert config.rope.theta == 1e6 and config.qk_norm


def test_speculative_decoding_is_refused(checkpoints):
    from noesis.speculative.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="short-convolution"):
        checkpoints.new_llm("lfm2", speculative=SpeculativeConfig(method="ngram"))


def test_a_state_slot_per_sequence(checkpoints):
    """The pool holds max_num_seqs slots (+ scratch), freed when sequences finish."""
    llm = checkpoints.new_llm("lfm2", max_num_seqs=3)
    pool = llm.engine.kv.conv
    assert pool.num_slots == 3 and pool.layers[0].inputs.shape[0] == 4
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for _ in range(3):  # 9 sequences through 3 slots, each taking one freed by the last three
        llm.generate([[1, 2], [3, 4, 5], [6]], params)
        assert len(pool._owners) == 3 and not pool._free
    assert torch.equal(pool.slot_of_page[-1], torch.tensor(3))  # the scratch page: scratch slot
