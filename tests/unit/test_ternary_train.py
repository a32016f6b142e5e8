"""Ternary QAT: BitLinear's forward and straight-through gradients, and a few training steps whose
packed export noesis.LLM loads and runs as the trainer's own forward does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from noesis import LLM, SamplingParams
from noesis.ternary.bitlinear import BitLinear, packed_tensors, to_bitlinear
from noesis.ternary.quant import absmean_ternary, pack, quantize_activations, reference_linear
from noesis.tiny import data, train
from noesis.tiny.model import LlamaForCausalLM


def bitlinear(out_features: int = 24, in_features: int = 40, seed: int = 0) -> BitLinear:
    torch.manual_seed(seed)
    return BitLinear(in_features, out_features, bias=False)


def test_forward_is_the_packed_reference():
    layer = bitlinear()
    x = torch.randn(3, 5, 40)
    ternary, scale = absmean_ternary(layer.weight.detach())
    packed = pack(ternary.to(torch.int8))
    expected = reference_linear(x.flatten(0, 1), packed, scale.expand(24), 40).view(3, 5, 24)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_gradients_are_straight_through():
    layer = bitlinear()
    x = torch.randn(4, 40, requires_grad=True)
    grad_out = torch.randn(4, 24)
    layer(x).backward(grad_out)
    ternary, scale = absmean_ternary(layer.weight.detach())
    q, s = quantize_activations(x.detach())
    torch.testing.assert_close(x.grad, grad_out @ (ternary * scale))  # through the dequantized W
    torch.testing.assert_close(layer.weight.grad, grad_out.T @ (q / s))  # through quantized x


def test_to_bitlinear_keeps_names_and_parameters():
    model = LlamaForCausalLM(train.SIZES["test"])
    before = dict(model.named_parameters())
    to_bitlinear(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert isinstance(model.model.layers[1].mlp.down_proj, BitLinear)
    assert not isinstance(model.model.embed_tokens, BitLinear)


def test_export_packs_only_the_projections():
    model = to_bitlinear(LlamaForCausalLM(train.SIZES["test"]))
    tensors = packed_tensors(model, torch.bfloat16)
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].shape == (32, 8)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (32,)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert not any(key.endswith("proj.weight") for key in tensors)


@pytest.fixture(scope="module")
def data_dir(tiny_data_dir):
    return tiny_data_dir


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A few ternary training steps, exported in float32 so that only the projections change."""
    torch.manual_seed(0)
    config = train.TrainConfig(
        size="test", steps=6, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=1,
        eval_every=1000, eval_batches=1, log_every=3, ternary=True,
    )  # fmt: skip
    vocab = data.tokenizer.load(data_dir / data.TOKENIZER_DIR).get_vocab_size()
    model = to_bitlinear(LlamaForCausalLM(train._sized(train.SIZES["test"], vocab, config.seq_len)))
    stream = data.TokenStream(data_dir, "train", config.seq_len)
    heldout = data.TokenStream(data_dir, "heldout", config.seq_len)
    train.train(model, stream, heldout, config, torch.device("cpu"))
    out = tmp_path_factory.mktemp("ternary-model")
    train.export(model, out, data_dir, torch.float32, ternary=True)
    return model.eval(), out


def test_command_line_trains_and_exports_ternary(data_dir, tmp_path):
    args = ["--out", str(tmp_path), "--data", str(data_dir), "--size", "test", "--ternary"]
    args += ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1"]
    args += ["--eval-batches", "1", "--log-every", "1", "--device", "cpu"]
    train.main(args)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "ternary"
    assert json.loads((tmp_path / "training_summary.json").read_text())["train"]["ternary"]
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        assert "model.layers.0.mlp.gate_proj.weight_packed" in handle.keys()
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_engine_runs_the_trained_ternary_model(trained):
    """The engine's logprobs equal the trainer's own forward on the same tokens: the export and
    the kernel reproduce the QAT arithmetic (int8 activations, ternary weights) exactly."""
    model, path = trained
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    prompt = llm.tokenizer.encode("The weather in Paris")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params)[0]
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        logprobs = model(ids)[0, len(prompt) - 1 :].float().log_softmax(-1)  # [12, V]
    assert out.token_ids == logprobs.argmax(-1).tolist()
    expected = [float(row[t]) for row, t in zip(logprobs, out.token_ids, strict=True)]
    got = [row[t] for row, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
