"""Sampler: empirical distributions match the intended ones; seeded noise is batch-independent."""

from __future__ import annotations

import math

import pytest
import torch

from noesis.errors import InvalidSamplingParams
from noesis.sampling.noise import uniform
from noesis.sampling.params import SamplingParams
from noesis.sampling.sampler import Penalties, SamplingTensors, apply_penalties, sample

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
N = 40_000
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def draw(temperature=1.0, top_k=None, top_p=None, min_p=None, seed_base=0, step=0):
    batch = N
    logits = PROBS.log().repeat(batch, 1)
    t = SamplingTensors(
        temperature=torch.full((batch,), temperature),
        top_k=None if top_k is None else torch.full((batch,), top_k),
        top_p=None if top_p is None else torch.full((batch,), top_p),
        min_p=None if min_p is None else torch.full((batch,), min_p),
        seeds=torch.arange(seed_base, seed_base + batch, dtype=torch.int64),
        steps=torch.full((batch,), step, dtype=torch.int64),
        all_greedy=temperature == 0,
    )
    return sample(logits, t).token_ids


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor):
    counts = torch.bincount(samples, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    exp = expected[support].double() * len(samples)
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return
    assert chi2 < CHI2_CRIT[dof], f"chi2={chi2:.1f} (dof {dof}); counts {counts.tolist()}"


def renorm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


def test_plain_sampling_matches_probabilities():
    assert_distribution(draw(), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature(temperature):
    assert_distribution(draw(temperature=temperature), renorm(PROBS ** (1 / temperature)))


def test_top_k():
    expected = renorm(torch.where(torch.arange(6) < 3, PROBS, torch.zeros(6)))
    assert_distribution(draw(top_k=3), expected)


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.4 + 0.25 = 0.65 < 0.7, so the third token is still needed; the fourth is not.
    expected = renorm(torch.where(torch.arange(6) < 3, PROBS, torch.zeros(6)))
    assert_distribution(draw(top_p=0.7), expected)


def test_top_k_then_top_p_renormalized():
    # top-k 4 leaves [0.4, 0.25, 0.15, 0.1]/0.9; top-p 0.7 then keeps 0.444 + 0.278 = 0.72.
    expected = renorm(torch.where(torch.arange(6) < 2, PROBS, torch.zeros(6)))
    assert_distribution(draw(top_k=4, top_p=0.7), expected)


def test_min_p():
    # keep p >= 0.3 * 0.4 = 0.12
    expected = renorm(torch.where(PROBS >= 0.12, PROBS, torch.zeros(6)))
    assert_distribution(draw(min_p=0.3), expected)


def test_temperature_zero_is_argmax():
    assert torch.all(draw(temperature=0.0) == 0)


def test_noise_is_uniform_and_keyed_by_seed_and_step():
    seeds = torch.arange(1000, dtype=torch.int64)
    u = uniform(seeds, torch.zeros(1000, dtype=torch.int64), 64)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002
    # same (seed, step) -> same noise regardless of batch position
    alone = uniform(seeds[7:8], torch.zeros(1, dtype=torch.int64), 64)
    assert torch.equal(alone[0], u[7])
    other_step = uniform(seeds[7:8], torch.ones(1, dtype=torch.int64), 64)
    assert not torch.equal(other_step[0], u[7])
    # neighbouring seeds are uncorrelated
    corr = torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1]
    assert abs(float(corr)) < 0.1


def test_large_seed_high_bits_matter():
    a = uniform(torch.tensor([5], dtype=torch.int64), torch.tensor([0]), 16)
    b = uniform(torch.tensor([5 + (1 << 40)], dtype=torch.int64), torch.tensor([0]), 16)
    assert not torch.equal(a, b)


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    penalties = Penalties(
        repetition=torch.tensor([2.0]),
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        output_counts=torch.tensor([[2.0, 0.0, 1.0, 0.0]]),
        seen_mask=torch.tensor([[True, True, True, False]]),
    )
    out = apply_penalties(logits, penalties)
    # token 0: 2/2 - 0.25*2 - 0.5; token 1: -1*2 (prompt only); token 2: 0.5/2 - 0.25 - 0.5
    expected = torch.tensor([[1.0 - 0.5 - 0.5, -2.0, 0.25 - 0.25 - 0.5, 3.0]])
    assert torch.allclose(out, expected)


def test_logprobs_include_sampled_token():
    logits = PROBS.log().repeat(2, 1)
    t = SamplingTensors(
        temperature=torch.tensor([1.0, 1.0]),
        top_k=None, top_p=None, min_p=None,
        seeds=torch.tensor([1, 2]),
        steps=torch.tensor([0, 0]),
        all_greedy=False,
        max_logprobs=2,
    )
    out = sample(logits, t)
    assert out.top_ids.tolist() == [[0, 1], [0, 1]]
    assert torch.allclose(out.top_logprobs[0], PROBS[:2].log(), atol=1e-6)
    assert torch.allclose(out.token_logprobs, PROBS.log()[out.token_ids], atol=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("seed", -1),
        ("logprobs", 100),
        ("stop", [""]),
        ("stop_token_ids", [-5]),
        ("temperature", "hot"),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_params_normalize_stop_and_top_k():
    p = SamplingParams(stop="END", top_k=-1, stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.top_k == 0 and p.stop_token_ids == (3, 4)


@pytest.mark.parametrize("vocab", [128256, 32000, 151936, 384, 1009])
def test_two_stage_argmax_equals_argmax(vocab):
    from noesis.sampling.sampler import argmax

    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    x[1, 3] = x[1, vocab - 2] = 50.0  # a tie resolves to the lowest index
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_uniform_noise_never_reaches_zero_or_one():
    """The extreme 32-bit hashes map strictly inside (0, 1): Exp(1) noise stays positive, so
    no token's score can become +inf (an earlier 24-bit mapping rounded the top value to 1.0)."""
    from noesis.sampling.noise import unit_interval

    extremes = torch.tensor([0, 1, (1 << 31), (1 << 32) - 2, (1 << 32) - 1])
    u = unit_interval(extremes)
    assert bool((u > 0).all() and (u < 1).all())
    assert bool((-torch.log(u) > 0).all())


def test_a_masked_vocabulary_never_yields_a_masked_token():
    """Rows where one token of a 2^20 vocabulary is allowed (the rest -inf, as a grammar mask
    leaves them) sample that token every time, over many seeds and steps. With the old noise,
    each row-step had a 6% chance to pick a masked id."""
    from noesis.sampling.sampler import SamplingTensors, sample

    vocab, rows = 1 << 20, 16
    allowed = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(0))
    for step in range(8):
        logits = torch.full((rows, vocab), float("-inf"))
        logits[torch.arange(rows), allowed] = 0.0
        t = SamplingTensors(
            temperature=torch.ones(rows), top_k=None, top_p=None, min_p=None,
            seeds=torch.arange(rows) * 7919 + 3, steps=torch.full((rows,), step),
            all_greedy=False,
        )
        assert torch.equal(sample(logits, t).token_ids, allowed)


# ---- the CPU's candidate race against the sorting path ------------------------------------------


def sort_then_race(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The reference: filter_logits' sort over the whole vocabulary, then the race as one
    argmax over it (not the sampler's blocked race, which is under test too)."""
    from noesis.sampling.noise import exponential
    from noesis.sampling.sampler import filter_logits

    greedy = t.temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(t.temperature), t.temperature)[:, None]
    filtered = filter_logits(scaled, t.top_k, t.top_p, t.min_p)
    sampled = (filtered - exponential(t.seeds, t.steps, logits.shape[-1]).log()).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def knob_tensors(rows: list[tuple], seed: int) -> SamplingTensors:
    """rows: (temperature, top_k, top_p, min_p) each."""
    temperature, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*rows, strict=True))
    return SamplingTensors(
        temperature=temperature.float(), top_k=top_k.long(), top_p=top_p.float(),
        min_p=min_p.float(), seeds=torch.arange(len(rows)) * 7919 + seed,
        steps=torch.arange(len(rows)) + 3 * seed, all_greedy=False,
    )


MIXED_ROWS = [  # (temperature, top_k, top_p, min_p)
    (0.7, 0, 0.9, 0.0), (1.0, 40, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (0.9, 50, 0.95, 0.02),
    (1.0, 0, 1.0, 0.0),  # no filter in a filtered batch: the whole vocabulary races
    (0.0, 5, 0.5, 0.0),  # greedy, whatever its filters say
    (2.0, 3000, 0.99, 0.0),  # a top-k wider than the candidates
    (1.5, 0, 0.999, 0.0),  # a nucleus wider than the candidates
    (0.0, 0, 1.0, 0.0),  # greedy without filters
]


@pytest.mark.parametrize("seed", range(6))
def test_candidate_race_picks_what_sorting_the_vocabulary_picks(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED_ROWS), 20_000, generator=gen) * 2
    logits[:, :50] += 5 * torch.rand(len(MIXED_ROWS), 50, generator=gen)
    logits[3, 1::2] = float("-inf")  # a grammar's mask
    t = knob_tensors(MIXED_ROWS, seed)
    got = sample(logits, t).token_ids
    assert got.tolist() == sort_then_race(logits, t).tolist()
    assert got[5] == logits[5].argmax() and got[8] == logits[8].argmax() and got[3] % 2 == 0


@pytest.mark.parametrize("candidates", [1, 2, 7])
def test_candidates_grow_until_every_nucleus_fits(monkeypatch, candidates):
    """Flat rows keep most of their vocabulary: the candidates must grow, several times, to
    the same answer."""
    from noesis.sampling import sampler

    monkeypatch.setattr(sampler, "CANDIDATES", candidates)
    calls = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, *a, **kw: (
        calls.append(k), real_topk(self, k, *a, **kw))[1])
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 3000, generator=gen) * 0.3
    rows = [(1.0, 0, 0.98, 0.0), (1.0, 0, 0.5, 0.0), (0.8, 0, 1.0, 0.2), (1.0, 2, 1.0, 0.0)]
    for seed in range(4):
        t = knob_tensors(rows, seed)
        assert sample(logits, t).token_ids.tolist() == sort_then_race(logits, t).tolist()
    assert len(set(calls)) >= 3 and max(calls) > 1000


