"""Shard loading: each rank reads only its slices of the checkpoint (safetensors get_slice over
the mmap), checked as strictly as a whole load: missing, unexpected and mis-shaped tensors are
named.

Where a parameter's rows or columns come from, per kind:
  vocabulary (embed_tokens, lm_head)  rows [vocab_start, +vocab_rows), the tail past V zeroed
  qkv_proj (weight, bias)             q rows of this rank's heads, k and v rows of its KV heads
  gate_up_proj                        gate and up rows of this rank's MLP columns
  o_proj / down_proj weight           columns of this rank's heads / MLP columns
  anything else (norms, biases of o/down)  whole
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from noesis.distributed.layers import ParallelDecoderLM, Shard, check_shardable
from noesis.engine.loading import LoadedModel, read_model_config, resolve_dtype
from noesis.models.config import ModelConfig
from noesis.tokenizer import Tokenizer
from noesis.weights.hub import resolve_model_dir
from noesis.weights.loader import check_tensor_names
from noesis.weights.mapping import is_ignored, sources_for
from noesis.weights.paging import ReadClock
from noesis.weights.safetensors_io import checkpoint_files, iter_slices, tensor_index


@dataclass(frozen=True)
class Slice:
    """One checkpoint tensor's part that fills rows [offset, offset + length) of a parameter
    (dim 0), or all of it from columns [start, start + length) (dim 1)."""

    key: str
    full_shape: tuple[int, ...]  # the checkpoint tensor's shape, checked against the header
    dim: int
    start: int
    length: int
    offset: int = 0


def load_shard(model: str, device: torch.device, dtype: str, revision: str | None, shard_of,
               group) -> LoadedModel:
    """Rank `group.rank`'s share of `model`, as a LoadedModel whose config is the shard's (its
    heads, KV heads and MLP width; the whole vocabulary). `shard_of` is the rank count."""
    start = time.perf_counter()
    model_dir = resolve_model_dir(model, revision)
    config = read_model_config(model_dir)
    check_shardable(config, shard_of)
    shard = Shard(config, group.rank, shard_of)
    tokenizer = Tokenizer.from_dir(model_dir, config.eos_token_ids)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        module = ParallelDecoderLM(shard, group)
    placing = time.perf_counter()
    module = module.to(dtype=torch_dtype).to_empty(device=device)
    clock = ReadClock()
    bytes_read = load_shard_weights(module, shard, model_dir, clock)
    module.eval()
    end = time.perf_counter()
    read_s = placing - start + clock.seconds  # the buckets of engine.loading's load_model
    return LoadedModel(model_dir, shard.local, module, tokenizer, device, torch_dtype,
                       end - start, {"read_s": read_s, "place_s": end - start - read_s},
                       bytes_read)


def load_shard_weights(module: torch.nn.Module, shard: Shard, model_dir: Path,
                       clock: ReadClock | None = None) -> int:
    """Fill `module`'s parameters with this rank's slices; returns the bytes read (`clock`
    books the seconds spent reading them)."""
    clock = clock or ReadClock()
    index = tensor_index(checkpoint_files(model_dir))
    params = dict(module.named_parameters())
    plan = {name: shard_slices(name, tuple(p.shape), shard) for name, p in params.items()}
    _check(plan, index, shard.config)
    by_file: dict[Path, list[tuple[str, Slice]]] = defaultdict(list)
    for name, slices in plan.items():
        for part in slices:
            by_file[index[part.key][0]].append((name, part))
    bytes_read = 0
    with torch.no_grad():
        for name in plan:
            if _is_vocab(name):
                params[name].zero_()  # the padding rows past the vocabulary stay zero
        for path, wanted in by_file.items():
            reads = [(part.key, part.dim, part.start, part.length) for _, part in wanted]
            parts = clock.tensors(iter_slices(path, reads))
            for (name, part), (_, tensor) in zip(wanted, parts, strict=True):
                bytes_read += tensor.nbytes
                dest = params[name]
                if part.dim == 0:
                    dest = dest.narrow(0, part.offset, part.length)
                dest.copy_(tensor)
    return bytes_read


def shard_slices(name: str, shape: tuple[int, ...], shard: Shard) -> list[Slice]:
    """Where parameter `name` (of local `shape`) comes from for this rank."""
    config, rank = shard.config, shard.rank
    sources = sources_for(name, config)
    module = name.rpartition(".")[0]
    if _is_vocab(name):
        rows = max(0, min(shard.vocab_rows, config.vocab_size - shard.vocab_start))
        full = (config.vocab_size, *shape[1:])
        return [Slice(sources[0].key, full, 0, shard.vocab_start, rows)] if rows else []
    if module.endswith("qkv_proj"):
        local = shard.local
        q, kv = local.q_size, local.kv_size
        starts = (rank * q, shard.kv_head_start * config.head_dim, shard.kv_head_start
                  * config.head_dim)
        return [Slice(s.key, (s.rows, *shape[1:]), 0, first, n, offset)
                for s, first, n, offset in zip(sources, starts, (q, kv, kv), (0, q, q + kv),
                                               strict=True)]
    if module.endswith("gate_up_proj"):
        width = shard.local.intermediate_size
        return [Slice(s.key, (s.rows, *shape[1:]), 0, rank * width, width, i * width)
                for i, s in enumerate(sources)]
    if module.endswith(("o_proj", "down_proj")) and name.endswith("weight"):
        width = shape[1]
        return [Slice(sources[0].key, (shape[0], width * shard.size), 1, rank * width, width)]
    return [Slice(sources[0].key, shape, 0, 0, shape[0])]


def _is_vocab(name: str) -> bool:
    return name in ("model.embed_tokens.weight", "lm_head.weight")


def _check(plan: dict[str, list[Slice]], index: dict, config: ModelConfig) -> None:
    """CheckpointMismatch naming missing, unexpected and mis-shaped tensors (first ten each)."""
    wanted = {part.key: part for slices in plan.values() for part in slices}
    missing = [key for key in wanted if key not in index]
    unexpected = [key for key in index if key not in wanted and not is_ignored(key, config)]
    wrong = [f"{key}: checkpoint {list(index[key][1])}, model expects {list(part.full_shape)}"
             for key, part in wanted.items()
             if key in index and index[key][1] != part.full_shape]
    check_tensor_names("checkpoint", config.architecture, missing, unexpected, wrong)
