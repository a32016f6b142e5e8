"""The shipped noesis-tiny pair: files, sizes, template, and a greedy tool call from the target."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noesis.tiny import corpus, harmony, tokenizer
from noesis.tiny.model import LlamaConfig, LlamaForCausalLM
from noesis.tiny.template import CHAT_TEMPLATE

MODELS = Path(__file__).resolve().parents[2] / "models"
PAIR = (MODELS / "noesis-tiny", MODELS / "noesis-tiny-draft")
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
)

pytestmark = pytest.mark.skipif(
    not all(p.is_dir() for p in PAIR), reason="models/noesis-tiny* not present"
)


def _load(directory: Path) -> LlamaForCausalLM:
    hf = json.loads((directory / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        max_position_embeddings=hf["max_position_embeddings"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        tie_word_embeddings=hf["tie_word_embeddings"],
    )
    model = LlamaForCausalLM(config)
    state = {k: v.float() for k, v in load_file(directory / "model.safetensors").items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_files_sizes_and_shared_tokenizer():
    for directory in PAIR:
        assert all((directory / name).is_file() for name in FILES), directory
        assert (directory / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHAT_TEMPLATE
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [7, 8, 0]
    weights = sum((d / "model.safetensors").stat().st_size for d in PAIR)
    assert weights <= 48_000_000
    target, draft = ((d / "tokenizer.json").read_text() for d in PAIR)
    assert target == draft
    tok = tokenizer.load(PAIR[0])
    assert [tok.token_to_id(t) for t in harmony.SPECIAL_TOKENS] == list(range(9))


def test_weights_are_bf16_under_hugging_face_names():
    state = load_file(PAIR[0] / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state


@torch.no_grad()
def test_target_calls_the_calculator_on_a_held_out_question():
    example = next(
        e for e in corpus.generate(2024, "heldout", 100) if e.expected_tool == "calculator"
    )
    tok = tokenizer.load(PAIR[0])
    prompt = harmony.render(example.prompt_messages, example.tools, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    model, call_id, new = _load(PAIR[0]), tok.token_to_id(harmony.CALL), []
    for _ in range(80):  # greedy, no KV cache: short enough on a CPU
        next_id = int(model(torch.tensor([ids + new]))[0, -1].argmax())
        new.append(next_id)
        if next_id == call_id:
            break
    completion = harmony.parse_completion(tok.decode(new, skip_special_tokens=False))
    call = completion.tool_call
    assert call is not None and call.recipient == "functions.calculator"
    assert json.loads(call.content) == example.expected_arguments
