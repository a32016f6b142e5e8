"""Speculative decoding foundation: config, n-gram proposals, exact verification, adaptive depth."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from noesis.errors import ConfigError
from noesis.sampling.sampler import Penalties, SamplingTensors, apply_penalties, sample
from noesis.speculative import DepthController, SpeculativeConfig
from noesis.speculative import verify as verify_module
from noesis.speculative.proposer import NgramProposer, Proposals, entropy_of, lengths_under_entropy
from noesis.speculative.verify import draft_race, processed_probs, verify

# ---------------------------------------------------------------- config


def test_config_defaults_and_forms():
    ngram = SpeculativeConfig(method="ngram", k=4)
    assert (ngram.k, ngram.ngram_max, ngram.ngram_min, ngram.adaptive) == (4, 4, 2, True)
    assert ngram.min_acceptance == 0.55
    draft = SpeculativeConfig(method="draft", draft="models/noesis-tiny-draft", k=4)
    assert draft.draft == "models/noesis-tiny-draft"
    assert SpeculativeConfig(method="ngram", entropy_cutoff=math.inf).entropy_cutoff == math.inf
    with pytest.raises(dataclasses.FrozenInstanceError):
        ngram.k = 8


@pytest.mark.parametrize("kwargs, field", [
    (dict(method="medusa"), "method"),
    (dict(method="draft"), "draft"),
    (dict(method="draft", draft=""), "draft"),
    (dict(method="ngram", draft="x"), "draft"),
    (dict(method="ngram", k=0), "k"),
    (dict(method="ngram", k=17), "k"),
    (dict(method="ngram", k=True), "k"),
    (dict(method="ngram", k=2.0), "k"),
    (dict(method="ngram", ngram_min=0), "ngram_min"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(method="ngram", adaptive="yes"), "adaptive"),
    (dict(method="ngram", acceptance_window=0), "acceptance_window"),
    (dict(method="ngram", min_acceptance=1.5), "min_acceptance"),
    (dict(method="ngram", marginal_acceptance=float("nan")), "marginal_acceptance"),
    (dict(method="ngram", reprobe_after=0), "reprobe_after"),
    (dict(method="ngram", reprobe_after=32, max_reprobe_after=16), "max_reprobe_after"),
    (dict(method="ngram", entropy_cutoff=0), "entropy_cutoff"),
    (dict(method="ngram", entropy_cutoff=float("nan")), "entropy_cutoff"),
    (dict(method="ngram", max_batch=0), "max_batch"),
])
def test_config_rejects_bad_fields_by_name(kwargs, field):
    with pytest.raises(ConfigError, match=rf"SpeculativeConfig\.{field}\b"):
        SpeculativeConfig(**kwargs)


def test_package_imports_without_torch_for_config():
    # config and adaptive are pure Python: the planner side can use them without torch.
    import ast
    import pathlib

    import noesis.speculative.adaptive as adaptive
    import noesis.speculative.config as config

    for module in (adaptive, config):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                 for a in node.names} | {node.module for node in ast.walk(tree)
                                         if isinstance(node, ast.ImportFrom)}
        assert not any(name and name.startswith("torch") for name in names), module.__name__


# ---------------------------------------------------------------- n-gram proposer


def propose(proposer, history, depth=4, request_id="r"):
    return proposer.propose([request_id], [history], [depth]).to_lists()[0]


def test_ngram_proposes_what_followed_the_most_recent_occurrence():
    proposer = NgramProposer(max_n=3, min_n=1)
    assert propose(proposer, [1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]
    # Two earlier "7 8": the most recent one (followed by 9) wins.
    assert propose(proposer, [7, 8, 1, 7, 8, 9, 0, 7, 8], request_id="b") == [9, 0, 7, 8]


def test_ngram_prefers_the_longest_match():
    proposer = NgramProposer(max_n=3, min_n=1)
    # "5 6" last followed by 1, but the 3-gram "4 5 6" occurred earlier, followed by 2.
    history = [4, 5, 6, 2, 2, 9, 5, 6, 1, 3, 4, 5, 6]
    assert propose(proposer, history, depth=2) == [2, 2]
    assert propose(NgramProposer(max_n=2, min_n=1), history, depth=2) == [1, 3]


def test_ngram_no_match_depth_and_short_continuations():
    proposer = NgramProposer(max_n=4, min_n=2)
    assert propose(proposer, [1, 2, 3, 4]) == []  # nothing repeats
    assert propose(proposer, [5], request_id="one") == []
    assert propose(proposer, [1, 2, 3, 1, 2], depth=0, request_id="zero") == []
    # The continuation runs into the end of the history: only what exists is proposed.
    assert propose(proposer, [1, 2, 1, 2], depth=4, request_id="end") == [1, 2]
    assert propose(proposer, [3, 1, 2, 9, 1, 2], depth=1, request_id="d1") == [9]


def brute_force(history, depth, max_n, min_n):
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + depth]
    return []


def test_ngram_incremental_index_equals_a_rescan():
    rng = random.Random(7)
    history = [rng.randrange(6) for _ in range(20)]
    proposer = NgramProposer(max_n=4, min_n=2)
    for _ in range(300):
        assert propose(proposer, history, 3) == brute_force(history, 3, 4, 2)
        history = history + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_ngram_reindexes_a_rewritten_history_and_releases():
    proposer = NgramProposer(max_n=2, min_n=1)
    assert propose(proposer, [1, 2, 3, 1]) == [2, 3, 1]
    assert propose(proposer, [1, 2, 3, 4, 5, 5]) == [5]  # last indexed token changed -> rebuild
    assert propose(proposer, [9, 8, 9]) == [8, 9]  # shorter history -> rebuild
    proposer.release("r")
    assert "r" not in proposer._indexes
    with pytest.raises(ValueError, match="one entry per request"):
        proposer.propose(["a", "b"], [[1]], [1])


def test_ngram_is_fast_on_long_histories():
    import time

    rng = random.Random(1)
    history = [rng.randrange(50) for _ in range(20_000)]
    proposer = NgramProposer()
    propose(proposer, history)
    start = time.perf_counter()
    for _ in range(2_000):  # each step appends one token: only it is indexed
        history.append(rng.randrange(50))
        propose(proposer, history)
    assert time.perf_counter() - start < 5.0  # a rescan per step takes minutes


def test_proposals_from_lists():
    proposals = Proposals.from_lists([[3, 4], [], [5]], k=3)
    assert proposals.proposed.tolist() == [[3, 4, 0], [0, 0, 0], [5, 0, 0]]
    assert proposals.num_proposed.tolist() == [2, 0, 1]
    assert proposals.to_lists() == [[3, 4], [], [5]]
    assert Proposals.from_lists([[1], [2, 3]]).proposed.shape == (2, 2)
    with pytest.raises(ValueError, match="more than k=1"):
        Proposals.from_lists([[1, 2]], k=1)


def test_entropy_cuts_proposals_at_the_first_uncertain_position():
    sure = torch.tensor([1.0, 0.0, 0.0, 0.0])
    unsure = torch.full((4,), 0.25)  # ln 4 = 1.39 nats
    q = torch.stack([torch.stack([sure, sure, unsure, sure]),
                     torch.stack([unsure, sure, sure, sure])])
    lengths = lengths_under_entropy(entropy_of(q), torch.tensor([4, 3]), cutoff=1.0)
    assert lengths.tolist() == [2, 0]
    assert lengths_under_entropy(entropy_of(q), torch.tensor([1, 3]), cutoff=2.0).tolist() == [1, 3]


# ---------------------------------------------------------------- verification helpers


def knobs(n, temperature=1.0, top_k=None, top_p=None, min_p=None, seed_base=1000, steps=None,
          penalties=None):
    temperature = torch.as_tensor(temperature, dtype=torch.float32).expand(n).clone()
    return SamplingTensors(
        temperature=temperature,
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.full((n,), top_p),
        min_p=None if min_p is None else torch.full((n,), min_p),
        seeds=torch.arange(seed_base, seed_base + n, dtype=torch.int64),
        steps=(torch.arange(n, dtype=torch.int64) % 97) * 3 if steps is None else steps,
        all_greedy=False,
        penalties=penalties,
    )


def chi2_pvalue(samples, expected):
    counts = torch.bincount(samples, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    exp = expected[support].double() * len(samples)
    chi2 = ((counts[support] - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, chi2 / 2))


P = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05])
Q = torch.tensor([0.05, 0.05, 0.05, 0.10, 0.10, 0.15, 0.20, 0.30])
N = 40_000
K = 3


def draft_proposals(q, t, k=K):
    """Each row's k draft tokens, sampled from q (context-free) with the draft noise."""
    n = t.seeds.shape[0]
    scores = q.log().expand(n, -1)
    return torch.stack([draft_race(scores, t.seeds, t.steps + j) for j in range(k)], dim=1)


