"""Prompt logprobs (SamplingParams.prompt_logprobs): every prompt token scored from the logits of
the position before it, equal to transformers' log-softmax of the same checkpoint's logits,
whether the prompt is prefilled at once or in chunks, beside other requests, and past a
prefix-cache hit (which such a request bypasses)."""

from __future__ import annotations

import pytest
import torch

from noesis import InvalidSamplingParams, SamplingParams

PROMPT = [5, 17, 3, 9, 11, 2, 8, 4, 6, 1, 12, 30, 7]
K = 3


@pytest.fixture(scope="module")
def reference(checkpoints) -> torch.Tensor:
    """transformers' log-softmax rows [L, V] of the prompt's logits."""
    model = checkpoints.reference("llama")
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.fixture(scope="module")
def chunked(checkpoints):
    """Prefill chunks of 4 tokens, small pages, a prefix cache."""
    return checkpoints.new_llm("llama", max_num_batched_tokens=4, page_size=4,
                               enable_prefix_caching=True)


def params(k: int = K) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)


def check(prompt_logprobs, reference: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for index, entry in enumerate(prompt_logprobs[1:], start=1):
        row = reference[index - 1]  # the position before scores this token
        token = PROMPT[index]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(K)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)
        assert len(entry) in (K, K + 1)  # the top-k, and the prompt token when not among them


def test_prompt_logprobs_match_transformers(checkpoints, reference):
    llm = checkpoints.llm("llama")
    out = llm.generate([PROMPT], params())[0]
    check(out.prompt_logprobs, reference)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_chunked_prefill_and_a_cached_prefix_give_the_same_values(chunked, reference):
    warm = chunked.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))[0]
    assert warm.prompt_logprobs is None
    # Beside a request without them; the prompt's pages are cached now, and bypassed.
    outs = chunked.generate([PROMPT, PROMPT[:5]], [params(), SamplingParams(max_tokens=2)])
    check(outs[0].prompt_logprobs, reference)
    assert outs[0].num_cached_tokens == 0 and outs[1].prompt_logprobs is None
    assert outs[0].token_ids == warm.token_ids


def test_k_zero_gives_only_the_prompt_tokens_and_bad_k_is_refused(checkpoints, reference):
    out = checkpoints.llm("llama").generate([PROMPT], params(0))[0]
    assert [list(entry) for entry in out.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:]]
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidSamplingParams, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
