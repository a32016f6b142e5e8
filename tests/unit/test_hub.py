"""Hub repo ids resolve through the huggingface_hub cache; offline and uncached names the repo.

huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE from the environment once, at import, into
`huggingface_hub.constants`; `snapshot_download` and noesis read those module attributes at call
time. So the tests set both the variables (for anything imported later) and the attributes.
"""

from __future__ import annotations

import shutil

import pytest
from checkpoints import noesis_greedy

from noesis import LLM, ModelNotFound

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache, repo_id: str, checkpoint, commit: str = COMMIT):
    """Lay a checkpoint out as huggingface_hub does: blobs are elided, snapshot files are copies."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_cached_repo_loads_offline(checkpoints, offline_cache):
    snapshot = cache_repo(offline_cache, "tiny-org/tiny-llama", checkpoints.path("llama"))
    llm = LLM("tiny-org/tiny-llama", device="cpu", dtype="float32", progress=False)
    assert llm.engine.loaded.model_dir.resolve() == snapshot.resolve()
    prompt = [0, 5, 9, 77]
    assert noesis_greedy(llm, prompt, 8) == noesis_greedy(checkpoints.llm("llama"), prompt, 8)


def test_revision_by_commit_hash(checkpoints, offline_cache):
    snapshot = cache_repo(offline_cache, "tiny-org/tiny-qwen3", checkpoints.path("qwen3"))
    llm = LLM("tiny-org/tiny-qwen3", device="cpu", dtype="float32", progress=False, revision=COMMIT)
    assert llm.engine.loaded.model_dir.resolve() == snapshot.resolve()
    assert llm.model_config.family == "qwen3"


def test_uncached_repo_offline_names_the_repo(checkpoints, offline_cache):
    cache_repo(offline_cache, "tiny-org/tiny-llama", checkpoints.path("llama"))
    with pytest.raises(ModelNotFound) as info:
        LLM("tiny-org/not-downloaded", device="cpu", progress=False)
    message = str(info.value)
    assert "tiny-org/not-downloaded" in message
    assert "HF_HUB_OFFLINE" in message and str(offline_cache) in message
    with pytest.raises(ModelNotFound, match="tiny-org/tiny-llama"):
        LLM("tiny-org/tiny-llama", device="cpu", progress=False, revision="no-such-branch")


def test_local_path_that_does_not_exist_is_not_sent_to_the_hub(offline_cache, tmp_path):
    with pytest.raises(ModelNotFound, match="not a checkpoint directory"):
        LLM(str(tmp_path / "missing"), device="cpu", progress=False)
