"""DraftProposer: a small checkpoint that shares the target's tokenizer drafts each request's next
tokens. It keeps its own paged KV cache (its own pool and page allocator), so a step feeds only
the tokens the draft has not seen, then one decode per drafted token; no host sync while drafting.
With `capture_graphs` (CUDA) those k steps replay the draft's own decode graphs (the feed's
tokens as one row each), their inputs copied to the device in one transfer.

A draft may keep only some rows of its LM head (`restrict_head`, SpeculativeConfig.draft_vocab):
its logits over those tokens are widened back to the vocabulary with every other token at
OUTSIDE_HEAD, so that the sampler's processing and the distributions q stay the target's shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from noesis.engine.loading import LoadedModel, load_model
from noesis.errors import ConfigError
from noesis.kv.allocator import PageAllocator
from noesis.kv.cache import KVPool, page_bytes
from noesis.models.rope import RotaryEmbedding
from noesis.runner.cuda_graph import CudaGraphRunner
from noesis.runner.inputs import AttentionMetadata, PrefillSpan
from noesis.runner.runner import default_attention
from noesis.sampling.sampler import LogitBias, Penalties, SamplingTensors
from noesis.speculative.grammar import DraftGuide
from noesis.speculative.proposer import Proposals, entropy_of, lengths_under_entropy
from noesis.speculative.verify import adjusted, draft_race, row_argmax, scores
from noesis.structured.matcher import GrammarMatcher

# The logit of a token outside a restricted head: far below any real logit, so that its
# probability is exactly 0 after a softmax beside them, yet finite through temperatures and
# penalties, so that a row whose grammar allows only such tokens still gets a distribution
# (uniform over them) and a valid proposal instead of NaNs.
OUTSIDE_HEAD = -1e30


@dataclass(slots=True)
class _DraftSeq:
    """One request's place in the draft cache."""

    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading history tokens whose keys/values the cache holds
    # The last proposals [k] (host copy of a row, ready once `drafted_ready` is) and the history
    # length they followed: all but the last were fed, so those the target accepted are cached.
    drafted: torch.Tensor | None = None
    drafted_ready: torch.cuda.Event | None = None
    drafted_from: int = 0


