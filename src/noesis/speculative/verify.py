"""Verification: which proposals the target keeps, and the token that follows them. On the device,
batched over rows, no host sync; a pure-torch reference whose shapes suit a later fused kernel.

Greedy rows accept while a proposal equals the target's argmax. Sampled rows use modified
rejection sampling: proposal x at position j is accepted with probability min(1, p_j(x) /
q_j(x)); at the first rejection the token is drawn from the residual max(0, p_j - q_j)
(normalized), and when every proposal is accepted a bonus token is drawn from the next position's
p. Each emitted token then follows the target distribution exactly. p and q are the
distributions the non-speculative sampler would sample from: the grammar's mask at that
position (target only), penalties (with the proposals before a position counted as output),
logit bias, temperature, then top-k / top-p / min-p. Logprobs, when asked, are the plain
sampler's: the masked target logits' log-softmax at each emitted token's position.

Randomness is the sampler's counter-based noise (noise.uniform_at), keyed by (seed, step,
column): columns below 2**24 are vocabulary ids and belong to the sampler's own race; the
acceptance uniforms, the residual draw and a draft model's sampling use the disjoint column
ranges below, so they never reuse the sampling noise nor each other's. The bonus token is the
sampler's own draw at its step: with no proposal, verify emits exactly what `sample` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.sampling.noise import exponential_at, uniform_at
from noesis.sampling.sampler import (
    LogitBias,
    Penalties,
    SamplingTensors,
    apply_penalties,
    argmax,
    filter_logits,
    logprobs_of,
)
from noesis.structured.bitmask import apply_token_bitmask_

MAX_VOCAB = 1 << 24  # vocabulary ids occupy noise columns [0, 2**24)
ACCEPT_COLUMN = 1 << 24  # one column per (seed, step): the acceptance uniform
RESIDUAL_COLUMN = 2 << 24  # + token id: the race that draws from the residual
DRAFT_COLUMN = 3 << 24  # + token id: a draft model's own sampling race


@dataclass(slots=True)
class VerifyOutput:
    num_accepted: torch.Tensor  # [n] long, 0..num_proposed
    next_token: torch.Tensor  # [n] long: the correction, or the bonus when all were accepted
    # [n, k + 1] long: the accepted proposals, then next_token, then -1 (what the row emits)
    token_ids: torch.Tensor
    # When the rows asked for logprobs, per position of token_ids (past the row's tokens: the
    # logprobs of token 0, never read): the token's logprob [n, k + 1], the top ids and their
    # logprobs [n, k + 1, K], as sampler.logprobs_of reports them for a plain step's token.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def verify(target_logits: torch.Tensor, proposed: torch.Tensor, num_proposed: torch.Tensor,
           t: SamplingTensors, draft_probs: torch.Tensor | None = None,
           bitmask: torch.Tensor | None = None) -> VerifyOutput:
    """Judge each row's proposals against the target.

    target_logits [n, k + 1, V] float, contiguous: the raw logits at the row's k + 1 verified
    positions (position j predicts the token after the j-th proposal). proposed [n, k] long
    (padding past num_proposed is ignored), num_proposed [n] long. draft_probs [n, k, V] from
    `processed_probs` on the draft's logits, or None for a deterministic proposer (q one-hot).
    t: the rows' knobs as the sampler takes them; t.steps is the step of position 0.
    bitmask [n, k + 1, W] int32: the tokens each position's grammar state allows (position j:
    after the row's matcher consumed proposals[:j]; all ones for a free row), or None. It is
    applied to target_logits in place, as a plain step masks its logits: a proposal the grammar
    forbids has p = 0 and is rejected, and so is everything after it.
    """
    n, positions, vocab = target_logits.shape
    if positions != proposed.shape[1] + 1:
        raise ValueError(f"target_logits has {positions} positions for k={proposed.shape[1]}")
    if vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary of {vocab} exceeds the noise's {MAX_VOCAB} columns")
    if bitmask is not None:
        apply_token_bitmask_(target_logits.view(n * positions, vocab),
                             bitmask.view(n * positions, -1))
    logits = adjusted(target_logits, proposed, t)
    greedy_accepted, greedy_next = _verify_greedy(logits, proposed, num_proposed)
    if t.all_greedy:
        out = _output(proposed, greedy_accepted, greedy_next)
    else:
        accepted, next_token = _verify_sampled(logits, proposed, num_proposed, t, draft_probs)
        greedy_rows = t.temperature == 0
        accepted = torch.where(greedy_rows, greedy_accepted, accepted)
        next_token = torch.where(greedy_rows, greedy_next, next_token)
        out = _output(proposed, accepted, next_token)
    if t.max_logprobs is not None:
        out.logprobs = _emitted_logprobs(target_logits, out.token_ids, t.max_logprobs)
    return out


def processed_probs(logits: torch.Tensor, proposed: torch.Tensor,
                    t: SamplingTensors) -> torch.Tensor:
    """The distribution each position samples from: logits [n, m, V] (m <= k + 1, a draft's
    m = k) -> probabilities [n, m, V], the sampler's processing with proposals[:j] counted as
    output at position j. Greedy rows get their temperature-1 distribution."""
    return scores(adjusted(logits, proposed, t), t).softmax(dim=-1)


def adjusted(logits: torch.Tensor, proposed: torch.Tensor, t: SamplingTensors,
             first: int = 0) -> torch.Tensor:
    """What the sampler does to the (masked) logits before temperature, at every position:
    penalties, position j counting proposals[:j] as generated, then the logit bias. The m
    positions of logits are first .. first + m - 1 (a draft step: its one position)."""
    return biased(penalized(logits, proposed, t.penalties, first), t.logit_bias)


def biased(logits: torch.Tensor, bias: LogitBias | None) -> torch.Tensor:
    """apply_logit_bias at every position: logits [n, m, V] plus each row's biases. Added as
    a dense [n, V] row (0 where a row has no bias), which gives the same floats as the
    sampler's scatter: a row's entries name distinct tokens, and x + 0.0 is x."""
    if bias is None:
        return logits
    n, _, vocab = logits.shape
    dense = logits.new_zeros((n, vocab))
    dense.index_put_((bias.rows, bias.token_ids), bias.values.to(logits.dtype), accumulate=True)
    return logits + dense[:, None, :]


def penalized(logits: torch.Tensor, proposed: torch.Tensor, penalties: Penalties | None,
              first: int = 0) -> torch.Tensor:
    """apply_penalties at every position, position j counting proposals[:j] as generated;
    logits [n, m, V] hold positions first .. first + m - 1."""
    if penalties is None:
        return logits
    n, m, vocab = logits.shape
    onehot = torch.nn.functional.one_hot(proposed, vocab).to(logits.dtype)  # [n, k, V]
    before = torch.cat([onehot.new_zeros((n, 1, vocab)), onehot.cumsum(dim=1)], dim=1)
    before = before[:, first : first + m]
    counts = penalties.output_counts[:, None] + before  # [n, m, V]
    seen = penalties.seen_mask[:, None] | (before > 0)
    flat = Penalties(
        penalties.repetition.repeat_interleave(m), penalties.presence.repeat_interleave(m),
        penalties.frequency.repeat_interleave(m), counts.reshape(n * m, vocab),
        seen.reshape(n * m, vocab),
    )
    return apply_penalties(logits.reshape(n * m, vocab), flat).reshape(n, m, vocab)


def scores(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature then filters, as the sampler applies them: [n, m, V] -> [n, m, V], -inf
    where a filter removed the token. Greedy rows are scaled by 1."""
    if t.all_greedy:
        return logits
    n, m, vocab = logits.shape
    temperature = torch.where(t.temperature == 0, torch.ones_like(t.temperature), t.temperature)
    scaled = logits / temperature[:, None, None]
    if t.top_k is None and t.top_p is None and t.min_p is None:
        return scaled
    filtered = filter_logits(scaled.reshape(n * m, vocab), _per_position(t.top_k, m),
                             _per_position(t.top_p, m), _per_position(t.min_p, m))
    return filtered.reshape(n, m, vocab)


