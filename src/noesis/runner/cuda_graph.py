"""CudaGraphRunner: decode steps captured as CUDA graphs, one per padded batch size.

It owns the buckets, the static input buffers the graphs read, the shared memory pool, and the
capture. A graph row is one query token with its own position, slot, context length and page
table, so a graph of R rows runs R single-token decodes, or a verify row's 1 + num_draft tokens
as that many rows over one page table (row j attends to the context up to its own position;
every row's key is written before any row attends). A step replays when every scheduled
sequence decodes one token or verifies proposals, and its rows fit the largest bucket;
everything else runs eagerly. Per step the host fills one pinned buffer, one copy moves it to
the device, and the graph runs the whole forward including the LM head. Tokens still pending
(sampled by the step launched just before, not read back yet) and proposals on the device are
gathered into the ids on the device before the replay. Two pinned buffers take turns, so
filling one never races the copy of the step still queued.

A draft model replays its own graphs (`stage` then `replay_staged`): its k proposal steps are
filled on the host at once and copied in one transfer, each replay then takes its step's rows
and the token drafted by the step before it, on the device.

Without `capture` (CPU, tests) `replay` runs the same forward eagerly over the same buffers.
"""

from __future__ import annotations

import time

import torch

from noesis.kernels import ops
from noesis.kv.cache import KVPool
from noesis.models.decoder import DecoderLM
from noesis.models.rope import RotaryEmbedding
from noesis.planner.scheduler import StepPlan
from noesis.runner.inputs import AttentionMetadata

