"""Resolving a model argument to a checkpoint directory: a local path, or a Hub repo id."""

from __future__ import annotations

import os
from pathlib import Path

from noesis.errors import ModelNotFound

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def resolve_model_dir(model: str | os.PathLike, revision: str | None = None) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face checkpoint?")
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFound(f"model path {text!r} is not a checkpoint directory")
    return _from_hub(text, revision)


def _from_hub(repo_id: str, revision: str | None) -> Path:
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
        mode = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the Hub could not be reached"
        raise ModelNotFound(
            f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{mode}; download it on a connected machine or pass a local directory"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFound(f"no Hugging Face repository {repo_id!r} (or it is gated)") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFound(
            f"could not fetch {repo_id!r} from the Hugging Face Hub: {exc}"
        ) from exc
    return Path(local)
