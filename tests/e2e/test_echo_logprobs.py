"""echo with logprobs on /v1/completions through the official client: the prompt's tokens come
first in the logprobs (the first one null, as in OpenAI's API), with n > 1 and streamed."""

from __future__ import annotations

import pytest
from conftest import MODEL_NAME

GREEDY = {"model": MODEL_NAME, "temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPT = "The quick brown fox"


def test_echo_prepends_the_prompt_and_its_logprobs(client):
    reply = client.completions.create(prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, n=2,
                                      **GREEDY)  # fmt: skip
    prompt_tokens = reply.usage.prompt_tokens
    for choice in reply.choices:
        logprobs = choice.logprobs
        assert choice.text.startswith(PROMPT)
        assert len(logprobs.tokens) == prompt_tokens + 3
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])  # texts may repeat
        # offsets count the tokens' texts, the prompt's (a BOS token's too) then the completion's
        ends = [offset + len(token)
                for offset, token in zip(logprobs.text_offset, logprobs.tokens, strict=True)]
        assert logprobs.text_offset == [0] + ends[:-1]
    # greedy: the same choice; its logprobs equal up to float rounding, since the two rows may be
    # computed in batches of other shapes (the server is not run --deterministic here)
    first, second = (choice.logprobs for choice in reply.choices)
    assert first.tokens == second.tokens and first.text_offset == second.text_offset
    assert second.token_logprobs[1:] == pytest.approx(first.token_logprobs[1:], abs=1e-4)
    for a, b in zip(first.top_logprobs[1:], second.top_logprobs[1:], strict=True):
        assert a.keys() == b.keys() and list(b.values()) == pytest.approx(list(a.values()),
                                                                          abs=1e-4)


def test_a_prompt_tokens_logprob_is_the_one_it_had_when_generated(client):
    """A token generated after a prompt (forced by logit_bias; logprobs stay the model's) and
    then appended to it: scored as a prompt token, its logprob is the one it was generated with."""
    ids = [5, 17, 3, 9, 11, 2]
    first = client.completions.create(prompt=ids, max_tokens=1, logprobs=0,
                                      logit_bias={"42": 100}, **GREEDY)  # fmt: skip
    echoed = client.completions.create(prompt=ids + [42], max_tokens=1, echo=True, logprobs=0,
                                       **GREEDY)  # fmt: skip
    generated = first.choices[0].logprobs.token_logprobs[0]
    assert echoed.choices[0].logprobs.token_logprobs[len(ids)] == pytest.approx(generated,
                                                                                abs=1e-4)
    assert echoed.choices[0].logprobs.tokens[len(ids)] == first.choices[0].logprobs.tokens[0]


def test_streamed_echo_with_logprobs_matches_the_whole_response(client):
    kwargs = dict(prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, n=2, **GREEDY)
    whole = client.completions.create(**kwargs)
    texts, tokens, offsets = ["", ""], [[], []], [[], []]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                offsets[choice.index] += choice.logprobs.text_offset
    for index, choice in enumerate(whole.choices):
        assert texts[index] == choice.text
        assert tokens[index] == choice.logprobs.tokens
        assert offsets[index] == choice.logprobs.text_offset
