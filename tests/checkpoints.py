"""Tiny random-weight Hugging Face checkpoints built on the fly with `transformers`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"pad_token_id": 0}),
}


@dataclass(frozen=True)
class Spec:
    """A named tiny checkpoint: its family, config overrides, and the LLM options it needs."""

    family: str
    config: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # e.g. max_model_len past max_position


# Rotary parameters are chosen so that each scaling kind changes the result within a 6-token prompt
# plus 32 generated tokens (test_parity.py checks that they do).
LONG_FACTOR = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
SHORT_FACTOR = [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5]
SPECS = {
    # families and attention shapes (default rope); weights depend only on shapes and the seed
    "llama": Spec("llama"),  # GQA 4/2, untied
    "llama-mha-tied-bias": Spec(
        "llama",
        {
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "llama-mqa": Spec("llama", {"num_key_value_heads": 1}),
    "mistral-swa": Spec("mistral", {"sliding_window": 8}),
    "qwen2-tied": Spec("qwen2", {"tie_word_embeddings": True}),
    # Qwen slides only in layers >= max_window_layers: here all of them, and none
    "qwen2-sliding": Spec(
        "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    ),
    "qwen3-sliding-unused": Spec(
        "qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    ),
    "qwen3": Spec("qwen3"),  # head_dim 24 != hidden 64 / 4 heads
    "phi3": Spec("phi3"),
    "phi3-partial-rotary": Spec("phi3", {"partial_rotary_factor": 0.5}),
    "phi3-sliding": Spec("phi3", {"sliding_window": 8}),  # Phi-3 mini ships a 2047 window
    # routed experts and Gemma (tests/unit/test_families_moe.py): one checkpoint per family
    "qwen3-moe": Spec(
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": Spec(
        "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}
    ),
    "gpt-oss": Spec(
        "gpt_oss",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 4,
            "intermediate_size": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    # soft-caps low enough to bite (50 / 30 by default moved logprobs by only ~1e-2)
    "gemma2": Spec(
        "gemma2",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": Spec(
        "gemma3",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # short convolutions between attention layers (tests/unit/test_families_lfm2.py)
    "lfm2": Spec(
        "lfm2",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_bias": True,
            "block_multiple_of": 32,
        },
    ),
    # rope scaling kinds, all on the "llama" weights
    "llama-linear": Spec("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": Spec(
        "llama",
        {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        {"max_model_len": 64},
    ),
    "llama-yarn": Spec(
        "llama",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-llama3": Spec(
        "llama",
        {
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "phi3-longrope": Spec(
        "phi3",
        {
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": SHORT_FACTOR,
                "long_factor": LONG_FACTOR,
            },
        },
    ),
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


# Attention that SDPA cannot express: transformers' SDPA path drops soft-capping without a word,
# and before 5.2x Gemma 2 defaulted to it (5.17's reference differed from noesis by 0.027 in
# logprobs on the GPU run), so these references always run transformers' eager attention.
EAGER_ONLY = ("attn_logit_softcapping",)


def build_gpt_oss_o200k(out: Path) -> Path:
    """The tiny gpt-oss checkpoint with gpt-oss's real vocabulary: its embedding and head widened
    to o200k_harmony's 201,088 tokens, and the tokenizer noesis builds offline (cached in `out`'s
    parent, so a session builds it once)."""
    from safetensors.torch import load_file, save_file

    from noesis.harmony.tokenizer_file import VOCAB_SIZE, write_tokenizer
    from noesis.harmony.vocab import NAMED_SPECIAL_TOKENS

    build_checkpoint(out, "gpt_oss", **SPECS["gpt-oss"].config)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[key] = torch.randn(VOCAB_SIZE, tensors[key].shape[1], generator=gen) * 0.3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = VOCAB_SIZE
    config["bos_token_id"], config["eos_token_id"], config["pad_token_id"] = (
        NAMED_SPECIAL_TOKENS[token] for token in ("<|startoftext|>", "<|return|>", "<|endoftext|>")
    )
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(out, out.parent / "tokenizer-cache")
    return out


def load_reference(path: Path, dtype=torch.float32):
    import transformers

    config = json.loads((Path(path) / "config.json").read_text())
    eager = any(config.get(key) is not None for key in EAGER_ONLY)
    options = {"attn_implementation": "eager"} if eager else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options)
    return model.eval()


# ---- references computed with transformers ----------------------------------------------------


def reset_rope_state(model) -> None:
    """Undo dynamic NTK growth left by an earlier generate() (HF keeps it on the module)."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


@torch.no_grad()
def hf_generate(model, prompt: list[int], max_new_tokens: int, **options):
    """Greedy tokens and the per-step log-softmax rows [N, V] (of the raw logits) from HF's own
    cached generate(); `options` go to generate (e.g. repetition_penalty).

    EOS is disabled by clearing generation_config.eos_token_id (min_new_tokens would instead mask
    the EOS logit and change the distribution), and the attention mask is passed explicitly
    because token 0 doubles as the pad id.
    """
    reset_rope_state(model)
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **options,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack([step[0].float().log_softmax(-1) for step in out.logits])
    return tokens, logprobs


@torch.no_grad()
def hf_recompute(model, prompt: list[int], max_new_tokens: int):
    """Greedy decoding that reruns the whole sequence every step: no KV cache at all."""
    reset_rope_state(model)
    ids, rows = list(prompt), []
    for _ in range(max_new_tokens):
        reset_rope_state(model)
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        rows.append(logits.log_softmax(-1))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], torch.stack(rows)


def assert_same_half_precision_greedy(got, want, margin: float = 0.2, tolerance: float = 0.1):
    """Two half-precision runs of one prompt (RequestOutputs with logprobs) give the same greedy
    tokens and logprobs within `tolerance` of each other, up to the first step where they part;
    they may part only where want's top two were closer than `margin` (twice the tolerance:
    rounding can flip a near-tie, not a clear choice)."""
    for step, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        top = sorted(want.logprobs[step].values(), reverse=True)
        if a != b:
            assert top[0] - top[1] < margin, f"step {step}: diverged on a clear margin"
            return
        assert abs(got.logprobs[step][a] - want.logprobs[step][b]) < tolerance, step


def noesis_greedy(llm, prompt: list[int], max_new_tokens: int, **options):
    """noesis greedy tokens and their logprobs, EOS ignored; `options` go to SamplingParams."""
    from noesis import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=1, **options
    )
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == max_new_tokens
    return out.token_ids, [
        row[token] for row, token in zip(out.logprobs, out.token_ids, strict=True)
    ]


BERT_WORDS = ("the quick brown fox jumps over lazy dog hello world what is my name favourite "
              "colour blue green red remember earlier turn weather paris").split()


def build_sentence_bert(out: Path, pooling: str = "mean", normalize: bool = True,
                        max_seq_length: int = 32, seed: int = 0) -> Path:
    """A tiny random BertModel saved as a sentence-transformers checkpoint (modules.json, the
    pooling config, a WordPiece tokenizer.json with [CLS]/[SEP]); returns `out`."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {word: i for i, word in enumerate([*specials, *BERT_WORDS, "##s", "##ing"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    transformers.BertModel(config, add_pooling_layer=True).eval().save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m.startswith(pooling)  # pooling: "mean", "cls" or "max"
             for m in ("cls_token", "mean_tokens", "max_tokens")}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, **flags}))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return out
