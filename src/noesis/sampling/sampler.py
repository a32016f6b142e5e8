"""On-device sampling: penalties, logit bias, temperature, top-k/p, min-p, seeded race, logprobs.

Everything is batched tensor work with no host sync; the runner copies the result back once.
Logprobs are those of the model's own distribution (log-softmax of the raw logits); metrics
(noesis.sampling.metrics) those of the distribution sampled from, after masks and penalties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.kernels import ops
from noesis.sampling.metrics import token_metrics
from noesis.sampling.noise import exponential, exponential_at


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling knobs for one step, on the logits' device."""

    temperature: torch.Tensor | None  # [B] float; 0 means greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row filters
    top_p: torch.Tensor | None  # [B] float
    min_p: torch.Tensor | None  # [B] float
    seeds: torch.Tensor | None  # [B] int64
    steps: torch.Tensor | None  # [B] int64: index of the token being sampled in its request
    all_greedy: bool
    penalties: Penalties | None = None
    max_logprobs: int | None = None  # largest k any row asked for
    metrics: bool = False  # some row asked for per-token metrics
    logit_bias: LogitBias | None = None  # some row asked for logit_bias

    @classmethod
    def greedy(cls, max_logprobs: int | None = None, metrics: bool = False) -> SamplingTensors:
        """Plain argmax for every row: no per-row tensors to build or copy."""
        return cls(None, None, None, None, None, None, all_greedy=True, max_logprobs=max_logprobs,
                   metrics=metrics)  # fmt: skip


@dataclass(slots=True)
class Penalties:
    repetition: torch.Tensor  # [B] float, 1 = off
    presence: torch.Tensor  # [B] float
    frequency: torch.Tensor  # [B] float
    output_counts: torch.Tensor  # [B, V] float: occurrences among generated tokens
    seen_mask: torch.Tensor  # [B, V] bool: occurs in prompt or output


@dataclass(slots=True)
class LogitBias:
    """Every row's logit_bias entries, flattened: entry i adds values[i] to logit
    [rows[i], token_ids[i]]."""

    rows: torch.Tensor  # [N] long
    token_ids: torch.Tensor  # [N] long
    values: torch.Tensor  # [N] float


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long, always valid ids (they may feed the next step)
    token_logprobs: torch.Tensor | None  # [B]
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]
    # [B] long: the ids the host reads, where -1 marks a row whose logits held NaN or +inf or
    # allowed no token at all (every logit -inf), so that request alone can end with an error
    reported_ids: torch.Tensor | None = None
    metrics: torch.Tensor | None = None  # [B, NUM_METRICS] when asked (sampling.metrics)


# The per-row check behind SamplerOutput.reported_ids (benchmarks/fault_check_cost.py times the
# sampler with it off). On CUDA the race kernels fold it into their own pass over the logits.
CHECK_ROWS = True


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits [B, V] float32 -> sampled ids [B] (+ logprobs when asked)."""
    raw = logits
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    if t.logit_bias is not None:
        logits = apply_logit_bias(logits, t.logit_bias)
    if t.all_greedy:
        token_ids, reported = _argmax_reported(logits)
    else:
        token_ids, reported = _sample_random(logits, t)
    metrics = token_metrics(logits) if t.metrics else None
    if t.max_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, reported, metrics)
    token_logprobs, top_ids, top_logprobs = logprobs_of(raw, token_ids, t.max_logprobs)
    return SamplerOutput(token_ids, token_logprobs, top_ids, top_logprobs, reported, metrics)


def logprobs_of(raw: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Under the model's own distribution (log-softmax of raw logits [N, V]): the logprobs of
    `token_ids` [N], and the top-k ids and logprobs [N, k] (k may be 0). Prompt logprobs are
    these too, with the prompt's next tokens as `token_ids`."""
    logprobs = torch.log_softmax(raw, dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
    top_logprobs, top_ids = (
        logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], token_ids[:, None][:, :0])
    )
    return token_logprobs, top_ids, top_logprobs


