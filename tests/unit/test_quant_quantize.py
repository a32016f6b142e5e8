"""`noesis quantize` round trip: a float checkpoint written as int4 (AWQ gemm layout) and int8
(GPTQ layout, per channel), loaded back by noesis, against the float model.

Per layer the loaded weights must equal the round-to-nearest values exactly; per model, greedy
tokens must stay those of the float model at int8 and the logprobs close at both widths (bounds
a few times what was measured on this model: int8 <= 0.011, int4 <= 0.19 nats)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import build_checkpoint, noesis_greedy
from safetensors.torch import load_file

from noesis import LLM, SamplingParams
from noesis.cli import main
from noesis.engine.loading import describe_checkpoint
from noesis.quant.quantize import quantize_int4, quantize_int8

PROMPT = [0, 5, 9, 77, 100, 21, 3, 8]
NEW_TOKENS = 16
INT8_TOL, INT4_TOL = 0.03, 0.4  # max |logprob difference| over the top-20 tokens per position


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    src = build_checkpoint(root / "float", "llama", std=0.05)
    assert main(["quantize", str(src), str(root / "int4"), "--bits", "4",
                 "--group-size", "32"]) == 0
    assert main(["quantize", str(src), str(root / "int8"), "--bits", "8"]) == 0
    llms = {name: LLM(str(root / name), device="cpu", dtype="float32", progress=False)
            for name in ("float", "int4", "int8")}
    return root, llms


def top_logprobs(llm, prompts):
    """The top-20 logprobs of the next token after each prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    return [out.logprobs[0] for out in llm.generate(prompts, params)]


def worst_logprob_error(llms, name, tokens) -> float:
    """Teacher-forced along the float model's greedy tokens: the largest |difference| over the
    tokens in both models' top 20."""
    prompts = [PROMPT + tokens[:i] for i in range(0, NEW_TOKENS, 2)]
    pairs = zip(top_logprobs(llms["float"], prompts), top_logprobs(llms[name], prompts),
                strict=True)
    return max(abs(a[t] - b[t]) for a, b in pairs for t in a if t in b)


def test_written_checkpoints_declare_their_layouts(written):
    root, _ = written
    int4 = json.loads((root / "int4" / "config.json").read_text())["quantization_config"]
    assert int4 == {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                    "zero_point": True}
    int8 = json.loads((root / "int8" / "config.json").read_text())["quantization_config"]
    assert (int8["quant_method"], int8["bits"], int8["group_size"]) == ("gptq", 8, -1)
    tensors = load_file(root / "int4" / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.qweight"].shape == (128, 64 // 8)  # [K, N/8]
    assert tensors["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    assert (root / "int4" / "tokenizer.json").exists()


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_loaded_weights_are_the_rounded_ones(written, name):
    root, llms = written
    weight = load_file(root / "float" / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    rounded = quantize_int4(weight, 32) if name == "int4" else quantize_int8(weight, -1)
    codes, zeros, scales = rounded
    group = weight.shape[1] // scales.shape[1]
    columns = torch.arange(weight.shape[1]) // group
    expected = (codes - zeros[:, columns]) * scales.float()[:, columns]
    layer = llms[name].engine.loaded.model.model.layers[1].mlp.down_proj
    assert torch.equal(layer.dequantize(), expected)
    assert (weight - expected).abs().max() <= scales.float().max()  # within a step


def test_int8_keeps_greedy_tokens_and_logprobs(written):
    _, llms = written
    tokens, _ = noesis_greedy(llms["float"], PROMPT, NEW_TOKENS)
    assert noesis_greedy(llms["int8"], PROMPT, NEW_TOKENS)[0] == tokens
    assert worst_logprob_error(llms, "int8", tokens) <= INT8_TOL


def test_int4_logprobs_stay_close(written):
    _, llms = written
    tokens, _ = noesis_greedy(llms["float"], PROMPT, NEW_TOKENS)
    int4, int8 = (worst_logprob_error(llms, name, tokens) for name in ("int4", "int8"))
    assert int4 <= INT4_TOL
    assert int8 < int4 / 4  # eight bits per weight are much closer than four


def test_info_reports_packed_and_float_bytes(written):
    root, _ = written
    packed, dense = describe_checkpoint(root / "int4"), describe_checkpoint(root / "float")
    assert packed["parameters"] == dense["parameters"]
    assert packed["quantization"].startswith("AWQ int4, group 32")
    assert packed["weights as float"] == dense["weights in memory"] + " in float32"
    assert packed["weights in memory"].endswith("of the float size)")


def test_quantize_refuses_a_quantized_source_and_a_used_destination(written, capsys):
    root, _ = written
    assert main(["quantize", str(root / "int4"), str(root / "again"), "--bits", "8"]) == 1
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", str(root / "float"), str(root / "int8"), "--bits", "8"]) == 1
    assert "is not empty" in capsys.readouterr().err
