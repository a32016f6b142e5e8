"""Reading safetensors checkpoints: file discovery, headers, lazy (memory-mapped) tensor reads.

Headers are read and checked here, before the safetensors library maps a file: an absurd header
length, an unknown dtype, a shape whose bytes do not match its offsets, or data past the end of
the file is a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from noesis.errors import CheckpointError
from noesis.weights.files import TOKENIZER_MAX_BYTES, read_json_file, regular_file_size

INDEX_NAME = "model.safetensors.index.json"
HEADER_LENGTH_BYTES = 8  # little-endian u64, then the JSON header, then the data
MAX_HEADER_BYTES = 100_000_000  # the format's own limit: the safetensors library refuses more
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the shard index, else every *.safetensors."""
    index = model_dir / INDEX_NAME
    if index.exists():
        files = [model_dir / name for name in _shard_names(index)]
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
        for key, shape in header_shapes(path).items():
            if key in index:
                raise CheckpointError(
                    f"tensor {key} appears in both {index[key][0].name} and {path.name}"
                )
            index[key] = (path, shape)
    return index


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from one file's header, every entry checked against the file."""
    size = regular_file_size(path)
    header, length = _read_header(path, size)
    data_bytes = size - HEADER_LENGTH_BYTES - length
    return {
        key: _checked_shape(path, key, entry, data_bytes)
        for key, entry in header.items()
        if key != "__metadata__"
    }


def iter_tensors(path: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for `keys` of one file; pages are read from the mmap on access."""
    with _open(path) as handle:
        for key in keys:
            try:
                yield key, handle.get_tensor(key)
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: cannot read tensor {key}: {exc}") from exc


def iter_slices(
    path: Path, slices: list[tuple[str, int, int, int]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, part) for each (name, dim, start, length) of one file: only that part is
    read from the mmap (a tensor-parallel rank's shard), never the whole tensor."""
    with _open(path) as handle:
        for key, dim, start, length in slices:
            try:
                part = handle.get_slice(key)
                yield key, part[(slice(None),) * dim + (slice(start, start + length),)]
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: cannot read tensor {key}: {exc}") from exc


def _shard_names(index: Path) -> list[str]:
    weight_map = read_json_file(index, TOKENIZER_MAX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) for name in weight_map.values()
    ):
        raise CheckpointError(
            f"{index} is not a valid shard index: weight_map must map tensor names to file names"
        )
    names = sorted(set(weight_map.values()))
    outside = [name for name in names if Path(name).name != name or name in ("", ".", "..")]
    if outside:
        raise CheckpointError(
            f"{index} names shards outside the checkpoint directory: {', '.join(outside[:10])}"
        )
    return names


def _read_header(path: Path, size: int) -> tuple[dict[str, Any], int]:
    """The JSON header and its length in bytes, refused when the length is absurd."""
    if size < HEADER_LENGTH_BYTES:
        raise CheckpointError(
            f"{path} is not a safetensors file: {size} bytes, too short for a header (truncated?)"
        )
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(HEADER_LENGTH_BYTES), "little")
            if length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH_BYTES):
                raise CheckpointError(
                    f"{path} is not a readable safetensors file (corrupt or truncated?): its "
                    f"header length {length:,} is past the end of the file ({size:,} bytes) or "
                    f"above the format's limit ({MAX_HEADER_BYTES:,})"
                )
            raw = handle.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt?): its header is not JSON: {exc}"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header, length


def _checked_shape(path: Path, key: str, entry: Any, data_bytes: int) -> tuple[int, ...]:
    where = f"{path}: tensor {key}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: its header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not supported")
    if not _naturals(shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    begin, end = offsets
    if end > data_bytes:
        raise CheckpointError(
            f"{where}: its data ends at byte {end:,}, past the end of the file's "
            f"{data_bytes:,} data bytes (truncated?)"
        )
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != needed:
        raise CheckpointError(
            f"{where}: shape {shape} in {dtype} needs {needed:,} bytes but its data_offsets "
            f"span {end - begin:,}"
        )
    return tuple(shape)


def _naturals(value: Any) -> bool:
    """A list of non-negative integers (JSON booleans excluded)."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _open(path: Path):
    regular_file_size(path)  # a named pipe would block the open
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}"
        ) from exc
