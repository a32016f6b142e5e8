"""Tensor parallelism on the CPU: 2 gloo ranks (this process is rank 0, one spawned rank, kept
for the module and reused by each engine) against the single-process run on the same weights.
The last test kills the spawned rank."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from noesis import LLM, SamplingParams
from noesis.distributed.group import RankFailure
from noesis.distributed.layers import Shard, check_shardable, parallel_model
from noesis.distributed.loading import load_shard_weights
from noesis.errors import ConfigError
from noesis.models.config import ModelConfig

PROMPTS = [[0, 5, 9, 77, 100, 21], list(range(30, 50))]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
LOGPROB_TOL = 1e-4  # float32: partial sums all-reduced in another order than one matmul
# llama-mqa: 1 KV head for 2 ranks (replicated); llama: GQA 4/2 (one KV head each); qwen2-tied:
# biased q/k/v and a tied head; qwen3: q/k norms, head_dim 24; llama-mha-tied-bias: biased
# o_proj and MLP (row-parallel biases added once); phi3: q/k/v and gate/up stored fused;
# gemma2: soft-caps, scaled embeddings, sliding layers; gemma3: q/k norms, two rotaries;
# qwen3-moe (a dense layer too), mixtral: per-expert tensors; gpt-oss: stacked interleaved
# experts with biases, sinks, biased o_proj; lfm2: short convolutions split by channel.
FAMILIES = ["llama-mqa", "llama", "qwen2-tied", "qwen3", "llama-mha-tied-bias", "phi3",
            "gemma2", "gemma3", "qwen3-moe", "mixtral", "gpt-oss", "lfm2"]


# Their biases are saved as zeros: randomized here, or "added once" could not fail.
RANDOM_BIASES = ("gpt-oss", "lfm2")


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_single_process(checkpoints, tmp_path_factory, name):
    if name in RANDOM_BIASES:
        path = _random_biases(checkpoints.path(name), tmp_path_factory.mktemp(name))
        expected = LLM(str(path), device="cpu", dtype="float32", progress=False).generate(
            PROMPTS, PARAMS)
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False,
                  tensor_parallel_size=2)
    else:
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


def _random_biases(path: Path, dest: Path) -> Path:
    """A copy of checkpoint `path` whose biases are random (std 0.3)."""
    shutil.copytree(path, dest, dirs_exist_ok=True)
    tensors = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for key, tensor in tensors.items():
        if key.endswith("bias"):
            tensors[key] = torch.randn(tensor.shape, generator=gen) * 0.3
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("name", ["llama-mqa", "qwen2-tied", "phi3", "gpt-oss", "lfm2"])
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
            module = parallel_model(shard, group=None)
        module = module.to_empty(device="cpu")
        read = load_shard_weights(module, shard, path)
        assert read == _expected_bytes(full, config, rank)
        shards.append(dict(module.named_parameters()))
    assert sum(t.nbytes for t in full.values()) < 2 * read  # some tensors are read whole
    vocab = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(vocab, full["model.embed_tokens.weight"])
    REBUILT[config.family](shards, full, config)


def _rebuilt_dense(shards: list[dict], full: dict, config: ModelConfig) -> None:
    q = torch.cat([s["model.layers.0.self_attn.qkv_proj.weight"][: config.q_size // 2]
                   for s in shards])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    down = torch.cat([s["model.layers.1.mlp.down_proj.weight"] for s in shards], dim=1)
    assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"])


def _rebuilt_phi3(shards: list[dict], full: dict, config: ModelConfig) -> None:
    """Stored fused: each rank's q and k rows come from both parts of the one tensor."""
    q, kv = config.q_size // 2, config.kv_size // 2
    fused = [s["model.layers.0.self_attn.qkv_proj.weight"] for s in shards]
    stored = full["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(torch.cat([f[:q] for f in fused]), stored[: config.q_size])
    k = torch.cat([f[q : q + kv] for f in fused])
    assert torch.equal(k, stored[config.q_size : config.q_size + config.kv_size])
    width = config.intermediate_size
    up = torch.cat([s["model.layers.0.mlp.gate_up_proj.weight"][width // 2 :] for s in shards])
    assert torch.equal(up, full["model.layers.0.mlp.gate_up_proj.weight"][width:])


def _rebuilt_gpt_oss(shards: list[dict], full: dict, config: ModelConfig) -> None:
    """Stacked [E, in, out], gate and up interleaved; the down bias on rank 0 only."""
    prefix = "model.layers.0.mlp.experts."
    width = config.moe.intermediate_size // 2
    up = torch.cat([s[prefix + "gate_up_proj"][:, width:] for s in shards], dim=1)
    assert torch.equal(up, full[prefix + "gate_up_proj"][..., 1::2].transpose(1, 2))
    down = torch.cat([s[prefix + "down_proj"] for s in shards], dim=2)
    assert torch.equal(down, full[prefix + "down_proj"].transpose(1, 2))
    assert torch.equal(shards[0][prefix + "down_proj_bias"], full[prefix + "down_proj_bias"])
    assert not shards[1][prefix + "down_proj_bias"].any()
    sinks = torch.cat([s["model.layers.0.self_attn.sinks"] for s in shards])
    assert torch.equal(sinks, full["model.layers.0.self_attn.sinks"])


def _rebuilt_lfm2(shards: list[dict], full: dict, config: ModelConfig) -> None:
    """The conv's channels: in_proj's x rows (its third part) and the depthwise kernel."""
    prefix, channels = "model.layers.0.conv.", config.hidden_size // 2
    values = torch.cat([s[prefix + "in_proj.weight"][2 * channels :] for s in shards])
    assert torch.equal(values, full[prefix + "in_proj.weight"][2 * config.hidden_size :])
    kernel = torch.cat([s[prefix + "conv.weight"] for s in shards])
    assert torch.equal(kernel, full[prefix + "conv.weight"])


REBUILT = {"llama": _rebuilt_dense, "qwen2": _rebuilt_dense, "phi3": _rebuilt_phi3,
           "gpt_oss": _rebuilt_gpt_oss, "lfm2": _rebuilt_lfm2}
# checkpoint tensors each rank reads half of (the rest: whole, but gpt-oss's expert down bias)
HALVED = (r"q_proj|gate_proj|up_proj|(o|out|down)_proj\.weight|embed_tokens|lm_head|qkv_proj"
          r"|gate_up_proj|experts\.down_proj$|\.w[123]\.|in_proj|conv\.conv\.|sinks")


def _expected_bytes(full: dict[str, torch.Tensor], config: ModelConfig, rank: int) -> int:
    """One rank's bytes: half of every split tensor, K/V whole when a KV head is replicated."""
    halved = HALVED + ("|k_proj|v_proj" if config.num_kv_heads >= 2 else "")
    total = 0
    for key, tensor in full.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if key.endswith("experts.down_proj_bias"):
            total += tensor.nbytes if rank == 0 else 0
        else:
            total += tensor.nbytes // 2 if re.search(halved, key) else tensor.nbytes
    return total


def test_unsupported_shapes_fail_before_any_rank_starts(checkpoints):
    with pytest.raises(ConfigError, match=r"must divide the attention heads \(4\)"):
        checkpoints.new_llm("qwen3", tensor_parallel_size=3)


def test_unshardable_models_are_refused_with_the_reason(checkpoints):
    def config(name: str) -> ModelConfig:
        return ModelConfig.from_hf(json.loads((checkpoints.path(name) / "config.json").read_text()))

    llama, mixtral, gpt_oss, lfm2 = (config(n) for n in ("llama", "mixtral", "gpt-oss", "lfm2"))
    cases = [
        (replace(llama, family="bert"), "does not support family 'bert'; supported families: "),
        (replace(llama, raw={"quantization_config": {"quant_method": "awq"}}),
         r"quantized \(awq\) checkpoints"),
        (replace(gpt_oss, moe=replace(gpt_oss.moe, mxfp4=True)), "MXFP4 expert weights"),
        (replace(mixtral, moe=replace(mixtral.moe, intermediate_size=33)),
         r"must divide the expert width \(33\)"),
        (replace(lfm2, hidden_size=65), r"must divide the short-convolution channels \(65\)"),
        (replace(llama, num_kv_heads=3, num_heads=6), r"KV heads \(3\) must divide one another"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_shardable(model, 2)


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(checkpoints):
    """Last: it takes the module's spawned rank down."""
    llm = checkpoints.new_llm("llama-mqa", tensor_parallel_size=2)
    (worker,) = llm.engine.parallel.group.workers
    os.kill(worker.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RankFailure, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        llm.generate(PROMPTS, PARAMS)
    assert time.perf_counter() - start < 20
