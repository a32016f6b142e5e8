"""Strict loading: every parameter filled exactly once from the checkpoint, or a named error."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from noesis.errors import CheckpointMismatch
from noesis.models.config import ModelConfig
from noesis.weights.mapping import is_ignored, sources_for
from noesis.weights.safetensors_io import checkpoint_files, iter_tensors, tensor_index

MAX_NAMES = 10


def load_weights(model: nn.Module, config: ModelConfig, model_dir: Path, progress: bool = True):
    """Copy checkpoint tensors into `model`'s (already allocated) parameters, casting dtype."""
    index = tensor_index(checkpoint_files(model_dir))
    params = dict(model.named_parameters())
    targets = _targets(params, config)  # checkpoint key -> (param name, row offset, rows)
    _check_names(targets, index, config)
    _check_shapes(targets, params, index)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in targets:
        by_file[index[key][0]].append(key)
    bar = tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not progress)
    with torch.no_grad():
        for path, keys in by_file.items():
            for key, tensor in iter_tensors(path, keys):
                name, offset, rows = targets[key]
                dest = params[name]
                if rows is not None:
                    dest = dest.narrow(0, offset, rows)
                if not dest.is_floating_point() and tensor.dtype != dest.dtype:
                    raise CheckpointMismatch(f"{key}: dtype {tensor.dtype}, model {dest.dtype}")
                dest.copy_(tensor)
                bar.update(1)
    bar.close()
    for name, module in model.named_modules():
        if hasattr(module, "check_loaded"):  # modules with packed contents (ternary) check them
            module.check_loaded(name)


def _targets(params: dict[str, nn.Parameter], config: ModelConfig):
    targets: dict[str, tuple[str, int, int | None]] = {}
    for name in params:
        offset = 0
        for source in sources_for(name, config):
            targets[source.key] = (name, offset, source.rows)
            offset += source.rows or 0
    return targets


def _check_names(targets: dict, index: dict, config: ModelConfig) -> None:
    missing = [key for key in targets if key not in index]
    unexpected = [key for key in index if key not in targets and not is_ignored(key, config)]
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} tensor(s): {_names(unexpected)}")
    raise CheckpointMismatch(
        f"checkpoint does not match {config.architecture}: " + "; ".join(parts)
    )


def _check_shapes(targets: dict, params: dict, index: dict) -> None:
    wrong = []
    for key, (name, _, rows) in targets.items():
        expected = tuple(params[name].shape)
        if rows is not None:
            expected = (rows, *expected[1:])
        found = index[key][1]
        if found != expected:
            wrong.append(f"{key}: checkpoint {list(found)}, model expects {list(expected)}")
    if wrong:
        shown = "; ".join(wrong[:MAX_NAMES])
        more = f" (and {len(wrong) - MAX_NAMES} more)" if len(wrong) > MAX_NAMES else ""
        raise CheckpointMismatch(f"shape mismatch in {len(wrong)} tensor(s): {shown}{more}")


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_NAMES])
    return shown + (f", ... ({len(keys) - MAX_NAMES} more)" if len(keys) > MAX_NAMES else "")
