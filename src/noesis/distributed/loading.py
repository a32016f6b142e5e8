"""Shard loading: each rank reads only its slices of the checkpoint (safetensors get_slice over
the mmap), checked as strictly as a whole load: missing, unexpected and mis-shaped tensors are
named.

Where a parameter's rows or columns come from, per kind:
  vocabulary (embed_tokens, lm_head)   rows [vocab_start, +vocab_rows), the tail past V zeroed
  qkv_proj (weight, bias)              q rows of this rank's heads, k and v rows of its KV heads
  gate_up_proj                         gate and up rows of this rank's MLP columns
  (each part sliced apart, whether the checkpoint stores the parts apart or fused, as Phi-3)
  o_proj / down_proj / out_proj weight columns of this rank's heads / MLP / conv channels
  experts' gate_up / down              each expert's gate and up rows / down columns of this
                                       rank's expert columns (gpt-oss: stacked, transposed,
                                       gate and up interleaved, so one contiguous run each)
  experts' down bias                   rank 0 whole; zeros on the others (added once)
  sinks, conv in_proj, conv kernel     this rank's heads / channels (in_proj: B, C and x each)
  anything else (norms, router, biases of row-parallel layers)  whole
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from noesis.distributed.layers import Shard, check_shardable, parallel_model
from noesis.engine.loading import LoadedModel, _render_harmony, read_model_config, resolve_dtype
from noesis.models.config import ModelConfig
from noesis.tokenizer import Tokenizer
from noesis.weights.hub import resolve_model_dir
from noesis.weights.loader import check_tensor_names
from noesis.weights.mapping import EXPERT_PARTS, Source, is_ignored, sources_for
from noesis.weights.paging import ReadClock
from noesis.weights.safetensors_io import checkpoint_files, iter_slices, tensor_index


@dataclass(frozen=True)
class Slice:
    """The part [start, start + length) along `dim` of one checkpoint tensor, and where it goes:
    read along dim 0, it fills rows [offset, offset + length) of the parameter (of its expert
    `expert`, if set); along another dim, all of it. Zero-length: named and shape-checked, never
    read (the parameter is zeroed)."""

    key: str
    full_shape: tuple[int, ...]  # the checkpoint tensor's shape, checked against the header
    dim: int
    start: int
    length: int
    offset: int = 0
    expert: int | None = None
    transposed: bool = False  # stored [.., in, out] (gpt-oss experts)
    interleaved: bool = False  # gate and up rows alternate (gpt-oss gate_up, after transposing)


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
    if config.family == "gpt_oss":  # its chats render through Harmony, as in a whole load
        _render_harmony(tokenizer)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        module = parallel_model(shard, group)
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
            if part.length:
                by_file[index[part.key][0]].append((name, part))
    bytes_read = 0
    with torch.no_grad():
        for name, slices in plan.items():
            if _is_vocab(name) or any(not part.length for part in slices):
                params[name].zero_()  # vocabulary padding; biases another rank adds
        for path, wanted in by_file.items():
            reads = [(part.key, part.dim, part.start, part.length) for _, part in wanted]
            parts = clock.tensors(iter_slices(path, reads))
            for (name, part), (_, tensor) in zip(wanted, parts, strict=True):
                bytes_read += tensor.nbytes
                _place(params[name], part, tensor)
    return bytes_read


def _place(param: torch.Tensor, part: Slice, tensor: torch.Tensor) -> None:
    dest = param if part.expert is None else param[part.expert]
    if part.dim == 0:
        dest = dest.narrow(0, part.offset, part.length)
    if part.transposed:
        tensor = tensor.transpose(-1, -2)
    if part.interleaved:  # [E, 2n, ...] gate, up, gate, ... -> [gate | up]
        tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    dest.copy_(tensor)


def shard_slices(name: str, shape: tuple[int, ...], shard: Shard) -> list[Slice]:
    """Where parameter `name` (of local `shape`) comes from for this rank."""
    config, rank = shard.config, shard.rank
    sources = sources_for(name, config)
    module, _, leaf = name.rpartition(".")
    if _is_vocab(name):
        rows = max(0, min(shard.vocab_rows, config.vocab_size - shard.vocab_start))
        full = (config.vocab_size, *shape[1:])
        return [Slice(sources[0].key, full, 0, shard.vocab_start, rows)]
    if module.endswith(".experts"):
        return _expert_slices(leaf, sources, shard)
    if module.endswith("qkv_proj"):
        local = shard.local
        kv = (shard.kv_head_start * config.head_dim, local.kv_size)
        picks = ((rank * local.q_size, local.q_size), kv, kv)
        return _fused(sources, shape, (config.q_size, config.kv_size, config.kv_size), picks)
    if module.endswith("gate_up_proj"):
        width = shard.local.intermediate_size
        return _fused(sources, shape, (config.intermediate_size,) * 2, ((rank * width, width),) * 2)
    if module.endswith(".conv.in_proj"):  # B, C, x: per channel
        channels = shard.conv_channels
        return _fused(sources, shape, (config.hidden_size,) * 3, ((rank * channels, channels),) * 3)
    if module.endswith(".conv.conv") or name.endswith(".self_attn.sinks"):  # channels, heads
        rows = shape[0]
        return [Slice(sources[0].key, (rows * shard.size, *shape[1:]), 0, rank * rows, rows)]
    if module.endswith(("o_proj", "down_proj", ".conv.out_proj")) and leaf == "weight":
        width = shape[1]
        return [Slice(sources[0].key, (shape[0], width * shard.size), 1, rank * width, width)]
    return [Slice(sources[0].key, shape, 0, 0, shape[0])]


def _fused(sources: list[Source], shape: tuple[int, ...], full_rows: tuple[int, ...],
           picks: tuple[tuple[int, int], ...]) -> list[Slice]:
    """A fused parameter's parts in row order, part i the rows [start, start + length) of its
    full_rows[i]: from one checkpoint tensor per part, or from the one tensor that stores them
    fused (Phi-3's qkv_proj and gate_up_proj, LFM2's in_proj), part after part."""
    offsets = [sum(length for _, length in picks[:i]) for i in range(len(picks))]
    rest = shape[1:]
    if len(sources) == 1:
        bases = [sum(full_rows[:i]) for i in range(len(full_rows))]
        return [Slice(sources[0].key, (sum(full_rows), *rest), 0, base + start, length, offset)
                for base, (start, length), offset in zip(bases, picks, offsets, strict=True)]
    return [Slice(s.key, (rows, *rest), 0, start, length, offset)
            for s, rows, (start, length), offset
            in zip(sources, full_rows, picks, offsets, strict=True)]


def _expert_slices(leaf: str, sources: list[Source], shard: Shard) -> list[Slice]:
    """Each expert's share: gate and up rows, down columns of this rank's expert columns."""
    config, rank = shard.config, shard.rank
    moe = config.moe
    hidden, inner = config.hidden_size, moe.intermediate_size
    width = shard.local.moe.intermediate_size
    if config.family in EXPERT_PARTS:  # one [out, in] tensor per expert and part
        if leaf == "down_proj":
            return [Slice(s.key, (hidden, inner), 1, rank * width, width, expert=s.expert)
                    for s in sources]
        return [Slice(s.key, (inner, hidden), 0, rank * width, width, s.offset // inner * width,
                      expert=s.expert) for s in sources]
    (source,) = sources  # gpt-oss: stacked [E, in, out], gate and up columns interleaved
    experts = moe.num_experts
    if leaf == "gate_up_proj":
        return [Slice(source.key, (experts, hidden, 2 * inner), 2, 2 * rank * width, 2 * width,
                      transposed=True, interleaved=True)]
    if leaf == "gate_up_proj_bias":
        return [Slice(source.key, (experts, 2 * inner), 1, 2 * rank * width, 2 * width,
                      interleaved=True)]
    if leaf == "down_proj":
        return [Slice(source.key, (experts, inner, hidden), 1, rank * width, width,
                      transposed=True)]
    assert leaf == "down_proj_bias", leaf
    return [Slice(source.key, (experts, hidden), 0, 0, experts if rank == 0 else 0)]


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
