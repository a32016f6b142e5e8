"""Tiny checkpoints of the tool-calling families for the dialect tests: a byte-level BPE tokenizer
with the family's special tokens, the family's chat template (tests/data/chat_templates, whose
SOURCES.md records where each format comes from and its licence), and random weights."""

from __future__ import annotations

import json
from pathlib import Path

from checkpoints import VOCAB

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


# family -> (template, special tokens, added non-special tokens, eos tokens, bos)
FAMILIES = {
    "qwen25": (
        template("qwen25"),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>"],
        ["<|im_end|>", "<|endoftext|>"],
        None,
    ),
    "qwen3": (
        template("qwen3"),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        ["<|im_end|>", "<|endoftext|>"],
        None,
    ),
    "llama31": (
        template("llama31"),
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        [],
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
    ),
    "mistral03": (
        template("mistral03"),
        [
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
        ["</s>"],
        "<s>",
    ),
    "r1_distill": (
        template("r1_distill"),
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        ["<think>", "</think>"],
        ["<｜end▁of▁sentence｜>"],
        "<｜begin▁of▁sentence｜>",
    ),
}
# Text the tokenizer learns merges from: JSON calls, the tool names and words the tests use.
CORPUS = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} '
    '{"name": "add", "parameters": {"a": 17, "b": 23}} The weather in Paris is sunny. '
    "What is the weather like in Paris today? Let me think about it step by step. "
    "0123456789 true false null [] {} , : ; \n\n"
)


def build_family_tokenizer(out: Path, family: str) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of `family`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, added, eos, bos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 16 - len(added),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(out / "tokenizer.json"))
    config = {
        "eos_token": eos[0],
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if bos is not None:
        config["bos_token"] = bos
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [tok.token_to_id(t) for t in eos]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def family_checkpoints(weights: Path, root: Path, families) -> dict[str, Path]:
    """The random llama-shaped weights of `weights` (the shared "llama" tiny checkpoint) beside
    each family's tokenizer and template, with room for the families' long tool prompts (the
    default rope's weights do not depend on the context length)."""
    import shutil

    config = json.loads((weights / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    built = {}
    for family in families:
        out = root / family
        out.mkdir()
        shutil.copy(weights / "model.safetensors", out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(config))
        build_family_tokenizer(out, family)
        built[family] = out
    return built