COLUMNS = 6  # per-row fields of the input buffer before the page tables


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, then of 16: few graphs, little padding."""
    sizes = [1, 2, 4, 8]
    size = 8
    while size < max_batch:
        size += 8 if size < 64 else 16
        sizes.append(size)
    return [s for s in sizes if s < max_batch] + [max_batch]


class CudaGraphRunner:
    def __init__(self, model: DecoderLM, kv: KVPool, rope: RotaryEmbedding, attention,
                 max_batch: int, max_model_len: int) -> None:
        self.model, self.kv, self.rope, self.attention = model, kv, rope, attention
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_model_len = max_model_len
        self.page_size = kv.page_size
        self.max_pages = -(-max_model_len // kv.page_size)
        rows = self.max_batch
        # Pinned host buffers and their device twin, each field contiguous: ids [R] |
        # positions [R] | slots [R] | lengths [R] | pending sources [R] | proposal sources [R] |
        # tables [R, max_pages].
        self.size = size = COLUMNS * rows + rows * self.max_pages
        self.pinned = kv.device.type == "cuda"
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=self.pinned)
                      for _ in range(2)]
        self.turn = 0  # which host buffer the next step fills
        self.device_buf = torch.zeros(size, dtype=torch.int64, device=kv.device)
        self.host_fields = [self._fields(host.numpy()) for host in self.hosts]
        self.device_fields = self._fields(self.device_buf)
        self.rows = torch.arange(rows, device=kv.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # forwards run through the buffers (graph replays once captured)

    def _fields(self, flat):
        rows = self.max_batch
        columns = [flat[i * rows : (i + 1) * rows] for i in range(COLUMNS)]
        tables = flat[COLUMNS * rows :].reshape(rows, self.max_pages)
        return (*columns, tables)

    def _forward(self, batch: int) -> torch.Tensor:
        input_ids, positions, slots, lengths, _, _, tables = (f[:batch] for f in self.device_fields)
        meta = AttentionMetadata(self.page_size, slots, [], self.rows[:batch], tables,
                                 lengths, self.max_model_len, ctx_bound=True)
        cos, sin = self.rope.cos_sin(positions)
        hidden, residual = self.model(input_ids, cos, sin, self.kv.layers, meta, self.attention)
        return self.model.compute_logits(hidden, residual)  # [batch, V]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self._fill_padding(self.host_fields[0], 0, self.max_batch)
        self.device_buf.copy_(self.hosts[0])
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):  # largest first: later graphs reuse its pool
                for _ in range(2):  # compile kernels, settle allocations
                    self._forward(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[batch] = self._forward(batch)
                pool = graph.pool()
                self.graphs[batch] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def can_replay(self, plan: StepPlan) -> bool:
        if self.rope.length_dependent or plan.preempted:
            return False
        rows = 0
        for item in plan.scheduled:
            if not (item.samples and item.seq.num_computed > 0
                    and item.num_tokens == 1 + item.num_draft):
                return False  # a prefill (chunk): eager
            rows += item.num_tokens
        return rows <= self.max_batch

    def replay(self, plan: StepPlan, sources: list[int] | None = None,
               previous_ids: torch.Tensor | None = None, proposals=None) -> torch.Tensor:
        """Logits [R, V] for a plan that `can_replay`: one row per decoding sequence, 1 +
        num_draft per verify row, in plan order. `sources[i]` >= 0: sequence i feeds the token
        in row `sources[i]` of `previous_ids` (on the device); verify rows feed their proposals
        from `proposals` (a speculative.StepProposals)."""
        count = sum(item.num_tokens for item in plan.scheduled)
        batch = self._bucket(count)
        host, fields = self.hosts[self.turn], self.host_fields[self.turn]
        self.turn ^= 1
        row = 0
        for index, item in enumerate(plan.scheduled):
            seq = item.seq
            for pos in range(seq.num_computed, seq.num_computed + item.num_tokens):
                token = seq.token_ids[pos] if pos < len(seq.token_ids) else 0
                self._fill_row(fields, row + pos - seq.num_computed, token, pos, seq.pages)
            if sources is not None:
                fields[4][row] = sources[index]
            if item.num_draft:
                self._fill_proposals(fields, row + 1, item, proposals)
            row += item.num_tokens
        self._fill_padding(fields, count, batch)
        self.device_buf.copy_(host, non_blocking=self.pinned)
        ids = self.device_fields[0][:count]
        if sources is not None:
            ops.take_pending(ids, self.device_fields[4][:count], previous_ids)
        if proposals is not None and proposals.proposals.proposed.device.type != "cpu":
            ops.take_pending(ids, self.device_fields[5][:count],
                             proposals.proposals.proposed.reshape(-1))
        return self._run(batch)[:count]

    def stage(self, steps: list[list[tuple[int, int, list[int]]]]) -> torch.Tensor:
        """Several steps' rows, each (token id, position, page table), filled on the host and
        copied to the device at once: [S, size], for `replay_staged`. Each step fits a bucket."""
        host = torch.zeros((len(steps), self.size), dtype=torch.int64, pin_memory=self.pinned)
        for buf, rows in zip(host, steps, strict=True):
            fields = self._fields(buf.numpy())
            for row, (token, pos, pages) in enumerate(rows):
                self._fill_row(fields, row, token, pos, pages)
            self._fill_padding(fields, len(rows), self._bucket(len(rows)))
        # A fresh pinned buffer per call: the caching host allocator keeps it until the copy ran.
        return host.to(self.kv.device, non_blocking=self.pinned)

    def replay_staged(self, staged: torch.Tensor, step: int, count: int,
                      feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [count, V] of staged step `step` (a copy: the next replay overwrites the
        graph's output); `feed` [count] (device) replaces its token ids."""
        self.device_buf.copy_(staged[step])
        if feed is not None:
            self.device_fields[0][:count].copy_(feed)
        return self._run(self._bucket(count))[:count].clone()

    def _run(self, batch: int) -> torch.Tensor:
        self.replays += 1
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.logits[batch]
        return self._forward(batch)  # not captured (CPU, tests): the same forward, eager

    def _bucket(self, count: int) -> int:
        return next(b for b in self.buckets if b >= count)

    def _fill_row(self, fields, row: int, token: int, pos: int, pages: list[int]) -> None:
        ids, positions, slots, lengths, pending, drafts, tables = fields
        ps = self.page_size
        ids[row] = token
        positions[row] = pos
        slots[row] = pages[pos // ps] * ps + pos % ps
        lengths[row] = pos + 1
        pending[row] = drafts[row] = -1
        tables[row, : len(pages)] = pages

    @staticmethod
    def _fill_proposals(fields, first: int, item, proposals) -> None:
        """A verify row's proposals in rows first..first + num_draft - 1: their ids when the
        proposals are on the host (a lookup), else their flat index for the device gather."""
        found = proposals.proposals.proposed  # [n, k]
        start = proposals.row_of[item.seq.seq_id] * found.shape[1]
        rows = slice(first, first + item.num_draft)
        if found.device.type == "cpu":
            fields[0][rows] = found.reshape(-1)[start : start + item.num_draft].numpy()
        else:
            fields[5][rows] = range(start, start + item.num_draft)

    def _fill_padding(self, fields, start: int, stop: int) -> None:
        """Padded rows decode a dummy token into the pool's scratch page."""
        ids, positions, slots, lengths, pending, drafts, tables = fields
        scratch = self.kv.scratch_page
        ids[start:stop] = 0
        positions[start:stop] = 0
        slots[start:stop] = scratch * self.page_size
        lengths[start:stop] = 1
        pending[start:stop] = -1
        drafts[start:stop] = -1
        tables[start:stop] = scratch
