"""`noesis pull`, `noesis list` and `noesis rm`: the models on this machine (bundled, local
directories, the Hugging Face cache), named as every other command names them
(noesis.weights.hub.resolve_model_dir). Torch-free."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from noesis.errors import CheckpointError, ConfigError, ModelNotFound
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file
from noesis.weights.hub import bundled_models, from_hub


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what --model takes to load it
    source: str  # bundled, local, hf-cache
    path: Path
    size_bytes: int
    family: str  # config.json's model_type ("?" when unreadable)
    quantization: str  # quantization_config's method and bits, or "none"


def add_model_parsers(sub) -> None:
    pull = sub.add_parser("pull", help="download a Hugging Face model into the local cache")
    pull.add_argument("repo", help="the Hub repo id, e.g. Qwen/Qwen3-0.6B")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.set_defaults(handler=_pull)
    listing = sub.add_parser(
        "list", help="models on this machine: bundled, in DIRs, in the Hugging Face cache")
    listing.add_argument("dirs", nargs="*", metavar="DIR",
                         help="also list these checkpoint directories (or the ones inside them)")
    listing.add_argument("--json", action="store_true", help="one JSON object per model")
    listing.set_defaults(handler=_list)
    rm = sub.add_parser("rm", help="remove a model from the Hugging Face cache")
    rm.add_argument("name", help="the repo id, as `noesis list` shows it")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    rm.set_defaults(handler=_rm)


def list_models(dirs: list[str] = ()) -> list[ModelEntry]:
    """Bundled models, then checkpoints in `dirs`, then the Hugging Face cache's."""
    entries = [_entry(name, "bundled", path) for name, path in bundled_models().items()]
    for directory in map(Path, dirs):
        if not directory.is_dir():
            raise ModelNotFound(f"{directory} is not a directory")
        found = [directory] if (directory / "config.json").is_file() else sorted(
            path for path in directory.iterdir() if (path / "config.json").is_file())
        entries += [_entry(str(path), "local", path) for path in found]
    return entries + [_entry(repo.repo_id, "hf-cache", path, size)
                      for repo, path, size in _cached_snapshots()]


def format_table(entries: list[ModelEntry]) -> str:
    rows = [("NAME", "SOURCE", "SIZE", "FAMILY", "QUANTIZATION")]
    rows += [(e.name, e.source, _size(e.size_bytes), e.family, e.quantization) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def _pull(args: argparse.Namespace) -> int:
    path = from_hub(args.repo, args.revision)
    entry = _entry(args.repo, "hf-cache", path)
    print(f"{args.repo}: {_size(entry.size_bytes)} in {path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    entries = list_models(args.dirs)
    if args.json:
        for e in entries:
            print(json.dumps({**e.__dict__, "path": str(e.path)}))
    else:
        print(format_table(entries))
    return 0


def _rm(args: argparse.Namespace) -> int:
    name = args.name
    if Path(name).expanduser().is_dir() or name in bundled_models():
        raise ModelNotFound(f"{name!r} is a local directory or a bundled model: `noesis rm` "
                            "removes Hugging Face cache entries only")
    cache = _scan_cache()
    repos = {r.repo_id: r for r in cache.repos if r.repo_type == "model"} if cache else {}
    repo = repos.get(name)
    if repo is None:
        raise ModelNotFound(f"{name!r} is not in the Hugging Face cache ({cache_dir()}); cached "
                            f"models: {', '.join(sorted(repos)) or 'none'}")
    if not args.yes and not _confirm(f"remove {name} ({_size(repo.size_on_disk)}) from "
                                     f"{repo.repo_path}? [y/N] "):
        print("nothing removed")
        return 1
    cache.delete_revisions(*(rev.commit_hash for rev in repo.revisions)).execute()
    print(f"removed {name} ({_size(repo.size_on_disk)})")
    return 0


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _scan_cache():
    """huggingface_hub's HFCacheInfo of the cache, or None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(cache_dir())
    except CacheNotFound:
        return None


def _cached_snapshots():
    """(repo, snapshot path, revision size) of the newest revision of each cached model that
    holds a config.json."""
    cache = _scan_cache()
    for repo in sorted(cache.repos if cache else (), key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            if (revision.snapshot_path / "config.json").is_file():
                yield repo, revision.snapshot_path, revision.size_on_disk
                break  # the newest revision stands for the repo


def _entry(name: str, source: str, path: Path, size: int | None = None) -> ModelEntry:
    family, quantization = _describe(path)
    if size is None:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return ModelEntry(name, source, path, size, family, quantization)


def _describe(path: Path) -> tuple[str, str]:
    """(family, quantization) from config.json, without loading anything."""
    try:
        config = read_json_file(path / "config.json", CONFIG_MAX_BYTES)
    except CheckpointError:
        return "?", "?"
    family = str(config.get("model_type") or "?")
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return family, "none"
    method, bits = quant.get("quant_method", "?"), quant.get("bits")
    return family, f"{method} ({bits}-bit)" if bits else str(method)


def _size(num_bytes: int) -> str:
    value, unit = float(num_bytes), "B"
    for bigger in ("KB", "MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise ConfigError("not asking on a non-interactive input: pass --yes to remove")
    return input(question).strip().lower() in ("y", "yes")
