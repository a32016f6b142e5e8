"""Opening checkpoint files: only regular files, and metadata read under a size cap.

Every file noesis reads from a checkpoint directory passes `regular_file_size` first, so a named
pipe (whose open blocks until a writer comes), a socket, a device or a directory is an error that
names it instead of a hang or a read without end. Symlinks are followed: one that points at a
regular file is fine.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from noesis.errors import CheckpointError

# Caps far above any released checkpoint's (config.json is a few KB; tokenizer.json reaches ~35 MB
# for 256k-token vocabularies; a shard index lists one line per tensor), low enough that a huge
# file is refused before it is read into memory.
CONFIG_MAX_BYTES = 4 << 20  # config.json, generation_config.json, chat templates
TOKENIZER_MAX_BYTES = 64 << 20  # tokenizer.json, tokenizer_config.json, the shard index

_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def regular_file_size(path: Path, max_bytes: int | None = None) -> int:
    """The size of `path` if it is a regular file (after symlinks) of at most `max_bytes`;
    otherwise CheckpointError naming the file and what it is. Call it before opening."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist (a broken symlink?)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), "a special file")
        raise CheckpointError(f"{path} is {kind}, not a regular file; a checkpoint holds files")
    if max_bytes is not None and info.st_size > max_bytes:
        raise CheckpointError(
            f"{path} is {_mib(info.st_size)}, above the {_mib(max_bytes)} limit for this file"
        )
    return info.st_size


def read_text_file(path: Path, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`."""
    regular_file_size(path, max_bytes)
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)  # a file that grew since the check stops here
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise CheckpointError(f"{path} grew past the {_mib(max_bytes)} limit while being read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text: {exc}") from None


def read_json_file(path: Path, max_bytes: int) -> dict[str, Any]:
    """The JSON object in a regular file of at most `max_bytes`; anything else is an error."""
    try:
        value = json.loads(read_text_file(path, max_bytes))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path} must hold a JSON object, not a {_json_kind(value)}"
        )
    return value


def _json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):,.1f} MiB"
