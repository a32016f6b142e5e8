"""Tiny random-weight Hugging Face checkpoints built on the fly with `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 384
TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world! Numbers 0123456789 and "
    "punctuation ,.;:?! (brackets) [more] {braces}. Ünïcödé: café, naïve, 日本語, emoji 🙂. "
    "Tiny models speak nonsense but deterministic nonsense."
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def build_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def build_checkpoint(
    out: Path,
    family: str = "llama",
    seed: int = 0,
    dtype=torch.float32,
    std: float = 0.3,
    shard_bytes: str | None = None,
    **overrides,
) -> Path:
    """Save a random model of `family` with a matching tokenizer to `out`; returns `out`."""
    import transformers

    config_name, model_name, family_defaults = FAMILIES[family]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=std,
    )
    kwargs.update(family_defaults)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(out, **save_kwargs)
    build_tokenizer(out)
    return out


def load_reference(path: Path, dtype=torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()