def run_statistical(t, target_probs, draft_probs_vec):
    n = t.seeds.shape[0]
    target_logits = target_probs.log().expand(n, K + 1, -1).contiguous()
    proposed = draft_proposals(draft_probs_vec, t)
    q = draft_probs_vec.expand(n, K, -1)
    return verify(target_logits, proposed, torch.full((n,), K), t, q), proposed


# ---------------------------------------------------------------- greedy verification


def test_greedy_accepts_the_argmax_chain():
    torch.manual_seed(0)
    logits = torch.randn(5, K + 1, 11)
    chain = logits.argmax(dim=-1)
    proposed = chain[:, :K].clone()
    proposed[0, 0] = (chain[0, 0] + 1) % 11  # wrong first guess
    proposed[1, 2] = (chain[1, 2] + 1) % 11  # wrong third guess
    num_proposed = torch.tensor([3, 3, 3, 2, 0])
    t = SamplingTensors.greedy()
    out = verify(logits, proposed, num_proposed, t)
    assert out.num_accepted.tolist() == [0, 2, 3, 2, 0]
    expected_next = [chain[0, 0], chain[1, 2], chain[2, 3], chain[3, 2], chain[4, 0]]
    assert out.next_token.tolist() == [int(x) for x in expected_next]
    assert out.token_ids[1].tolist() == [*chain[1, :2].tolist(), int(chain[1, 2]), -1]
    assert out.token_ids[4].tolist() == [int(chain[4, 0]), -1, -1, -1]


