"""Reading safetensors checkpoints: file discovery, headers, lazy (memory-mapped) tensor reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from noesis.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index, else every *.safetensors."""
    index = model_dir / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid shard index: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {model_dir} (only safetensors is supported)"
        )
    return files


def tensor_index(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Checkpoint tensor name -> (file, shape), read from headers only."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with _open(path) as handle:
            for key in handle.keys():
                if key in index:
                    raise CheckpointError(
                        f"tensor {key} appears in both {index[key][0].name} and {path.name}"
                    )
                index[key] = (path, tuple(handle.get_slice(key).get_shape()))
    return index


def iter_tensors(path: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for `keys` of one file; pages are read from the mmap on access."""
    with _open(path) as handle:
        for key in keys:
            try:
                yield key, handle.get_tensor(key)
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: cannot read tensor {key}: {exc}") from exc


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}"
        ) from exc
