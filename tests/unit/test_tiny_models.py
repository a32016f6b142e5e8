"""The shipped noesis-tiny pair: files, sizes, template, and a greedy tool call from the target."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_completion
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


def greedy(
    model: LlamaForCausalLM, ids: list[int], stop_id: int, limit: int, guess: list[int]
) -> list[int]:
    """The model's greedy continuation of ids, up to stop_id or `limit` tokens. Without a KV
    cache each token is a forward over the whole sequence, so a guessed continuation is checked
    in one forward, as speculative decoding verifies a draft: kept up to its first disagreement,
    plus the model's own token there. A wrong guess costs forwards, never tokens."""
    new: list[int] = []
    while len(new) < limit and (not new or new[-1] != stop_id):
        tail = guess[len(new) :]
        logits = model(torch.tensor([ids + new + tail]))[0, len(ids) + len(new) - 1 :]
        for offset, token in enumerate(logits.argmax(-1).tolist()):
            new.append(token)
            if offset == len(tail) or token != tail[offset]:
                break
            if token == stop_id or len(new) == limit:
                break
        guess = guess if guess[: len(new)] == new else new
    return new


@torch.no_grad()
def test_target_calls_the_calculator_on_a_held_out_question():
    """The target under the training code's own model class (not the engine) calls the
    calculator greedily; the engine's greedy tokens are only the guess that saves forwards."""
    from noesis import LLM, SamplingParams

    example = next(
        e for e in corpus.generate(2024, "heldout", 100) if e.expected_tool == "calculator"
    )
    tok = tokenizer.load(PAIR[0])
    prompt = harmony.render(example.prompt_messages, example.tools, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    engine = LLM(str(PAIR[0]), device="cpu", dtype="float32", progress=False)
    guess = engine.generate([ids], SamplingParams(temperature=0, max_tokens=80))[0].token_ids
    new = greedy(_load(PAIR[0]), ids, tok.token_to_id(harmony.CALL), 80, list(guess))
    encoding = HarmonyEncoding.from_file(PAIR[0], NOESIS_TINY)
    calls = parse_completion(encoding, new).tool_calls
    assert calls and calls[0].recipient == "functions.calculator"
