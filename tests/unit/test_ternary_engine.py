"""Ternary checkpoints through the engine: noesis.LLM on packed projections against transformers
running the same model with the dequantized weights and the same int8 activation quantization.

The reference is exact arithmetic of the same function: transformers' float32 forward with each
projection's weight replaced by w * scale and its input by q / s (forward pre-hooks). The kernel
computes q @ w in int32 and scales once, so the two differ only by float32 rounding; greedy tokens
must be identical and per-token logprobs within 1e-4.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import hf_generate, load_reference, noesis_greedy
from safetensors.torch import load_file, save_file

from noesis import LLM, CheckpointMismatch, UnsupportedModel
from noesis.ternary import TernaryFormatError
from noesis.ternary.linear import TernaryLinear
from noesis.ternary.quant import (
    absmean_ternary,
    pack,
    quantization_config,
    quantize_activations,
)

PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)
PROMPT = [0, 5, 9, 77, 100, 21, 3, 8]
NEW_TOKENS = 24
LOGPROB_TOL = 1e-4


def is_projection(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS


def make_ternary(float_dir, out) -> dict[str, torch.Tensor]:
    """Write a ternary copy of a float checkpoint to `out`; returns the dequantized projections."""
    shutil.copytree(float_dir, out)
    (out / "model.safetensors").unlink()
    tensors, dequantized = {}, {}
    for key, weight in load_file(float_dir / "model.safetensors").items():
        if not is_projection(key):
            tensors[key] = weight
            continue
        ternary, scale = absmean_ternary(weight.float())
        base = key.removesuffix(".weight")
        tensors[f"{base}.weight_packed"] = pack(ternary.to(torch.int8))
        tensors[f"{base}.weight_scale"] = scale.expand(weight.shape[0]).contiguous()
        dequantized[key] = ternary * scale
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


def reference(float_dir, dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers with the dequantized weights and int8-quantized projection inputs."""
    model = load_reference(float_dir)
    state = model.state_dict()
    with torch.no_grad():
        for key, weight in dequantized.items():
            state[key].copy_(weight)
    for name, module in model.named_modules():
        if name.split(".")[-1] in PROJECTIONS:
            module.register_forward_pre_hook(_fake_quant_input)
    return model


def _fake_quant_input(module, args):
    q, s = quantize_activations(args[0].float())
    return (q / s,)


@pytest.fixture(scope="module", params=["llama", "llama-mha-tied-bias", "phi3"])
def ternary_pair(request, checkpoints, tmp_path_factory):
    float_dir = checkpoints.path(request.param)
    out = tmp_path_factory.mktemp("ternary") / request.param
    dequantized = make_ternary(float_dir, out)
    return out, reference(float_dir, dequantized)


def test_greedy_tokens_match_dequantized_reference(ternary_pair):
    path, model = ternary_pair
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    tokens, logprobs = noesis_greedy(llm, PROMPT, NEW_TOKENS)
    ref_tokens, ref_rows = hf_generate(model, PROMPT, NEW_TOKENS)
    assert tokens == ref_tokens
    ref_logprobs = [float(row[t]) for row, t in zip(ref_rows, tokens, strict=True)]
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < LOGPROB_TOL


def test_projections_are_packed_in_memory(ternary_pair):
    path, _ = ternary_pair
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    model = llm.engine.loaded.model
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(proj, TernaryLinear)
        assert proj.weight_packed.dtype == torch.uint8
    assert not isinstance(model.model.embed_tokens, TernaryLinear)


def _cut_last_byte_column(t):
    return t[:, :-1].contiguous()


def _set_code_3(t):
    t = t.clone()
    t[3, 2] = 0b11_00_01_10  # code 3 in the top field
    return t


def _negate_first(t):
    t = t.clone()
    t[0] = -1.0
    return t


@pytest.mark.parametrize(
    ("key", "corrupt", "error", "match"),
    [  # each corrupt tensor is refused at load, by name
        ("model.layers.1.mlp.down_proj.weight_packed", _cut_last_byte_column,
         CheckpointMismatch, "down_proj.weight_packed"),
        ("model.layers.0.self_attn.k_proj.weight_packed", lambda t: t.to(torch.int16),
         CheckpointMismatch, "k_proj.weight_packed.*int16"),
        ("model.layers.0.self_attn.v_proj.weight_packed", _set_code_3,
         TernaryFormatError, "qkv_proj.weight_packed.*code 3"),
        ("model.layers.1.mlp.up_proj.weight_scale", _negate_first,
         TernaryFormatError, "gate_up_proj.weight_scale"),
    ],
)
def test_corrupt_packed_checkpoints_are_refused(checkpoints, tmp_path, key, corrupt, error,
                                                match):
    out = tmp_path / "bad"
    make_ternary(checkpoints.path("llama"), out)
    tensors = load_file(out / "model.safetensors")
    tensors[key] = corrupt(tensors[key])
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(error, match=match):
        LLM(str(out), device="cpu", dtype="float32", progress=False)


def test_float_weights_under_a_ternary_config_are_named(checkpoints, tmp_path):
    out = shutil.copytree(checkpoints.path("llama"), tmp_path / "mislabelled")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatch, match="missing .*weight_packed"):
        LLM(str(out), device="cpu", dtype="float32", progress=False)


def test_unsupported_ternary_variant(checkpoints, tmp_path):
    out = tmp_path / "variant"
    make_ternary(checkpoints.path("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["weight_scale"] = "per_group"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="weight_scale='per_group'"):
        LLM(str(out), device="cpu", dtype="float32", progress=False)