class DraftProposer:
    """Proposer over a draft model: `propose` drafts max(depths) tokens for every row that asks
    for any (rows asking fewer are cut afterwards), sampling as the target's sampler would (the
    knobs in `sampling`, noise from verify.DRAFT_COLUMN) and returning the distributions q."""

    def __init__(self, loaded: LoadedModel, num_pages: int, page_size: int = 16,
                 max_model_len: int = 2048, attention=None,
                 entropy_cutoff: float = math.inf) -> None:
        config = loaded.config
        self.model, self.device, self.vocab_size = loaded.model, loaded.device, config.vocab_size
        self.kv = KVPool(config, num_pages, page_size, loaded.dtype, loaded.device)
        self.allocator = PageAllocator(num_pages, page_size)
        self.rope = RotaryEmbedding(config.rope, config.max_position_embeddings, max_model_len,
                                    loaded.device)
        self.attention = attention or default_attention(loaded.device, max_model_len)
        self.max_model_len = max_model_len
        self.entropy_cutoff = entropy_cutoff
        self._seqs: dict[object, _DraftSeq] = {}
        self.graphs: CudaGraphRunner | None = None
        self.head_ids: torch.Tensor | None = None  # the rows the LM head keeps (restrict_head)

    def restrict_head(self, token_ids: Sequence[int]) -> None:
        """Keep only these rows of the draft's LM head (before capture_graphs): each drafting
        step projects onto them alone and proposes only them. A tied head is copied out of the
        embedding, which stays whole; an untied one is replaced, freeing its other rows."""
        model = self.model
        if not hasattr(model, "lm_head"):
            raise ConfigError(
                f"SpeculativeConfig.draft_vocab: a {type(model).__name__} draft has no LM head "
                "to restrict; leave draft_vocab unset for it"
            )
        ids = sorted(set(token_ids))
        if not ids or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ConfigError(f"draft head rows must be token ids in [0, {self.vocab_size})")
        full = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        index = torch.tensor(ids, dtype=torch.int64, device=full.device)
        head = torch.nn.Linear(full.shape[1], len(ids), bias=False, device=full.device,
                               dtype=full.dtype)
        head.weight = torch.nn.Parameter(full.detach()[index].contiguous(), requires_grad=False)
        model.lm_head = head
        self.head_ids = index.to(self.device)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The argmax token of logits [r, V or H]: of a cut head's rows, the lowest id of
        equals as over the widened row (head_ids are sorted)."""
        token = row_argmax(logits)
        return token if self.head_ids is None else self.head_ids[token]

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the kept head rows [r, H] -> over the vocabulary [r, V] (the rest at
        OUTSIDE_HEAD); unchanged when the head is whole."""
        if self.head_ids is None:
            return logits
        wide = logits.new_full((logits.shape[0], self.vocab_size), OUTSIDE_HEAD)
        return wide.index_copy_(1, self.head_ids, logits)

    def capture_graphs(self, max_batch: int, capture: bool = True) -> float:
        """Capture the draft's decode graphs of up to `max_batch` rows; the seconds it took.
        capture=False (CPU, tests): the same buffers, their forward run eagerly."""
        self.graphs = CudaGraphRunner(self.model, self.kv, self.rope, self.attention, max_batch,
                                      self.max_model_len)
        if capture:
            self.graphs.capture()
        return self.graphs.capture_seconds

    @classmethod
    def load(cls, checkpoint: str, target_vocab_size: int, device="auto", dtype="auto",
             kv_memory: int | None = None, head_ids: Sequence[int] | None = None,
             **kwargs) -> DraftProposer:
        """Load the draft checkpoint; its vocabulary must be the target's (q rows align).
        With `kv_memory` (bytes), num_pages is capped to the pages that fit in it; with
        `head_ids`, the LM head keeps those rows only (restrict_head)."""
        loaded = load_model(checkpoint, device, dtype, progress=False)
        if loaded.config.vocab_size != target_vocab_size:
            raise ConfigError(
                f"SpeculativeConfig.draft: {checkpoint} has a vocabulary of "
                f"{loaded.config.vocab_size} tokens, the target {target_vocab_size}; the draft "
                "must share the target's tokenizer"
            )
        if kv_memory is not None:
            per_page = page_bytes(loaded.config, kwargs.get("page_size", 16), loaded.dtype)
            kwargs["num_pages"] = max(1, min(kwargs["num_pages"], kv_memory // per_page))
        proposer = cls(loaded, **kwargs)
        if head_ids is not None:
            proposer.restrict_head(head_ids)
        return proposer

    @torch.inference_mode()
    def propose(self, request_ids: Sequence[object], histories: Sequence[Sequence[int]],
                depths: Sequence[int], sampling: SamplingTensors | None = None,
                matchers: Sequence[GrammarMatcher | None] | None = None) -> Proposals:
        """matchers: each request's grammar, or None: its rows draft under the grammar's masks
        (speculative.grammar.DraftGuide), the matchers left as they were."""
        n, k = len(histories), max(depths, default=0)
        rows = [i for i in range(n) if depths[i] > 0
                and self._reserve(request_ids[i], histories[i], k)]
        proposed = torch.zeros((n, k), dtype=torch.int64, device=self.device)
        num_proposed = torch.zeros(n, dtype=torch.int64, device=self.device)
        # q only where verification reads it (a sampled batch); greedy drafts keep none
        sampled = sampling is not None and not sampling.all_greedy
        probs = torch.zeros((n, k, self.vocab_size), device=self.device) if sampled else None
        if rows:
            seqs = [self._seqs[request_ids[i]] for i in rows]
            index = self._tensor(rows)
            knobs = _select(sampling, index) if sampling is not None else None
            guide = None
            if matchers is not None and any(matchers[i] is not None for i in rows):
                guide = DraftGuide([matchers[i] for i in rows], self.vocab_size, self.device,
                                   per_token=self.device.type == "cpu")
            try:
                tokens, q, entropy = self._draft(seqs, [histories[i] for i in rows], k, knobs,
                                                 guide, keep_q=sampled)  # fmt: skip
            finally:
                if guide is not None:
                    guide.finish()
            depth = self._tensor([depths[i] for i in rows])
            proposed[index] = tokens
            if probs is not None:
                probs[index] = q
            num_proposed[index] = (depth if entropy is None else
                                   lengths_under_entropy(entropy, depth, self.entropy_cutoff))
        host, ready = self._copy_to_host(proposed)
        for i in rows:
            seq = self._seqs[request_ids[i]]
            seq.drafted, seq.drafted_ready = host[i], ready
        return Proposals(proposed, num_proposed, probs, host, ready)

    def release(self, request_id: object) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.allocator.free(seq.pages)

    def _reserve(self, request_id: object, history: Sequence[int], k: int) -> bool:
        """Sync the request's cache with its history and hold pages for k more tokens; False
        (no proposals this step) when the context or the pool is full."""
        if not history:
            return False
        seq = self._seqs.setdefault(request_id, _DraftSeq())
        _resync(seq, history)
        needed = len(history) + k - 1  # positions written: history, then k - 1 drafted tokens
        missing = self.allocator.pages_for(needed) - len(seq.pages)
        if needed > self.max_model_len or not self.allocator.can_allocate(max(missing, 0)):
            return False
        if missing > 0:
            seq.pages.extend(self.allocator.allocate(missing))
        return True

    def _draft(self, seqs, histories, k, knobs, guide=None, keep_q=True):
        """k tokens per row [r, k], their distributions [r, k, V] (masked by `guide`; None
        unless keep_q) and those distributions' entropies [r, k] (None when no cutoff reads
        them). Each step works on its own position only: the penalties at position j count
        drafted[:, :j]."""
        lengths = [len(h) for h in histories]
        drafted = torch.zeros((len(seqs), k), dtype=torch.int64, device=self.device)
        step_logits = self._graph_steps(seqs, histories, k)
        q, entropy, cut = [], [], self.entropy_cutoff != math.inf
        # Plain greedy rows (no grammar, penalties or bias, no distributions kept) read the
        # head's own rows: no vocabulary-wide row to fill and scan for a cut head.
        plain = (guide is None and not keep_q
                 and (knobs is None or (knobs.all_greedy and knobs.penalties is None
                                        and knobs.logit_bias is None)))  # fmt: skip
        for j in range(k):
            logits = (step_logits(j, drafted) if step_logits is not None else  # [r, V or H]
                      self._feed_history(seqs, histories) if j == 0 else
                      self._decode(seqs, drafted[:, j - 1], [n + j - 1 for n in lengths]))
            if plain:
                drafted[:, j] = self._greedy(logits)
                if cut:  # a softmax over the kept rows is the widened row's (0 elsewhere)
                    entropy.append(entropy_of(logits.softmax(dim=-1)))
                continue
            logits = self._widen(logits)
            if guide is not None:
                logits = guide.mask(j, logits, drafted)
            token, dist = _pick(logits, drafted[:, :j], knobs, j, want_q=keep_q or cut)
            drafted[:, j] = token
            if keep_q:
                q.append(dist)
            if cut:
                entropy.append(entropy_of(dist))
        for seq, history in zip(seqs, histories, strict=True):
            seq.num_cached, seq.drafted_from = len(history), len(history)
        return (drafted, torch.stack(q, dim=1) if keep_q else None,
                torch.stack(entropy, dim=1) if entropy else None)

    def _graph_steps(self, seqs, histories, k):
        """step(j, drafted) -> logits [r, V] of drafting step j through the graphs, or None
        when a step does not fit them (a new prompt's feed: then every step runs eagerly)."""
        graphs = self.graphs
        feed = [(tok, pos, seq.pages) for seq, history in zip(seqs, histories, strict=True)
                for pos, tok in enumerate(history[seq.num_cached :], start=seq.num_cached)]
        if graphs is None or max(len(feed), len(seqs)) > graphs.max_batch:
            return None
        last_rows, row = [], -1
        for seq, history in zip(seqs, histories, strict=True):
            row += len(history) - seq.num_cached
            last_rows.append(row)
        steps = [feed] + [[(0, len(h) + j - 1, seq.pages) for seq, h in
                           zip(seqs, histories, strict=True)] for j in range(1, k)]
        staged, last = graphs.stage(steps), self._tensor(last_rows)

        def step(j: int, drafted: torch.Tensor) -> torch.Tensor:
            if j == 0:
                return graphs.replay_staged(staged, 0, len(feed))[last]
            return graphs.replay_staged(staged, j, len(seqs), drafted[:, j - 1])

        return step

    def _copy_to_host(self, drafted: torch.Tensor):
        """drafted's host copy, started without waiting, and the event that marks it done:
        the next step reads it (after the verify step's own sync) to count the cached tokens,
        and the runner's grammar masks (speculative.grammar) walk it while the target runs."""
        if self.device.type != "cuda":
            return drafted, None
        host = torch.empty(drafted.shape, dtype=drafted.dtype, pin_memory=True)
        host.copy_(drafted, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _feed_history(self, seqs, histories) -> torch.Tensor:
        """Forward each row's uncached history tokens; logits [r, V] after its last token."""
        token_ids, positions, slots, last_rows, prefills, decodes = [], [], [], [], [], []
        for seq, history in zip(seqs, histories, strict=True):
            start, row = seq.num_cached, len(token_ids)
            count = len(history) - start
            token_ids.extend(history[start:])
            positions.extend(range(start, start + count))
            slots.extend(self._slot(seq, p) for p in range(start, start + count))
            last_rows.append(row + count - 1)
            if count == 1 and start > 0:
                decodes.append((row, seq, start + 1))
            else:
                pages = self._tensor(seq.pages[: self.allocator.pages_for(start + count)])
                prefills.append(PrefillSpan(row, count, start + count, pages))
        meta = self._metadata(slots, prefills, decodes)
        return self._forward(self._tensor(token_ids), positions, meta, last_rows)

    def _decode(self, seqs, token_ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """One drafted token per row (on the device) at `positions`; logits [r, V]."""
        slots = [self._slot(seq, p) for seq, p in zip(seqs, positions, strict=True)]
        decodes = [(row, seq, p + 1) for row, (seq, p) in enumerate(zip(seqs, positions,
                                                                         strict=True))]
        meta = self._metadata(slots, [], decodes)
        return self._forward(token_ids, positions, meta, list(range(len(seqs))))

    def _forward(self, input_ids, positions, meta, last_rows) -> torch.Tensor:
        positions = self._tensor(positions)
        # No sequence lengths: a length-dependent rope (dynamic NTK) rotates by the table, which
        # only costs the draft some accuracy at long contexts, never the output's exactness.
        cos, sin = self.rope.cos_sin(positions)
        hidden, residual = self.model(input_ids, cos, sin, self.kv.layers, meta, self.attention)
        rows = self._tensor(last_rows)
        residual = residual[rows] if residual is not None else None
        return self.model.compute_logits(hidden[rows], residual)  # [r, V or H] float32

    def _metadata(self, slots, prefills, decodes) -> AttentionMetadata:
        """decodes: (row, seq, context length) of single-token rows."""
        page_size = self.kv.page_size
        max_ctx = max((ctx for _, _, ctx in decodes), default=0)
        max_pages = self.allocator.pages_for(max_ctx)
        tables = [seq.pages[:max_pages] + [0] * (max_pages - len(seq.pages[:max_pages]))
                  for _, seq, _ in decodes]
        return AttentionMetadata(
            page_size=page_size,
            slot_mapping=self._tensor(slots),
            prefills=prefills,
            decode_rows=self._tensor([row for row, _, _ in decodes]),
            decode_pages=self._tensor(tables).view(len(decodes), max_pages),
            decode_ctx_lens=self._tensor([ctx for _, _, ctx in decodes]),
            max_decode_ctx=max_ctx,
        )

    def _slot(self, seq: _DraftSeq, position: int) -> int:
        page_size = self.kv.page_size
        return seq.pages[position // page_size] * page_size + position % page_size

    def _tensor(self, values) -> torch.Tensor:
        """A host list on the device; on CUDA through pinned memory, so the copy does not wait
        for the work already queued (as the runner's own inputs)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=torch.int64, device=self.device)
        host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
        return host.to(self.device, non_blocking=True)


def head_rows(vocab_size: int, size: int, always: Iterable[int] = ()) -> list[int]:
    """The rows a head of `size` keeps (SpeculativeConfig.draft_vocab): ids 0 .. size - 1,
    roughly a BPE or SentencePiece vocabulary's most frequent tokens, and the ids in `always`
    (control tokens, end of sequence) wherever they are."""
    return sorted(set(range(min(size, vocab_size))) | {i for i in always if 0 <= i < vocab_size})


def _resync(seq: _DraftSeq, history: Sequence[int]) -> None:
    """Count the cached tokens still valid: the history's, plus the fed drafted tokens the
    target accepted (read back here, after the verify step's own sync). At least the last
    history token is always fed again, since its logits start the draft."""
    if seq.drafted is not None:
        if seq.drafted_ready is not None:
            seq.drafted_ready.synchronize()  # done already: the verify step was read back
        drafted = seq.drafted.tolist()[:-1]  # the last drafted token was never fed
        accepted = history[seq.drafted_from : seq.drafted_from + len(drafted)]
        match = 0
        while match < len(accepted) and accepted[match] == drafted[match]:
            match += 1
        seq.num_cached, seq.drafted, seq.drafted_ready = seq.drafted_from + match, None, None
    seq.num_cached = min(seq.num_cached, len(history) - 1)


def _pick(logits, so_far, knobs, j, want_q=True):
    """The j-th drafted token per row and its distribution q [r, V] from the draft's logits
    at position j [r, V], as the target's sampler would pick (penalties counting the earlier
    drafted tokens so_far [r, j], temperature, filters: verify.processed_probs at one
    position). q is None for greedy rows when not wanted (a sampled row needs it)."""
    if knobs is None:
        return row_argmax(logits), logits.softmax(dim=-1) if want_q else None
    adjusted_j = adjusted(logits[:, None], so_far, knobs, first=j)  # [r, 1, V]
    greedy = row_argmax(adjusted_j[:, 0])
    if knobs.all_greedy and not want_q:
        return greedy, None
    q = scores(adjusted_j, knobs).softmax(dim=-1)[:, 0]
    if knobs.all_greedy:
        return greedy, q
    sampled = draft_race(q.log(), knobs.seeds, knobs.steps + j)
    return torch.where(knobs.temperature == 0, greedy, sampled), q


def _select(t: SamplingTensors, index: torch.Tensor) -> SamplingTensors:
    """The knobs of the chosen rows only (those the draft samples with)."""

    def pick(x):
        return None if x is None else x[index]

    penalties = None
    if t.penalties is not None:
        p = t.penalties
        penalties = Penalties(pick(p.repetition), pick(p.presence), pick(p.frequency),
                              pick(p.output_counts), pick(p.seen_mask))
    return SamplingTensors(pick(t.temperature), pick(t.top_k), pick(t.top_p), pick(t.min_p),
                           pick(t.seeds), pick(t.steps), t.all_greedy, penalties,
                           logit_bias=_select_bias(t.logit_bias, index))


def _select_bias(bias: LogitBias | None, index: torch.Tensor) -> LogitBias | None:
    """The chosen rows' bias entries, renumbered to their place in `index`, without a sync:
    an entry of a row left out stays, as a bias of 0 on that token of row 0 (x + 0.0 is x)."""
    if bias is None:
        return None
    match = bias.rows[:, None] == index[None, :]  # [N, r]: entry i belongs to chosen row j
    found = match.any(dim=1)
    rows = torch.where(found, match.to(torch.int64).argmax(dim=1), 0)
    return LogitBias(rows, bias.token_ids, torch.where(found, bias.values, 0.0))
