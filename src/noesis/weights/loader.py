"""Strict loading: every parameter filled exactly once from the checkpoint, or a named error."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from noesis.errors import CheckpointMismatch
from noesis.models.config import ModelConfig
from noesis.quant.packing import is_packed_layout, to_memory_layout
from noesis.weights.mapping import Source, is_ignored, sources_for
from noesis.weights.mxfp4 import dequantize_mxfp4
from noesis.weights.paging import ReadClock
from noesis.weights.safetensors_io import checkpoint_files, iter_tensors, tensor_index

MAX_NAMES = 10


def load_weights(
    model: nn.Module, config: ModelConfig, model_dir: Path, progress: bool = True,
    clock: ReadClock | None = None,
) -> int:
    """Copy checkpoint tensors into `model`'s (already allocated) parameters, casting dtype.
    Returns the bytes of checkpoint tensors read (skipped ones, e.g. a vision tower's, are
    never touched). `clock` books the seconds spent reading them apart from placing them."""
    clock = clock or ReadClock()
    index = tensor_index(checkpoint_files(model_dir))
    params = dict(model.named_parameters())
    targets = _targets(params, config)  # checkpoint key -> (param name, source)
    _check_names(targets, index, config)
    _check_shapes(targets, params, index)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in targets:
        by_file[index[key][0]].append(key)
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not progress)
    halves: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # MXFP4 blocks / scales
    bytes_read = 0
    with torch.no_grad():
        for path, keys in by_file.items():
            for key, tensor in clock.tensors(iter_tensors(path, keys)):
                bar.update(1)
                bytes_read += tensor.nbytes
                name, source = targets[key]
                if source.layout.startswith("mxfp4"):
                    halves[name][source.layout] = tensor
                    if len(halves[name]) < 2:
                        continue
                    pair = halves.pop(name)
                    tensor = dequantize_mxfp4(pair["mxfp4_blocks"], pair["mxfp4_scales"])
                _place(params[name], source, tensor, key)
    bar.close()
    for name, module in model.named_modules():
        if hasattr(module, "check_loaded"):  # modules with packed contents (ternary) check them
            module.check_loaded(name)
    return bytes_read


def _place(param: torch.Tensor, source: Source, tensor: torch.Tensor, key: str) -> None:
    """Copy one checkpoint tensor (or a dequantized MXFP4 pair) into its part of `param`."""
    dest = param if source.expert is None else param[source.expert]
    if source.rows is not None:
        dest = dest.narrow(0, source.offset, source.rows)
    if not dest.is_floating_point() and tensor.dtype != dest.dtype:
        raise CheckpointMismatch(f"{key}: dtype {tensor.dtype}, model {dest.dtype}")
    if is_packed_layout(source.layout):  # AWQ / GPTQ: into PackedLinear's layout
        tensor = to_memory_layout(source.layout, tensor, key)
    if source.layout == "transposed":
        tensor = tensor.transpose(-1, -2)
    if source.interleaved:  # [E, 2I, ...] with gate, up alternating -> [gate | up]
        tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
    dest.copy_(tensor)


def _targets(params: dict[str, nn.Parameter], config: ModelConfig):
    targets: dict[str, tuple[str, Source]] = {}
    for name in params:
        for source in sources_for(name, config):
            targets[source.key] = (name, source)
    return targets


def _check_names(targets: dict, index: dict, config: ModelConfig) -> None:
    missing = [key for key in targets if key not in index]
    unexpected = [key for key in index if key not in targets and not is_ignored(key, config)]
    check_tensor_names("checkpoint", config.architecture, missing, unexpected)


def check_tensor_names(subject: str, architecture: str, missing: list[str],
                       unexpected: list[str], misshaped: list[str] = ()) -> None:
    """Raise CheckpointMismatch naming the missing, unexpected and mis-shaped tensors (the first
    MAX_NAMES of each), if there are any: every loader's strict check ends here."""
    parts = [f"{what} {len(keys)} tensor(s): {name_list(keys)}"
             for what, keys in (("missing", missing), ("unexpected", unexpected),
                                ("mis-shaped", misshaped)) if keys]
    if parts:
        raise CheckpointMismatch(f"{subject} does not match {architecture}: " + "; ".join(parts))


def _check_shapes(targets: dict, params: dict, index: dict) -> None:
    wrong = []
    for key, (name, source) in targets.items():
        expected = source.shape(tuple(params[name].shape))
        found = index[key][1]
        if found != expected:
            wrong.append(f"{key}: checkpoint {list(found)}, model expects {list(expected)}")
    if wrong:
        shown = "; ".join(wrong[:MAX_NAMES])
        more = f" (and {len(wrong) - MAX_NAMES} more)" if len(wrong) > MAX_NAMES else ""
        raise CheckpointMismatch(f"shape mismatch in {len(wrong)} tensor(s): {shown}{more}")


def name_list(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_NAMES])
    return shown + (f", ... ({len(keys) - MAX_NAMES} more)" if len(keys) > MAX_NAMES else "")