def _reported_ids(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
    """token_ids, or -1 where the row maximum is NaN, +inf or -inf: exactly when the row cannot
    give a token (NaN from a broken forward, or a mask that left nothing). On the device, no
    sync. (The Triton paths get the same from their race kernels instead.)"""
    if not CHECK_ROWS:
        return None
    return torch.where(torch.isfinite(logits.amax(dim=-1)), token_ids, -1)


def _argmax_reported(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if CHECK_ROWS and _triton_race(logits):
        return ops.greedy_argmax(logits, report=True)
    token_ids = argmax(logits)
    return token_ids, _reported_ids(logits, token_ids)


def _triton_race(x: torch.Tensor) -> bool:
    return ops.use_triton(x) and x.dtype == torch.float32 and x.stride(-1) == 1


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    rep = p.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(p.seen_mask, penalized, logits)
    logits = logits - p.frequency[:, None] * p.output_counts
    return logits - p.presence[:, None] * (p.output_counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """logits plus each row's biases, out of place. A token a grammar masked (-inf) stays
    masked, since -inf plus a finite bias is -inf; logprobs are still the raw model's."""
    return logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)


def _sample_random(logits: torch.Tensor, t: SamplingTensors):
    """(sampled ids, reported ids) for a batch with at least one row that samples."""
    filtering = t.top_k is not None or t.top_p is not None or t.min_p is not None
    if not filtering and ops.use_triton(logits):
        # One fused kernel instead of ~20 elementwise passes over [B, V] (the noise hash alone
        # is a dozen): ~1.4 ms less per step at batch 1 on a 128k vocabulary (H200).
        if not CHECK_ROWS:
            return ops.exponential_race(logits, t.temperature, t.seeds, t.steps), None
        return ops.exponential_race(logits, t.temperature, t.seeds, t.steps, report=True)
    greedy_rows = t.temperature == 0
    temperature = torch.where(greedy_rows, torch.ones_like(t.temperature), t.temperature)
    scaled = logits / temperature[:, None]
    if filtering and logits.device.type == "cpu" and not ops.use_triton(logits):
        sampled = _race_filtered_on_host(scaled, t)
    else:
        if filtering:
            scaled = filter_logits(scaled, t.top_k, t.top_p, t.min_p)
        if ops.use_triton(scaled) and scaled.dtype == torch.float32 and scaled.stride(-1) == 1:
            # The same race over the filtered, already scaled logits (T = 1 divides by one
            # exactly): the tokens _race would pick, without its passes over [B, V].
            sampled = ops.exponential_race(scaled, torch.ones_like(temperature), t.seeds, t.steps)
        else:
            sampled = _race(scaled, t.seeds, t.steps)
    token_ids = torch.where(greedy_rows, argmax(logits), sampled)
    return token_ids, _reported_ids(logits, token_ids)


def _race(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) over the whole vocabulary, E ~ Exp(1) from (seed, step, token)."""
    if scaled.device.type == "cpu":
        return _race_in_blocks(scaled, seeds, steps)
    noise = exponential(seeds, steps, scaled.shape[-1])
    # argmax(p / E) == argmax(log p - log E); log-space keeps tiny probabilities apart.
    return argmax(scaled - noise.log())


# On the CPU the noise hash's ~20 passes over [B, V] int64 temporaries fall out of the cache
# from a few rows of a 128k vocabulary on; blocks of about this many entries stay in it. On the
# 2-core workstation (benchmarks/sampling.py, 128k vocabulary): batch 32 87-131 ms -> 31-41 per
# call; batch 8 from no gain to 2x, by run (the VM is noisy); batch 1, one block, unchanged.
RACE_BLOCK_ENTRIES = 1 << 18


def _race_in_blocks(scaled: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """_race, a block of the vocabulary at a time, each block's best kept when strictly better
    than the blocks before it (so ties still go to the lowest index; an all -inf row to 0)."""
    batch, vocab = scaled.shape
    block = max(4096, RACE_BLOCK_ENTRIES // max(batch, 1))
    best = torch.full((batch,), float("-inf"), dtype=scaled.dtype)
    index = torch.zeros(batch, dtype=torch.int64)
    for start in range(0, vocab, block):
        ids = torch.arange(start, min(vocab, start + block))
        scores = scaled[:, start : start + block] - exponential_at(seeds, steps, ids).log()
        value, at = scores.max(dim=-1)
        better = value > best
        best = torch.where(better, value, best)
        index = torch.where(better, at + start, index)
    return index


# A filtered row on the CPU races only its candidates: the CANDIDATES best tokens (more when its
# nucleus or its top-k is wider), not a sorted and hashed vocabulary.
CANDIDATES = 256


def _race_filtered_on_host(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """What filter_logits then _race pick, for rows whose device can be asked for a count at no
    cost (the CPU): filtered rows race their candidates (_race_candidates), rows without a
    filter the whole vocabulary; greedy rows are left to the caller (0 here)."""
    batch = scaled.shape[0]
    top_k = t.top_k if t.top_k is not None else torch.zeros(batch, dtype=torch.int64)
    top_p = t.top_p if t.top_p is not None else torch.ones(batch)
    min_p = t.min_p if t.min_p is not None else torch.zeros(batch)
    greedy = t.temperature == 0
    filtered = ((top_k > 0) | (top_p < 1) | (min_p > 0)) & ~greedy
    if bool(filtered.all()):  # one request, or a batch of like ones
        return _race_candidates(scaled, top_k, top_p, min_p, t.seeds, t.steps)
    sampled = torch.zeros(batch, dtype=torch.int64)
    rows = filtered.nonzero()[:, 0]
    if len(rows):
        sampled[rows] = _race_candidates(
            scaled[rows], top_k[rows], top_p[rows], min_p[rows], t.seeds[rows], t.steps[rows]
        )
    rows = (~filtered & ~greedy).nonzero()[:, 0]
    if len(rows):
        sampled[rows] = _race(scaled[rows], t.seeds[rows], t.steps[rows])
    return sampled


def _race_candidates(scaled, top_k, top_p, min_p, seeds, steps) -> torch.Tensor:
    """filter_logits' rules on each row's best tokens alone, then the race among those kept.

    The kept tokens of a row are a prefix of its tokens by value: the top-k, then those whose
    better-ranked tokens hold less than top_p of what is left, then those within min_p of the
    best. So `topk` of a few hundred finds them unless a row keeps its last candidate; then the
    candidates grow eightfold and the rules run again. Probabilities are normalized over the
    whole row (or the top-k, which the candidates always cover), as filter_logits' softmax is;
    the noise is the full race's at the same token ids, and ties go to the lowest id, so the
    token is the one the full race over the filtered row picks."""
    batch, vocab = scaled.shape
    count = min(vocab, max(CANDIDATES, int(top_k.max())))
    row_lse = torch.logsumexp(scaled, dim=-1)
    while True:
        values, ids = scaled.topk(count, dim=-1)  # [B, count], best first
        in_top_k = (top_k == 0)[:, None] | (torch.arange(count) < top_k[:, None])
        values = values.masked_fill(~in_top_k, float("-inf"))
        lse = torch.where(top_k > 0, torch.logsumexp(values, dim=-1), row_lse)
        probs = (values - lse[:, None]).exp()
        before = probs.cumsum(dim=-1) - probs
        keep = in_top_k & (before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
        # Only a row without top-k can keep tokens past its last candidate.
        if count == vocab or not bool((keep[:, -1] & (top_k == 0)).any()):
            break
        count = min(vocab, count * 8)
    scores = torch.where(keep, values - exponential_at(seeds, steps, ids).log(), float("-inf"))
    best = scores.max(dim=-1, keepdim=True).values
    token = torch.where(scores == best, ids, vocab).min(dim=-1).values
    # A row with nothing left (every logit -inf): the full race's argmax answers token 0.
    return torch.where(best[:, 0] == float("-inf"), 0, token)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [B, V] -> [B] in two stages (chunk maxima, then the best chunk).

    A single-pass argmax over a 128k vocabulary runs one block per row and dominates a small
    model's decode step on a GPU; splitting the row spreads it over many blocks. Ties resolve to
    the lowest index, as torch.argmax does. On CUDA the two stages are two Triton launches
    (ops.greedy_argmax) rather than torch's five.
    """
    batch, vocab = x.shape
    if _triton_race(x):
        return ops.greedy_argmax(x)  # the same two stages in two launches
    chunks = _chunk_count(vocab)
    if chunks == 1:
        return x.argmax(dim=-1)
    values, index = x.view(batch, chunks, vocab // chunks).max(dim=-1)  # [B, C]
    best = values.argmax(dim=-1, keepdim=True)  # [B, 1]
    return (best * (vocab // chunks) + index.gather(1, best))[:, 0]


def _chunk_count(vocab: int) -> int:
    """Largest divisor of vocab up to 256 that leaves chunks of at least 256 entries."""
    for chunks in range(min(256, vocab // 256), 1, -1):
        if vocab % chunks == 0:
            return chunks
    return 1


def filter_logits(logits, top_k, top_p, min_p) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, then outside the top-p nucleus of what is left, or
    under min_p times the largest probability."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        rank = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_p is not None:
        # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
        before = probs.cumsum(dim=-1) - probs
        remove |= before >= top_p[:, None]
    if min_p is not None:
        remove |= probs < (min_p[:, None] * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