def test_candidate_race_of_a_row_with_nothing_allowed_answers_token_zero():
    logits = torch.full((2, 1000), float("-inf"))
    logits[1, 17] = 0.0
    t = knob_tensors([(1.0, 0, 0.9, 0.0), (1.0, 10, 1.0, 0.1)], 0)
    assert sample(logits, t).token_ids.tolist() == sort_then_race(logits, t).tolist() == [0, 17]


def test_candidate_race_samples_the_filtered_distribution():
    """Over a large vocabulary (the candidates a small share of it) the draws follow the
    top-p nucleus, renormalized."""
    rows, vocab = 20_000, 1000
    logits = torch.full((rows, vocab), -30.0)
    logits[:, [10, 900, 77, 500, 3]] = PROBS[:5].log()
    t = SamplingTensors(
        temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.full((rows,), 0.7), min_p=torch.zeros(rows), seeds=torch.arange(rows),
        steps=torch.zeros(rows, dtype=torch.int64), all_greedy=False,
    )
    drawn = sample(logits, t).token_ids
    order = torch.tensor([10, 900, 77])
    assert torch.isin(drawn, order).all()
    assert_distribution((drawn[:, None] == order).int().argmax(-1), renorm(PROBS[:3]))


@pytest.mark.parametrize("entries", [1, 5000, 1 << 18])
def test_race_in_blocks_picks_the_full_races_token(monkeypatch, entries):
    """The CPU races the vocabulary a block at a time; across blocks it must answer as one
    argmax over the whole row: ties to the lowest index, an all -inf row to 0."""
    from noesis.sampling import sampler
    from noesis.sampling.noise import exponential

    monkeypatch.setattr(sampler, "RACE_BLOCK_ENTRIES", entries)
    gen = torch.Generator().manual_seed(2)
    scaled = torch.randn(6, 20_000, generator=gen) * 3
    scaled[1] = float("-inf")
    scaled[2, :15_000] = float("-inf")  # only the last blocks are allowed
    seeds, steps = torch.arange(6) * 31 + 1, torch.arange(6) + 2
    full = (scaled - exponential(seeds, steps, 20_000).log()).argmax(dim=-1)
    assert sampler._race(scaled, seeds, steps).tolist() == full.tolist()
    assert full[1] == 0 and full[2] >= 15_000
    # a tie across blocks (scores equal at 100 and 19,000): the lower index wins
    tied = torch.full((1, 20_000), float("-inf"))
    tied[0, [100, 19_000]] = 0.0
    noise = exponential(seeds[:1], steps[:1], 20_000).log()
    tied[0, 100] += noise[0, 100]
    tied[0, 19_000] += noise[0, 19_000]
    assert sampler._race(tied, seeds[:1], steps[:1]).item() == 100
