"""CudaGraphRunner: decode steps captured as CUDA graphs, one per padded batch size.

It owns the buckets, the static input buffers the graphs read, the shared memory pool, and the
capture. A step replays when every scheduled sequence decodes one token and the batch fits the
largest bucket; everything else runs eagerly. Per step the host fills one pinned buffer, one copy
moves it to the device, and the graph runs the whole forward including the LM head. Tokens still
pending (sampled by the step launched just before, not read back yet) are gathered from that
step's output on the device before the replay. Two pinned buffers take turns, so filling one
never races the copy of the step still queued.
"""

from __future__ import annotations

import time

import torch

from noesis.engine.scheduler import StepPlan
from noesis.kernels import ops
from noesis.kv.cache import KVPool
from noesis.models.decoder import DecoderLM
from noesis.models.rope import RotaryEmbedding
from noesis.runner.inputs import AttentionMetadata

COLUMNS = 5  # per-row fields of the input buffer before the page tables


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
        # positions [R] | slots [R] | lengths [R] | pending sources [R] | tables [R, max_pages].
        size = COLUMNS * rows + rows * self.max_pages
        self.hosts = [torch.zeros(size, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.turn = 0  # which host buffer the next step fills
        self.device_buf = torch.zeros(size, dtype=torch.int64, device=kv.device)
        self.host_fields = [self._fields(host.numpy()) for host in self.hosts]
        self.device_fields = self._fields(self.device_buf)
        self.rows = torch.arange(rows, device=kv.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _fields(self, flat):
        rows = self.max_batch
        columns = [flat[i * rows : (i + 1) * rows] for i in range(COLUMNS)]
        tables = flat[COLUMNS * rows :].reshape(rows, self.max_pages)
        return (*columns, tables)

    def _forward(self, batch: int) -> torch.Tensor:
        input_ids, positions, slots, lengths, _, tables = (f[:batch] for f in self.device_fields)
        meta = AttentionMetadata(self.page_size, slots, [], self.rows[:batch], tables,
                                 lengths, self.max_model_len)
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
        if not self.graphs or self.rope.length_dependent:
            return False
        if plan.preempted or len(plan.scheduled) > self.max_batch:
            return False
        return all(i.num_tokens == 1 and i.seq.num_computed > 0 and i.samples
                   for i in plan.scheduled)

    def replay(self, plan: StepPlan, sources: list[int] | None = None,
               previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, V] for a decode-only plan of n sequences. `sources[i]` >= 0: sequence i
        feeds the token in row `sources[i]` of `previous_ids` (on the device)."""
        count = len(plan.scheduled)
        batch = next(b for b in self.buckets if b >= count)
        host, fields = self.hosts[self.turn], self.host_fields[self.turn]
        self.turn ^= 1
        ids, positions, slots, lengths, _, tables = fields
        ps = self.page_size
        for row, item in enumerate(plan.scheduled):
            seq = item.seq
            pos = seq.num_computed
            pages = seq.pages
            ids[row] = seq.token_ids[pos] if pos < len(seq.token_ids) else 0
            positions[row] = pos
            slots[row] = pages[pos // ps] * ps + pos % ps
            lengths[row] = pos + 1
            tables[row, : len(pages)] = pages
        self._fill_padding(fields, count, batch)
        if sources is not None:
            fields[4][:count] = sources
        self.device_buf.copy_(host, non_blocking=True)
        if sources is not None:
            ops.take_pending(self.device_fields[0][:count], self.device_fields[4][:count],
                             previous_ids)
        self.graphs[batch].replay()
        return self.logits[batch][:count]

    def _fill_padding(self, fields, start: int, stop: int) -> None:
        """Padded rows decode a dummy token into the pool's scratch page."""
        ids, positions, slots, lengths, sources, tables = fields
        scratch = self.kv.scratch_page
        ids[start:stop] = 0
        positions[start:stop] = 0
        slots[start:stop] = scratch * self.page_size
        lengths[start:stop] = 1
        sources[start:stop] = -1
        tables[start:stop] = scratch
