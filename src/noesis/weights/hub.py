"""Resolving a model argument to a checkpoint directory: a local path, or a Hub repo id."""

from __future__ import annotations

import os
from pathlib import Path

from noesis.errors import ModelNotFound

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
# The bundled models: in a clone a link to the repository's models/, in a wheel package data.
BUNDLED_DIR = Path(__file__).resolve().parents[1] / "bundled"


def bundled_models() -> dict[str, Path]:
    """Name -> directory of each bundled checkpoint (noesis-tiny, ...)."""
    if not BUNDLED_DIR.is_dir():
        return {}
    return {path.name: path for path in sorted(BUNDLED_DIR.iterdir())
            if (path / "config.json").is_file()}


def resolve_model_dir(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The checkpoint directory a model argument names, tried in this order by every command:
    a local directory, a bundled model's name (noesis-tiny), a Hugging Face repo id (the cache,
    else a download unless offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face checkpoint?")
        return path
    text = str(model)
    bundled = bundled_models().get(text)
    if bundled is not None:
        return bundled
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFound(f"model path {text!r} is not a checkpoint directory")
    return from_hub(text, revision)


def from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of a Hub repo: from the cache, downloading what is missing unless
    offline (HF_HUB_OFFLINE=1). `noesis pull` calls it alone."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        local = snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline
        )
    except LocalEntryNotFoundError as exc:
        mode = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else \
            "the Hub could not be reached"
        raise ModelNotFound(
            f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{mode}. Either connect and unset HF_HUB_OFFLINE, then `noesis pull {repo_id}`; or "
            "pass a local checkpoint directory as the model; or copy a cache that holds it "
            f"(its models--{repo_id.replace('/', '--')} folder) into {constants.HF_HUB_CACHE}"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFound(f"no Hugging Face repository {repo_id!r} (or it is gated)") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFound(
            f"could not fetch {repo_id!r} from the Hugging Face Hub: {exc}"
        ) from exc
    return Path(local)