def draft_race(draft_scores: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor):
    """A draft model's sample from its processed scores [n, V] at `steps` [n]: the sampler's
    race on the DRAFT_COLUMN noise, independent of the target's sampling and acceptance."""
    columns = torch.arange(draft_scores.shape[-1], device=draft_scores.device) + DRAFT_COLUMN
    noise = exponential_at(seeds, steps, columns)
    return row_argmax(draft_scores - noise.log())


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension of x [..., V] -> [...], lowest index of equals, through the
    sampler's two-stage argmax: torch's one pass runs a block per row (27 us for a row of 128k
    on an H200, paid per drafted token and per verify)."""
    return argmax(x.reshape(-1, x.shape[-1]).float().contiguous()).view(x.shape[:-1])


def _emitted_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int):
    """logprobs_of at every position: raw [n, m, V], token_ids [n, m] (-1 past the row's
    tokens) -> [n, m], [n, m, k], [n, m, k]."""
    n, m, vocab = raw.shape
    ids = token_ids.clamp(min=0).reshape(n * m)
    chosen, top_ids, top_logprobs = logprobs_of(raw.reshape(n * m, vocab), ids, k)
    return chosen.view(n, m), top_ids.view(n, m, k), top_logprobs.view(n, m, k)


def _verify_greedy(logits, proposed, num_proposed):
    """Accept while the proposal is the argmax; the next token is the argmax after them."""
    best = row_argmax(logits)  # [n, k + 1]
    k = proposed.shape[1]
    match = (proposed == best[:, :k]) & _valid(num_proposed, k)
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def _verify_sampled(logits, proposed, num_proposed, t, draft_probs):
    row_scores = scores(logits, t)  # [n, k + 1, V]
    probs = row_scores.softmax(dim=-1)
    k = proposed.shape[1]
    p_at = probs[:, :k].gather(2, proposed[..., None])[..., 0]  # [n, k]
    q_at = (torch.ones_like(p_at) if draft_probs is None
            else draft_probs.gather(2, proposed[..., None])[..., 0])
    u = _acceptance_uniforms(t.seeds, t.steps, k)
    # u * q <= p accepts with probability min(1, p / q); p > 0 keeps filtered tokens out.
    accept = (p_at > 0) & (u * q_at <= p_at) & _valid(num_proposed, k)
    accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rejected = accepted < num_proposed
    p_next = _at_position(probs, accepted)  # [n, V]
    weights = row_scores.gather(1, _position_index(accepted, row_scores))[:, 0]
    if k > 0:
        q_next = _draft_at(draft_probs, proposed, accepted.clamp(max=k - 1), p_next)
        residual = _residual(p_next, q_next)
        weights = torch.where(rejected[:, None], residual.log(), weights)
    column = torch.where(rejected, RESIDUAL_COLUMN, 0)  # the bonus is the sampler's own draw
    return accepted, _race(weights, t.seeds, t.steps + accepted, column)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalized (the race needs no normalization); p itself when p == q
    leaves nothing (then no proposal can be rejected, so the row is never used)."""
    residual = (p - q).clamp(min=0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def _acceptance_uniforms(seeds, steps, k):
    """u [n, k] in (0, 1), one per (seed, step of position j)."""
    n = seeds.shape[0]
    position_steps = (steps[:, None] + torch.arange(k, device=steps.device)).reshape(-1)
    column = torch.full((n * k, 1), ACCEPT_COLUMN, dtype=torch.int64, device=seeds.device)
    return uniform_at(seeds.repeat_interleave(k), position_steps, column).reshape(n, k)


def _race(log_weights, seeds, steps, column_base):
    """argmax(log w - log E) over the vocabulary: a draw proportional to w, E ~ Exp(1) from
    (seed, step, column_base + token)."""
    vocab = log_weights.shape[-1]
    columns = torch.arange(vocab, device=log_weights.device)[None, :] + column_base[:, None]
    noise = exponential_at(seeds, steps, columns)  # [n, V]
    return row_argmax(log_weights - noise.log())


def _draft_at(draft_probs, proposed, position, like):
    """q at one position per row [n, V]: the draft's row, or one-hot at a deterministic guess."""
    if draft_probs is not None:
        return _at_position(draft_probs, position)
    token = proposed.gather(1, position[:, None])
    return torch.zeros_like(like).scatter_(1, token, 1.0)


def _at_position(x, position):
    return x.gather(1, _position_index(position, x))[:, 0]


def _position_index(position, x):
    return position[:, None, None].expand(-1, 1, x.shape[-1])


def _per_position(knob, m):
    """A row knob [n] repeated for each of the row's m positions [n * m], or None."""
    return None if knob is None else knob.repeat_interleave(m)


def _valid(num_proposed, k):
    return torch.arange(k, device=num_proposed.device)[None, :] < num_proposed[:, None]


def _output(proposed, accepted, next_token) -> VerifyOutput:
    n, k = proposed.shape
    position = torch.arange(k + 1, device=proposed.device)[None, :]
    padded = torch.cat([proposed, proposed.new_zeros((n, 1))], dim=1)
    token_ids = torch.where(position < accepted[:, None], padded, -1)
    token_ids = torch.where(position == accepted[:, None], next_token[:, None], token_ids)
    return VerifyOutput(accepted, next_token, token_ids)