VOCAB = 12


def bigram_logits(history):
    """A toy target: logits depend on the last token (a fixed random table)."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    return table[history[-1]]


def penalties_for(prompt, output, repetition=1.3, frequency=0.4):
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[torch.tensor(prompt + output)] = True
    return Penalties(torch.tensor([repetition]), torch.tensor([0.2]), torch.tensor([frequency]),
                     counts[None], seen[None])


def test_greedy_speculation_is_token_identical_to_plain_greedy_with_penalties():
    prompt = [1, 2, 3, 1, 2, 3, 1]
    steps = 40
    plain = []
    for _ in range(steps):
        t = SamplingTensors.greedy()
        t.penalties = penalties_for(prompt, plain)
        plain.append(int(sample(bigram_logits(prompt + plain)[None], t).token_ids[0]))

    proposer, output, accepted_total = NgramProposer(max_n=3, min_n=1), [], 0
    while len(output) < steps:
        guess = propose(proposer, prompt + output, depth=K)
        positions = [bigram_logits(prompt + output + guess[:j]) for j in range(K + 1)]
        proposals = Proposals.from_lists([guess], K)
        proposed, lengths = proposals.proposed, proposals.num_proposed
        t = SamplingTensors.greedy()
        t.penalties = penalties_for(prompt, output)
        out = verify(torch.stack(positions)[None], proposed, lengths, t)
        accepted_total += int(out.num_accepted[0])
        output += [x for x in out.token_ids[0].tolist() if x >= 0]
    assert output[:steps] == plain
    assert accepted_total > 0  # the toy loops, so lookup guesses right sometimes


# ---------------------------------------------------------------- sampled verification


def test_no_proposals_emit_exactly_what_the_sampler_would():
    torch.manual_seed(1)
    n, vocab = 64, 50
    logits = torch.randn(n, 1, vocab) * 2
    counts = torch.randint(0, 3, (n, vocab)).float()
    pen = Penalties(torch.full((n,), 1.2), torch.full((n,), 0.1), torch.full((n,), 0.3), counts,
                    counts > 0)
    t = knobs(n, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, penalties=pen)
    none = torch.zeros((n, 0), dtype=torch.int64)
    out = verify(logits, none, torch.zeros(n, dtype=torch.int64), t)
    assert torch.equal(out.next_token, sample(logits[:, 0], t).token_ids)
    assert out.num_accepted.eq(0).all()


def test_sampled_output_follows_the_target_distribution():
    t = knobs(N)
    out, proposed = run_statistical(t, P, Q)
    assert chi2_pvalue(out.token_ids[:, 0], P) > 1e-3
    # Deeper positions too: the second token of rows that accepted their first proposal.
    second = out.token_ids[out.num_accepted >= 1, 1]
    assert len(second) > 5_000
    assert chi2_pvalue(second, P) > 1e-3
    # Acceptance is min(1, p/q) per position: sum(min(p, q)) = 0.5 expected.
    first_accepted = (out.num_accepted >= 1).double().mean()
    assert abs(float(first_accepted) - float(torch.minimum(P, Q).sum())) < 0.02


def test_the_distribution_test_catches_a_missing_residual(monkeypatch):
    # Drawing the correction from p instead of max(0, p - q) over-weights tokens the draft
    # likes: the same test must reject it.
    monkeypatch.setattr(verify_module, "_residual", lambda p, q: p)
    out, _ = run_statistical(knobs(N), P, Q)
    assert chi2_pvalue(out.token_ids[:, 0], P) < 1e-12


def test_deterministic_proposals_follow_the_target_distribution():
    # n-gram: q is one-hot at the guess; a fixed guess of token 0 (p = 0.3).
    t = knobs(N, seed_base=77)
    logits = P.log().expand(N, K + 1, -1).contiguous()
    proposed = torch.zeros((N, K), dtype=torch.int64)
    out = verify(logits, proposed, torch.full((N,), K), t, None)
    assert chi2_pvalue(out.token_ids[:, 0], P) > 1e-3
    assert abs(float((out.num_accepted >= 1).double().mean()) - 0.3) < 0.02


def test_filters_apply_to_target_and_draft():
    t = knobs(N, temperature=0.9, top_k=4, top_p=0.8, seed_base=5)
    expected = processed_probs(P.log().expand(1, 1, -1), torch.zeros((1, 0), dtype=torch.int64),
                               knobs(1, temperature=0.9, top_k=4, top_p=0.8))[0, 0]
    assert (expected > 0).sum() <= 4 and expected[4:].eq(0).all()
    draft_logits = Q.log().expand(N, K, -1).contiguous()
    q = processed_probs(draft_logits, torch.zeros((N, K), dtype=torch.int64), t)
    assert (q[0, 0] > 0).sum() <= 4 and q[0, 0, :4].eq(0).all()  # the draft's own top tokens
    # The draft may propose anything in its filtered support; the output still follows the
    # target's filtered distribution, never a token the target's filters removed.
    proposed = torch.stack([draft_race(q[:, j].log(), t.seeds, t.steps + j) for j in range(K)], 1)
    out = verify(P.log().expand(N, K + 1, -1).contiguous(), proposed, torch.full((N,), K), t, q)
    assert chi2_pvalue(out.token_ids[:, 0], expected) > 1e-3


def test_penalties_count_earlier_proposals_at_each_position():
    torch.manual_seed(2)
    logits = torch.randn(1, K + 1, VOCAB)
    proposed = torch.tensor([[4, 4, 7]])
    pen = penalties_for([1, 2], [2, 4])
    t = knobs(1, temperature=1.0, penalties=pen)
    probs = processed_probs(logits, proposed, t)
    for j in range(K + 1):
        manual = penalties_for([1, 2], [2, 4] + proposed[0, :j].tolist())
        assert torch.allclose(probs[0, j], apply_penalties(logits[:, j], manual).softmax(-1)[0])
        # one position alone (a draft step) gives the same floats as the whole row's
        alone = verify_module.adjusted(logits[:, j : j + 1], proposed[:, :j], t, first=j)
        assert torch.equal(alone.softmax(-1)[0, 0], probs[0, j])


def test_seeded_results_are_reproducible_and_batch_independent():
    torch.manual_seed(4)
    n, vocab = 24, 30
    logits = torch.randn(n, K + 1, vocab)
    q = torch.randn(n, K, vocab).softmax(-1)
    proposed = torch.randint(0, vocab, (n, K))
    lengths = torch.randint(0, K + 1, (n,))
    temperature = torch.where(torch.arange(n) % 5 == 0, 0.0, 0.7)  # some greedy rows
    t = knobs(n, temperature=temperature, top_p=0.95)
    full = verify(logits, proposed, lengths, t, q)
    again = verify(logits, proposed, lengths, t, q)
    assert torch.equal(full.token_ids, again.token_ids)
    perm = torch.randperm(n)
    tp = knobs(n, temperature=temperature[perm], top_p=0.95, steps=t.steps[perm])
    tp.seeds = t.seeds[perm]
    permuted = verify(logits[perm], proposed[perm], lengths[perm], tp, q[perm])
    assert torch.equal(permuted.token_ids, full.token_ids[perm])
    for row in (0, 3, 17):
        alone = knobs(1, temperature=temperature[row : row + 1], top_p=0.95,
                      steps=t.steps[row : row + 1], seed_base=int(t.seeds[row]))
        one = verify(logits[row : row + 1], proposed[row : row + 1], lengths[row : row + 1],
                     alone, q[row : row + 1])
        assert torch.equal(one.token_ids[0], full.token_ids[row])
    greedy = verify(logits[:1], proposed[:1], lengths[:1], SamplingTensors.greedy())
    assert torch.equal(greedy.token_ids[0], full.token_ids[0])  # row 0 is greedy
    other = knobs(n, temperature=temperature, top_p=0.95, seed_base=99_999)
    assert not torch.equal(verify(logits, proposed, lengths, other, q).token_ids, full.token_ids)


def test_verify_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="positions"):
        verify(torch.zeros(1, 2, 5), torch.zeros((1, 3), dtype=torch.int64),
               torch.zeros(1, dtype=torch.int64), SamplingTensors.greedy())


# ---------------------------------------------------------------- adaptive depth


def controller(**kwargs):
    return DepthController(SpeculativeConfig(method="ngram", k=6, **kwargs))


def test_depth_follows_acceptance():
    high, mid = controller(), controller()
    for _ in range(8):
        high.record(6, 6)
        mid.record(3, 2)  # 2 accepted of 3 tested: 0.67
    assert high.depth == 6
    assert mid.depth == 2  # 0.67**2 = 0.44 >= 0.3 > 0.67**3
    assert controller(adaptive=False).depth == 6


def test_back_off_below_threshold_then_reprobe():
    c = controller(min_samples=8, reprobe_after=4, max_reprobe_after=10)
    assert c.depth == 6  # no estimate yet: probe at full depth
    for _ in range(3):
        c.record(6, 1)  # 1 of 2 tested: 0.5 < 0.55
    assert c.depth == 6  # 6 tested tokens, below min_samples: keep probing
    c.record(6, 1)
    assert c.backed_off and c.depth == 0 and c.acceptance is None
    for _ in range(4):
        assert c.depth == 0
        c.record(0, 0)
    assert c.depth == 6  # re-probe at full depth
    for _ in range(4):
        c.record(6, 1)  # the probe fails: wait twice as long
    waits = 0
    while c.depth == 0:
        c.record(0, 0)
        waits += 1
    assert waits == 8
    for _ in range(4):
        c.record(6, 1)  # fails again: doubling capped at max_reprobe_after
    waits = 0
    while c.depth == 0:
        c.record(0, 0)
        waits += 1
    assert waits == 10
    for _ in range(2):
        c.record(6, 6)  # a successful probe resets the back-off
    assert not c.backed_off and c.depth == 6
    for _ in range(30):
        c.record(6, 0)
        if c.backed_off:
            break
    waits = 0
    while c.depth == 0:
        c.record(0, 0)
        waits += 1
    assert waits == 4


def test_controller_validates_and_reports_entropy_stop():
    c = controller(entropy_cutoff=2.0)
    with pytest.raises(ValueError, match="accepted"):
        c.record(2, 3)
    assert c.keeps_drafting(1.5) and not c.keeps_drafting(2.5)


# ---------------------------------------------------------------- draft model proposer

DRAFT = "models/noesis-tiny-draft"


@pytest.fixture(scope="module")
def draft_model():
    from noesis.engine.loading import load_model

    return load_model(DRAFT, "cpu", "float32", progress=False)


def draft_proposer(loaded, num_pages=64):
    from noesis.speculative.draft import DraftProposer

    return DraftProposer(loaded, num_pages=num_pages, page_size=4, max_model_len=512)


def test_draft_cache_reuse_matches_a_fresh_draft(draft_model):
    # Rounds of "verify": keep a random prefix of the proposals, then a token of our own.
    # The cached proposer (rolling back rejected drafts) must draft what a fresh one does.
    rng = random.Random(0)
    histories = [[1, 577, 1339, 1155, 436, 299], [1, 350, 285]]
    cached = draft_proposer(draft_model)
    for _ in range(4):
        proposals = cached.propose(["a", "b"], histories, [4, 3])
        fresh = draft_proposer(draft_model).propose(["a", "b"], histories, [4, 3])
        assert proposals.to_lists() == fresh.to_lists()
        assert [len(x) for x in proposals.to_lists()] == [4, 3]
        for history, guess in zip(histories, proposals.to_lists(), strict=True):
            history += guess[: rng.randrange(len(guess) + 1)] + [rng.randrange(8192)]


def test_draft_samples_with_the_request_knobs(draft_model):
    history = [1, 577, 1339, 1155, 436, 299, 350]
    t = knobs(3, temperature=torch.tensor([0.0, 0.8, 0.8]), top_k=5, seed_base=11,
              steps=torch.tensor([7, 7, 7]))
    out = draft_proposer(draft_model).propose(["g", "s", "z"], [history] * 3, [4, 4, 0], t)
    q = out.draft_probs
    assert q.shape == (3, 4, 8192) and torch.allclose(q[:2].sum(-1), torch.ones(2, 4))
    assert ((q[1] > 0).sum(-1) <= 5).all()  # the top-k filter shaped q
    assert out.num_proposed.tolist() == [4, 4, 0]
    assert (q[1].gather(1, out.proposed[1, :, None]) > 0).all()  # sampled inside q's support
    greedy = draft_proposer(draft_model).propose(["g"], [history], [4])
    assert out.proposed[0].tolist() == greedy.proposed[0].tolist()  # temperature 0 = argmax
    # The same row alone draws the same tokens (keyed by seed and step, not by the batch).
    alone = knobs(1, temperature=0.8, top_k=5, seed_base=12, steps=torch.tensor([7]))
    one = draft_proposer(draft_model).propose(["s"], [history], [4], alone)
    assert one.proposed[0].tolist() == out.proposed[1].tolist()


@pytest.mark.parametrize("head", [None, 2048], ids=["whole-head", "cut-head"])
def test_plain_greedy_drafting_equals_the_widened_path(draft_model, monkeypatch, head):
    """Plain greedy rows (the argmax and the entropy cut-off's entropies from the head's own
    rows) draft what the same rows drafted through the sampler's processing do (forced here by
    neutral penalties: repetition 1, presence and frequency 0), with an entropy cut-off that
    cuts some positions, over rounds of accepted prefixes, batched."""
    from noesis.speculative import draft as draft_module

    seen: list[list[torch.Tensor]] = []
    cut_lengths = draft_module.lengths_under_entropy

    def recording(entropy, depth, cutoff):
        seen[-1].append(entropy.clone())
        return cut_lengths(entropy, depth, cutoff)

    monkeypatch.setattr(draft_module, "lengths_under_entropy", recording)
    vocab = draft_model.config.vocab_size
    neutral = Penalties(torch.ones(2), torch.zeros(2), torch.zeros(2),
                        torch.zeros((2, vocab)), torch.zeros((2, vocab), dtype=torch.bool))
    greedy = dataclasses.replace(knobs(2, temperature=0.0), all_greedy=True)
    runs = []
    for sampling in (None, dataclasses.replace(greedy, penalties=neutral)):
        proposer = draft_proposer(draft_model)
        proposer.entropy_cutoff = 4.0
        if head is not None:
            proposer.restrict_head(range(head))
        histories = [[1, 577, 1339, 1155, 436, 299], [1, 350, 285]]
        rng, outs = random.Random(0), []
        seen.append([])
        for depth in (4, 3, 5):
            out = proposer.propose(["a", "b"], histories, [depth, 2], sampling)
            outs.append((out.proposed.tolist(), out.num_proposed.tolist()))
            for history, guess in zip(histories, out.to_lists(), strict=True):
                history += guess[: rng.randrange(len(guess) + 1)] + [rng.randrange(8192)]
        runs.append(outs)
    assert runs[0] == runs[1]
    lengths = [n for _, counts in runs[0] for n in counts]
    assert any(0 < n < d for n, d in zip(lengths, [4, 2, 3, 2, 5, 2], strict=True))  # some cut
    for plain, widened in zip(seen[0], seen[1], strict=True):
        assert torch.allclose(plain, widened, atol=1e-5)


def test_draft_pages_run_out_and_come_back(draft_model):
    proposer = draft_proposer(draft_model, num_pages=3)  # pages of 4 slots
    out = proposer.propose(["a", "b"], [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]], [4, 4])
    # a writes 6 + 3 positions (3 pages); b would need 3 more: it proposes nothing this step.
    assert out.num_proposed.tolist() == [4, 0]
    assert proposer.allocator.num_free == 0
    proposer.release("a")
    assert proposer.allocator.num_free == 3
    assert proposer.propose(["b"], [[1, 2, 3, 4, 5, 6, 7, 8]], [4]).num_proposed.tolist() == [4]


def test_draft_must_share_the_target_vocabulary():
    from noesis.speculative.draft import DraftProposer

    with pytest.raises(ConfigError, match="vocabulary of 8192"):
        DraftProposer.load(DRAFT, target_vocab_size=32000, device="cpu", dtype="float32")


def test_bundled_pair_speculates_token_identically_in_the_engine():
    """The bundled pair through the engine: greedy output with the draft speculating equals
    plain greedy (the same engine with its speculator set aside), alone and batched, and the
    draft is accepted most of the time. Prompt lookup on the same engine: the model repeats
    its phrases, so some lookups are accepted, and the output is again plain greedy's."""
    from noesis import LLM, SamplingParams
    from noesis.speculative.speculator import Speculator

    config = SpeculativeConfig(method="draft", draft=DRAFT, k=4)
    llm = LLM("models/noesis-tiny", device="cpu", dtype="float32", progress=False,
              speculative=config, max_num_seqs=4, max_model_len=256)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(text) for text in
               ("Once upon a time, the little robot", "A week has seven days. A year")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    speculated = [llm.generate(prompts[:1], params)[0], *llm.generate(prompts, params)]
    speculator, llm.engine.speculator = llm.engine.speculator, None
    plain = llm.generate(prompts, params)
    expected = [plain[0].token_ids, *(o.token_ids for o in plain)]
    assert [o.token_ids for o in speculated] == expected
    proposed = sum(o.spec_proposed for o in speculated)
    assert proposed > 0 and sum(o.spec_accepted for o in speculated) / proposed > 0.5
    assert speculator.proposer.allocator.num_free == speculator.proposer.allocator.num_pages

    repeating = tokenizer.encode("A square has four equal sides. A triangle has three. A square")
    (repeated,) = llm.generate([repeating], params)
    lookup = SpeculativeConfig(method="ngram", k=4, adaptive=False)
    llm.engine.speculator = Speculator(lookup, NgramProposer(lookup.ngram_max, lookup.ngram_min))
    looked_up = llm.generate([*prompts, repeating], params)
    assert [o.token_ids for o in looked_up] == [*expected[1:], repeated.token_ids]
    assert looked_up[-1].spec_accepted > 0


def test_row_argmax_equals_torch_over_positions_with_ties():
    torch.manual_seed(5)
    x = torch.randint(0, 7, (3, 4, 1024)).float()  # many equal maxima: the lowest index wins
    assert torch.equal(verify_module.row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(verify_module.row_argmax(x[:, 1]), x[:, 1].argmax(dim=-1))
