"""Speculation for rows with a grammar, logprobs or logit_bias: verify masks every position with
the grammar's state there and reports each emitted token's logprobs and biased choice as the plain
sampler does; the grammar walks (verify masks, lookup cuts, a guided draft) leave each matcher as
they found it; through the engine, greedy output and logprobs equal plain decoding's."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from noesis import LLM, SamplingParams, SpeculativeConfig
from noesis.sampling.sampler import LogitBias, SamplingTensors, sample
from noesis.speculative.grammar import DraftGuide, VerifyMasks, grammar_prefix
from noesis.speculative.proposer import Proposals
from noesis.speculative.verify import verify
from noesis.structured import GrammarCompiler, GrammarSpec
from noesis.structured.bitmask import allocate_token_bitmask
from noesis.tokenizer import Tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models"
K = 3


def bias(rows, tokens, values) -> LogitBias:
    return LogitBias(torch.tensor(rows), torch.tensor(tokens), torch.tensor(values))


# ---------------------------------------------------------------- verify, no model


def test_biased_greedy_verify_emits_the_samplers_tokens_and_logprobs():
    """Each emitted token is what `sample` picks at its position (greedy, biased), with the
    logprobs `sample` reports for it (the raw model's): exactly, on the same logits."""
    torch.manual_seed(0)
    n, vocab = 3, 40
    logits = torch.randn(n, K + 1, vocab)
    t = SamplingTensors.greedy(max_logprobs=4)
    t.logit_bias = bias([0, 0, 2], [5, 7, 9], [30.0, -2.0, 25.0])  # rows 0, 2 forced to 5, 9
    per_position = [sample(logits[:, j].contiguous(), t) for j in range(K + 1)]
    chain = torch.stack([out.token_ids for out in per_position], dim=1)
    proposed = chain[:, :K].clone()
    proposed[1, 1] = (chain[1, 1] + 1) % vocab  # row 1 guesses wrong at position 1
    out = verify(logits.clone(), proposed, torch.full((n,), K), t)
    assert out.num_accepted.tolist() == [3, 1, 3]
    assert chain[0].tolist() == [5] * 4 and chain[2].tolist() == [9] * 4
    chosen, top_ids, top_logprobs = out.logprobs
    for row in range(n):
        for j in range(int(out.num_accepted[row]) + 1):
            plain = per_position[j]
            assert int(out.token_ids[row, j]) == int(plain.token_ids[row])
            assert chosen[row, j] == plain.token_logprobs[row]
            assert torch.equal(top_ids[row, j], plain.top_ids[row])
            assert torch.equal(top_logprobs[row, j], plain.top_logprobs[row])
    # Unbiased, row 0 would not have accepted its (biased) chain.
    plain_t = SamplingTensors.greedy()
    assert verify(logits.clone(), proposed, torch.full((n,), K), plain_t).num_accepted[0] < 3


def test_a_sampled_row_without_proposals_draws_the_biased_samplers_token():
    torch.manual_seed(1)
    n, vocab = 32, 30
    logits = torch.randn(n, 1, vocab)
    t = SamplingTensors(
        torch.full((n,), 0.9),
        None,
        None,
        None,
        torch.arange(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        all_greedy=False,
        logit_bias=bias(list(range(n)), [3] * n, [2.5] * n),
    )
    out = verify(
        logits, torch.zeros((n, 0), dtype=torch.int64), torch.zeros(n, dtype=torch.int64), t
    )
    assert torch.equal(out.next_token, sample(logits[:, 0], t).token_ids)


def test_masked_positions_reject_forbidden_proposals():
    """Position j's mask applies to position j: the argmax there is forbidden, so a greedy row
    that proposed it stops, the masked argmax follows; a sampled row never accepts a forbidden
    proposal, whatever its seed; logprobs are the masked logits' (a plain masked step's)."""
    torch.manual_seed(2)
    n, vocab = 64, 64
    row = torch.randn(K + 1, vocab)
    logits = row.expand(n, -1, -1).contiguous()
    chain = row.argmax(dim=-1)
    bitmask = allocate_token_bitmask(n * (K + 1), vocab).view(n, K + 1, -1)
    forbidden = int(chain[1])
    bitmask[:, 1, forbidden // 32] &= ~(1 << (forbidden % 32))
    proposed = chain[:K].expand(n, -1).contiguous()
    greedy = SamplingTensors.greedy(max_logprobs=2)
    out = verify(logits[:1].clone(), proposed[:1], torch.tensor([K]), greedy, None, bitmask[:1])
    masked = row[1].clone()
    masked[forbidden] = float("-inf")
    assert out.num_accepted.tolist() == [1] and int(out.next_token[0]) == int(masked.argmax())
    plain = sample(masked[None], greedy)
    assert out.logprobs[0][0, 1] == plain.token_logprobs[0]
    assert torch.equal(out.logprobs[1][0, 1], plain.top_ids[0])
    t = SamplingTensors(
        torch.ones(n),
        None,
        None,
        None,
        torch.arange(n, dtype=torch.int64),
        torch.zeros(n, dtype=torch.int64),
        all_greedy=False,
    )
    sampled = verify(logits.clone(), proposed, torch.full((n,), K), t, None, bitmask)
    assert (sampled.num_accepted <= 1).all() and (sampled.token_ids[:, 1] != forbidden).all()


# ---------------------------------------------------------------- grammar walks


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(Tokenizer.from_dir(BUNDLED / "noesis-tiny"), 8192)


def mask_of(matcher) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, 8192)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def test_verify_masks_follow_the_proposals_and_roll_back(compiler):
    spec = GrammarSpec.regex(r"(cat|dog)s? (run|sleep)")
    tokenizer = Tokenizer.from_dir(BUNDLED / "noesis-tiny")
    good = tokenizer.encode("dogs sleep", add_special_tokens=False)
    bad = good[:1] + tokenizer.encode("!!", add_special_tokens=False) + good[1:]
    matchers = [compiler.matcher(spec), None, compiler.matcher(spec)]
    assert matchers[2].accept_token(good[0])  # a row one token in
    before = [mask_of(m) if m is not None else None for m in matchers]
    width = max(len(good), len(bad))
    proposals = Proposals.from_lists([good, [1, 2], bad[1:]], width)
    filler = VerifyMasks(8192)
    filler.start(matchers, proposals, [0, 1, 2], [len(good), 2, len(bad) - 1], width + 1)
    masks = filler.result(torch.device("cpu"))
    filler.close()
    assert masks.shape == (3, width + 1, 256)
    for matcher, mask in zip(matchers, before, strict=True):  # rolled back: unchanged
        assert matcher is None or torch.equal(mask_of(matcher), mask)
    fresh = compiler.matcher(spec)
    for j, token in enumerate(good):  # row 0: position j is the mask after good[:j]
        assert torch.equal(masks[0, j], mask_of(fresh))
        assert fresh.accept_token(token)
    assert (masks[1] == -1).all()  # a free row allows everything
    assert torch.equal(masks[2, 0], before[2]) and (masks[2, 2:] == -1).all()  # "!!" refused
    assert grammar_prefix(matchers[0], bad) == 1 and grammar_prefix(matchers[0], good) == len(good)
    assert torch.equal(mask_of(matchers[0]), before[0])


def test_a_guided_draft_proposes_what_the_grammar_allows(compiler):
    """DraftGuide on the CPU masks every drafted position (a draft that prefers a forbidden
    token still proposes allowed ones) and leaves the matcher where it was."""
    spec = GrammarSpec.regex(r"[0-9]{4}")
    matcher = compiler.matcher(spec)
    before = mask_of(matcher)
    guide = DraftGuide([matcher, None], 8192, torch.device("cpu"), per_token=True)
    drafted = torch.zeros((2, K), dtype=torch.int64)
    for j in range(K):
        logits = torch.zeros(2, 8192)
        logits[:, 65] = 10.0  # the draft would say "A" (or whatever id 65 is), always
        masked = guide.mask(j, logits, drafted)
        drafted[:, j] = masked.argmax(dim=-1)
        assert int(drafted[1, j]) == 65  # the free row is untouched
        assert bool(mask_of(matcher)[int(drafted[0, j]) // 32] >> (int(drafted[0, j]) % 32) & 1)
        assert matcher.accept_token(int(drafted[0, j]))  # what the guide will take next
        matcher.rollback(1)
    guide.finish()
    assert torch.equal(mask_of(matcher), before)


# ---------------------------------------------------------------- through the engine


def close(a: float, b: float, tolerance: float) -> bool:
    """Within tolerance, or both -inf (a token the grammar masks, among the top-n)."""
    return a == b or abs(a - b) < tolerance


def spec_rows_params(plain) -> list[SamplingParams]:
    free = plain.generate(
        [[5, 6, 7, 8, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    token = free[0].token_ids[2]
    return [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=0, max_tokens=14, ignore_eos=True, logit_bias={token: 4.0, token + 1: -3.0}
        ),
        SamplingParams(temperature=0, max_tokens=10, grammar=GrammarSpec.regex(r"[a-z ]+")),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    ]


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_grammar_logprobs_and_logit_bias_rows_speculate_like_plain_decoding(checkpoints, method):
    from test_engine_speculative import BATCH, assert_idle, spec_config

    plain = checkpoints.llm("llama")
    params = spec_rows_params(plain)
    prompts = [BATCH[2], BATCH[2], BATCH[0], BATCH[3]]
    expected = plain.generate(prompts, params)
    llm = checkpoints.new_llm("llama", speculative=spec_config(checkpoints, method))
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert got[0].spec_proposed > 0
    if method == "self":  # the draft drafts under the grammar: every proposal allowed
        assert got[1].spec_accepted == got[1].spec_proposed > 0
        assert got[2].spec_accepted == got[2].spec_proposed > 0
    assert len(got[0].logprobs) == len(got[0].token_ids)
    for mine, theirs in zip(got[0].logprobs, expected[0].logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        # The verify forward's batch differs from a plain step's: float32 rounding only.
        assert all(close(mine[t], theirs[t], 1e-5) for t in mine), (mine, theirs)
    assert_idle(llm)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bundled_pair() -> LLM:
    config = SpeculativeConfig(
        method="draft", draft=str(BUNDLED / "noesis-tiny-draft"), k=4, adaptive=False
    )
    return LLM(
        str(BUNDLED / "noesis-tiny"),
        device="cpu",
        dtype="float32",
        progress=False,
        speculative=config,
        max_num_seqs=4,
        max_model_len=384,
    )


def test_bundled_pair_constrained_rows_match_plain_and_validate(bundled_pair):
    """A JSON-schema row batched with free rows (one asking for logprobs), with the bundled
    draft guided by the grammar: token-identical to plain greedy, the JSON valid (the matcher
    was rolled back right after every verify), most guided proposals accepted."""
    llm = bundled_pair
    encode = llm.tokenizer.encode
    prompts = [
        encode("Give me data:", add_special_tokens=False),
        encode("Once upon a time, the little robot"),
        encode("A week has seven days."),
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=48,
            grammar=GrammarSpec.json_schema(SCHEMA, compact=True),
            logprobs=2,
        ),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    got = llm.generate(prompts, params)
    speculator, llm.engine.speculator = llm.engine.speculator, None
    try:
        expected = llm.generate(prompts, params)
    finally:
        llm.engine.speculator = speculator
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert got[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert got[0].spec_proposed > 0 and got[1].spec_accepted > 0
    for out, want in zip(got[:2], expected[:2], strict=True):
        assert len(out.logprobs) == len(out.token_ids)
        for mine, theirs in zip(out.logprobs, want.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(close(mine[t], theirs[t], 1e-5) for t in mine), (mine, theirs)
