"""Tensor parallelism on the CPU: 2 gloo ranks (this process is rank 0, one spawned rank, kept
for the module and reused by each engine) against the single-process run on the same weights.
The last test kills the spawned rank."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors import safe_open

from noesis import SamplingParams
from noesis.distributed.group import RankFailure
from noesis.distributed.layers import ParallelDecoderLM, Shard
from noesis.distributed.loading import load_shard_weights
from noesis.errors import ConfigError
from noesis.models.config import ModelConfig

PROMPTS = [[0, 5, 9, 77, 100, 21], list(range(30, 50))]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
LOGPROB_TOL = 1e-4  # float32: partial sums all-reduced in another order than one matmul
# llama-mqa: 1 KV head for 2 ranks (replicated); llama: GQA 4/2 (one KV head each); qwen2-tied:
# biased q/k/v and a tied head; qwen3: q/k norms, head_dim 24; llama-mha-tied-bias: biased
# o_proj and MLP (row-parallel biases added once).
FAMILIES = ["llama-mqa", "llama", "qwen2-tied", "qwen3", "llama-mha-tied-bias"]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_single_process(checkpoints, name):
    expected = checkpoints.llm(name).generate(PROMPTS, PARAMS)
    llm = checkpoints.new_llm(name, tensor_parallel_size=2)
    assert llm.engine.loaded.config.num_heads == 2  # this rank holds half the query heads
    got = llm.generate(PROMPTS, PARAMS)
    for one, two in zip(expected, got, strict=True):
        assert two.token_ids == one.token_ids
        for step_one, step_two in zip(one.logprobs, two.logprobs, strict=True):
            assert step_two.keys() == step_one.keys()
            for token, logprob in step_one.items():
                assert step_two[token] == pytest.approx(logprob, abs=LOGPROB_TOL)


@pytest.mark.parametrize("name", ["llama-mqa", "qwen2-tied"])
def test_each_rank_reads_only_its_slices(checkpoints, name):
    """Both ranks' shards loaded here (loading needs no collective): each reads exactly its
    share, counted from the checkpoint's own header, and the two together rebuild the tensors."""
    path = checkpoints.path(name)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        full = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    shards = []
    for rank in (0, 1):
        shard = Shard(config, rank, 2)
        with torch.device("meta"):
            module = ParallelDecoderLM(shard, group=None)
        module = module.to_empty(device="cpu")
        read = load_shard_weights(module, shard, path)
        assert read == _expected_bytes(full, config)
        shards.append(dict(module.named_parameters()))
    assert sum(t.nbytes for t in full.values()) < 2 * read  # some tensors are read whole
    q = torch.cat([s["model.layers.0.self_attn.qkv_proj.weight"][: config.q_size // 2]
                   for s in shards])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    down = torch.cat([s["model.layers.1.mlp.down_proj.weight"] for s in shards], dim=1)
    assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"])
    vocab = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(vocab, full["model.embed_tokens.weight"])


def _expected_bytes(full: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """One rank's bytes: half of every split tensor, K/V whole when a KV head is replicated."""
    split = ("q_proj", "gate_proj", "up_proj", "o_proj.weight", "down_proj.weight",
             "embed_tokens", "lm_head")
    if config.num_kv_heads >= 2:
        split += ("k_proj", "v_proj")
    total = 0
    for key, tensor in full.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        total += tensor.nbytes // 2 if any(part in key for part in split) else tensor.nbytes
    return total


def test_unsupported_shapes_fail_before_any_rank_starts(checkpoints):
    with pytest.raises(ConfigError, match="family 'phi3'"):
        checkpoints.new_llm("phi3", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"must divide the attention heads \(4\)"):
        checkpoints.new_llm("qwen3", tensor_parallel_size=3)


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(checkpoints):
    """Last: it takes the module's spawned rank down."""
    llm = checkpoints.new_llm("llama-mqa", tensor_parallel_size=2)
    (worker,) = llm.engine.parallel.group.workers
    os.kill(worker.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        llm.generate(PROMPTS, PARAMS)
    assert time.perf_counter() - start < 20
