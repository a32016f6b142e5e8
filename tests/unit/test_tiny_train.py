"""noesis.tiny training: a few CPU steps, then transformers loads the export with equal logits."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from noesis.tiny import corpus, data, harmony, train
from noesis.tiny.model import LlamaConfig, LlamaForCausalLM, count_parameters


@pytest.fixture(scope="module")
def data_dir(tiny_data_dir):
    return tiny_data_dir


def _trained(data_dir, steps: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = train.TrainConfig(
        size="test",
        steps=steps,
        batch_size=4,
        seq_len=64,
        lr=3e-3,
        warmup_steps=1,
        eval_every=1000,
        eval_batches=1,
        log_every=2,
    )
    vocab = data.tokenizer.load(data_dir / data.TOKENIZER_DIR).get_vocab_size()
    model = LlamaForCausalLM(train._sized(train.SIZES["test"], vocab, config.seq_len))
    stream = data.TokenStream(data_dir, "train", config.seq_len)
    heldout = data.TokenStream(data_dir, "heldout", config.seq_len)
    result = train.train(model, stream, heldout, config, torch.device("cpu"))
    assert result.steps == steps and np.isfinite(result.heldout_loss)
    return model


def test_parameter_names_are_hugging_face_llama():
    model = LlamaForCausalLM(train.SIZES["test"])
    names = set(model.state_dict())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "lm_head.weight" not in names
    expected_layer = {
        f"model.layers.1.{part}.weight"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    }
    assert expected_layer <= names
    assert count_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_sizes_fit_the_budget():
    target, draft = (train._sized(train.SIZES[s], 8192, 1024) for s in ("target", "draft"))
    assert 18e6 <= count_parameters(target) <= 21e6
    assert 2e6 <= count_parameters(draft) <= 4e6
    assert 2 * (count_parameters(target) + count_parameters(draft)) <= 48e6


def test_learning_rate_warms_up_then_decays():
    config = train.TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert train.learning_rate(config, 0, 0.0) == pytest.approx(0.1)
    assert train.learning_rate(config, 50, 0.0) == pytest.approx(1.0)
    assert train.learning_rate(config, 50, 1.0) == pytest.approx(0.1)
    assert train.progress_of(replace(config, steps=100, minutes=1.0), 50, 45.0) == 0.75


def test_transformers_loads_the_export_with_the_same_logits(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _trained(data_dir).eval()
    train.export(model, tmp_path, data_dir, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    hf.eval()
    ids = torch.from_numpy(data.TokenStream(data_dir, "heldout", 48).windows(np.array([0, 50]))[0])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert hf.generation_config.eos_token_id == [7, 8, 0]
    assert hf.config.tie_word_embeddings


def test_bf16_export_loads(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _trained(data_dir, steps=2).eval()
    train.export(model, tmp_path, data_dir, torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    rounded = LlamaForCausalLM(model.config)
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    ids = torch.tensor([[2, 30, 40, 50, 4, 60]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, rounded(ids), rtol=1e-4, atol=1e-4)


def test_tied_config_roundtrip():
    config = LlamaConfig(
        tie_word_embeddings=False,
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=64,
    )
    model = LlamaForCausalLM(config)
    assert "lm_head.weight" in model.state_dict()
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_compile_failure_falls_back_to_eager(data_dir, monkeypatch, capsys):
    def broken(_):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda model: broken)
    config = train.TrainConfig(size="test", steps=2, batch_size=2, seq_len=32, eval_batches=1)
    vocab = data.tokenizer.load(data_dir / data.TOKENIZER_DIR).get_vocab_size()
    model = LlamaForCausalLM(train._sized(train.SIZES["test"], vocab, 32))
    stream = data.TokenStream(data_dir, "train", 32)
    result = train.train(model, stream, stream, replace(config, compile=True), torch.device("cpu"))
    assert result.steps == 2 and "training eagerly" in capsys.readouterr().out


def test_history_turns_are_masked_out_of_the_loss(data_dir):
    example = next(e for e in corpus.generate(3, "train", 400) if e.history_spans())
    tok = data.tokenizer.load(data_dir / data.TOKENIZER_DIR)
    encoding = tok.encode(example.text(), add_special_tokens=False)
    mask = data._loss_mask(encoding.offsets, example.history_spans())
    masked = tok.decode([i for i, m in zip(encoding.ids, mask, strict=False) if not m], False)
    history = [m for m in example.prompt_messages if m["role"] == "assistant"]
    assert masked == "".join(harmony.assistant_text(m, is_last=False) for m in history)
    assert mask[-1] == 1 and mask.size == len(encoding.ids) + 1
    stream = data.TokenStream(data_dir, "train", 64)
    tokens, loss_mask = stream.batch(np.random.default_rng(0), 8)
    assert tokens.shape == loss_mask.shape == (8, 65) and loss_mask.dtype == bool
    inputs, targets = train._to_device(
        (tokens, loss_mask), train.TrainConfig(), torch.device("cpu")
    )
    assert torch.equal(targets == -100, torch.from_numpy(~loss_mask[:, 1:]))
    unmasked = train.TrainConfig(mask_history=False)
    assert (train._to_device((tokens, loss_mask), unmasked, torch.device("cpu"))[1] >= 0).all()
