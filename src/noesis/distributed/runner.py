"""Steps across ranks: rank 0's runner sends each forward's prepared inputs (tokens, positions,
KV slots, page tables, sampling rows) before running it; the other ranks run `serve` and execute
what they receive, so every rank enters the same collectives in the same order.

Messages from rank 0, in order: ("load", (model, EngineConfig)), ("pool", PoolShape), then
("step", (ForwardInputs, conv slots)) per forward, until ("stop", None) or the next "load". The
conv slots (LFM2, else None) are rank 0's short-convolution state slots of the step's sequences,
(first pages, slots): rank 0's pool assigns them, the others' pools follow.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace

import torch

from noesis.distributed.group import ParallelGroup, RankFailure
from noesis.kv.cache import KVPool
from noesis.models.rope import RotaryEmbedding
from noesis.runner.inputs import ForwardInputs
from noesis.runner.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolShape:
    """What rank 0 settled after loading, which every rank's KV pool and runner must share."""

    num_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every forward is announced to the other ranks first. A forward that
    fails part-way leaves the ranks out of step: it raises RankFailure (an EngineFault)."""

    def __init__(self, *args, group: ParallelGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def capture_graphs(self, max_batch: int, capture: bool = True) -> float:
        raise NotImplementedError("CUDA graphs are not captured with tensor parallelism yet")

    def forward_inputs(self, inputs: ForwardInputs) -> torch.Tensor | None:
        if self.group.owner is not self:
            raise RankFailure("this engine's tensor-parallel ranks have loaded a newer engine's "
                              "model since; build this one again to use it")
        if self.group.broken:
            raise self.group.failed(RuntimeError("an earlier step failed"))
        try:
            host = torch.device("cpu")
            self.group.send(("step", (moved(inputs, host), conv_slots(self.kv, inputs))))
            return super().forward_inputs(inputs)
        except Exception as exc:
            raise self.group.failed(exc) from exc


def moved(inputs: ForwardInputs, device: torch.device) -> ForwardInputs:
    """`inputs` with every tensor on `device` (the host, to travel; a rank's device, to run)."""
    attn = inputs.attn
    attn = replace(
        attn,
        slot_mapping=attn.slot_mapping.to(device),
        prefills=[replace(span, pages=span.pages.to(device)) for span in attn.prefills],
        decode_rows=attn.decode_rows.to(device),
        decode_pages=attn.decode_pages.to(device),
        decode_ctx_lens=attn.decode_ctx_lens.to(device),
        decode_slots=None,  # built by the backend that gathers, on each rank
    )
    return replace(inputs, input_ids=inputs.input_ids.to(device),
                   positions=inputs.positions.to(device), attn=attn,
                   sample_rows=inputs.sample_rows.to(device))


def conv_slots(kv: KVPool, inputs: ForwardInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first pages [S], their conv-state slots [S]) of the step's sequences, on the host; None
    without short convolutions."""
    if kv.conv is None:
        return None
    attn = inputs.attn
    firsts = [span.pages[:1] for span in attn.prefills] + [attn.decode_pages[:, :1].flatten()]
    pages = torch.cat(firsts)
    return pages.cpu(), kv.conv.slot_of_page[pages].cpu()


def worker_runner(loaded, shape: PoolShape) -> ModelRunner:
    """A rank's KV pool and runner, shaped as rank 0's."""
    config, device = loaded.config, loaded.device
    rope = RotaryEmbedding(config.rope, config.max_position_embeddings, shape.max_model_len,
                           device)
    kv = KVPool(config, shape.num_pages, shape.page_size, loaded.dtype, device,
                max_num_seqs=shape.max_num_seqs)
    return ModelRunner(loaded.model, kv, rope, device, shape.max_model_len,
                       max_num_seqs=shape.max_num_seqs)


@torch.inference_mode()
def serve(group: ParallelGroup) -> None:
    """A rank > 0: run rank 0's messages until "stop". Any error ends the process with a
    non-zero code (rank 0's next collective then names this rank)."""
    from noesis.distributed.loading import load_shard

    loaded = runner = None
    try:
        while True:
            try:
                kind, payload = group.receive()
            except Exception as exc:  # between steps: rank 0 has exited or been killed
                logger.error("tensor-parallel rank %d: rank 0 is gone (%s)", group.rank, exc)
                raise SystemExit(1) from None
            if kind == "load":
                model, config = payload
                loaded, runner = None, None  # the previous model's memory goes first
                loaded = load_shard(model, group.device, config.dtype, config.revision,
                                    group.size, group)
            elif kind == "pool":
                runner = worker_runner(loaded, payload)
                group.barrier()
            elif kind == "step":
                inputs, slots = payload
                if slots is not None:
                    pages, slot = (t.to(group.device) for t in slots)
                    runner.kv.conv.slot_of_page.index_copy_(0, pages, slot)
                runner.forward_inputs(moved(inputs, group.device))
            else:
                return
    except Exception:
        logger.exception("tensor-parallel rank %d failed", group.rank)
        sys.stderr.flush()
        raise SystemExit(1) from None
