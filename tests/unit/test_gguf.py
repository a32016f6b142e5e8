"""GGUF files: written on the fly with the `gguf` package from tiny random transformers models.

The files are written as llama.cpp's converter writes them: its tensor names (the `gguf` package's
own name map), query/key rows permuted for the llama architecture, norms in F32, and the vocabulary
as metadata (byte-level BPE with merges, or SentencePiece with scores and token types). Types the
package cannot quantize (the K-quants) get random blocks with scales in range. The reference
weights are the package's own dequantization, in Hugging Face's layout.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from checkpoints import hf_generate, noesis_greedy
from gguf import GGMLQuantizationType as GGMLType
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from noesis import LLM
from noesis.engine.loading import describe_checkpoint, load_model
from noesis.errors import UnsupportedModel
from noesis.weights.gguf import open_gguf
from noesis.weights.gguf_quants import dequantize
from noesis.weights.gguf_tokenizer import build_tokenizer

VOCAB = 384
TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world! Numbers 0123456789 and "
    "punctuation ,.;:?! (brackets) [more] {braces}. Ünïcödé: café, naïve, 日本語, emoji 🙂. "
    "Tiny models speak nonsense but deterministic nonsense.  Two  spaces\tand\ttabs\nnew lines."
)
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# K-quant blocks written with random codes: (byte offset of the f16 scale, of the f16 minimum or
# None, minimum / scale) so that values come out centred, about +-0.5
K_SCALES = {"Q4_K": (0, 2, 7.5, 1e-3), "Q5_K": (0, 2, 15.5, 5e-4), "Q6_K": (208, None, 0, 1e-4)}


# ---- vocabularies -----------------------------------------------------------------------------


def bpe_vocab() -> dict:
    """A byte-level BPE vocabulary (gpt2 kind) with its merges and control tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 4, special_tokens=BPE_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if token in BPE_SPECIALS else 1 for token in tokens]
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges, "bos": 0, "eos": 2}


def spm_vocab() -> dict:
    """A SentencePiece-style vocabulary (llama kind): <unk> <s> </s>, 256 byte tokens, pieces
    with scores (no merges, as llama.cpp writes them), two control and one user-defined token."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=110, show_progress=False))
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    learned = sorted(vocab, key=vocab.get)
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens = head + learned + ["<|im_start|>", "<|im_end|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned) + [3, 3, 4]
    scores = [0.0] * len(head) + [-float(i) for i in range(len(learned))] + [0.0] * 3
    assert len(tokens) <= VOCAB
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1,
            "eos": 2, "unk": 0}


# ---- writing GGUF files -----------------------------------------------------------------------


def hf_model(family: str, hidden: int = 64, seed: int = 0, **overrides):
    import transformers

    config_name, model_name = HF_CLASSES[family]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.3,
        rms_norm_eps=1e-5,
    )
    if family == "phi3":
        kwargs["pad_token_id"] = 0
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
    return model.eval()


def permute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: rotary halves -> interleaved pairs, per head (rows of any dtype)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def encode(weight: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """A tensor in `qtype`: quantized by the package, or random K-quant blocks."""
    kind = GGMLType[qtype]
    try:
        return gguf.quants.quantize(weight, kind)
    except NotImplementedError:  # random blocks (all zero for a type without K_SCALES)
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        shape = (weight.shape[0], weight.shape[1] // block_values * block_bytes)
        if qtype not in K_SCALES:
            return np.zeros(shape, np.uint8)
        rows = rng.integers(0, 256, shape, dtype=np.uint8)
        blocks = rows.reshape(-1, block_bytes)
        d_at, m_at, ratio, scale = K_SCALES[qtype]
        d = (rng.random(len(blocks)) * scale).astype(np.float16)
        blocks[:, d_at : d_at + 2] = d.view(np.uint8).reshape(-1, 2)
        if m_at is not None:
            minimum = (d * ratio).astype(np.float16)
            blocks[:, m_at : m_at + 2] = minimum.view(np.uint8).reshape(-1, 2)
        return rows


def write_gguf(
    path, model, family: str, qtype: str, vocab: dict, types: dict | None = None, **metadata
) -> dict:
    """Write `model` as llama.cpp would, its matrices in `qtype` (`types`: other types for some
    tensors by GGUF name); returns the reference weights (HF names, float32)."""
    config = model.config
    arch = ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("Mistral tiny" if family == "mistral" else f"tiny {family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    _write_vocab(writer, vocab, **metadata)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    rng = np.random.default_rng(1)
    reference = {}
    for key, weight in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # no output.weight: the head is the embedding
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        data = weight.float().numpy()
        kind = qtype if data.ndim == 2 and data.shape[1] % gguf.GGML_QUANT_SIZES[
            GGMLType[qtype]][0] == 0 else "F32"
        kind = (types or {}).get(name, kind)
        stored = encode(data, kind, rng)
        reference[key] = torch.from_numpy(gguf.quants.dequantize(stored, GGMLType[kind]).copy())
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            stored = permute_qk(stored, heads)
        writer.add_tensor(name, stored, raw_dtype=GGMLType[kind])
    if config.tie_word_embeddings:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter: each frequency's wavelength multiplier under Llama 3 scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * np.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_vocab(writer, vocab: dict, **metadata) -> None:
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(metadata.get("pre", "default"))
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        writer.add_unk_token_id(vocab["unk"])
    if "add_bos" in metadata:
        writer.add_add_bos_token(metadata["add_bos"])
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def vocabs():
    return {"gpt2": bpe_vocab(), "llama": spm_vocab()}


# ---- dequantization ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def typed_files(tmp_path_factory, vocabs):
    """One tiny llama file per tensor type (hidden 256: rows fit the 256-value K blocks)."""
    root = tmp_path_factory.mktemp("gguf-types")
    model = hf_model("llama", hidden=256, intermediate_size=256)
    files = {}
    for qtype in QUANT_TYPES:
        path = root / f"llama-{qtype}.gguf"
        files[qtype] = (path, write_gguf(path, model, "llama", qtype, vocabs["gpt2"]))
    return files


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantization_equals_the_gguf_package(typed_files, qtype):
    path, _ = typed_files[qtype]
    file = open_gguf(path)
    assert qtype in {file.type_name(name) for name in file.tensors}
    for name, tensor in file.tensors.items():
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(file.read(name), torch.from_numpy(np.asarray(expected))), name


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K", "Q6_K"])
def test_loaded_weights_are_the_reference(typed_files, qtype):
    """Names mapped, q/k un-permuted, q/k/v and gate/up stacked into noesis's fused parameters
    (float ones, or packed ones whose dequantized weight is compared)."""
    path, reference = typed_files[qtype]
    loaded = load_model(path, device="cpu", dtype="float32", progress=False, gguf_weights="packed")
    params = dict(loaded.model.named_parameters())
    modules = dict(loaded.model.named_modules())

    def weight(name: str) -> torch.Tensor:
        module = modules[name]
        return module.weight if qtype == "F32" else module.dequantize()

    for layer in range(2):
        prefix = f"model.layers.{layer}."
        attn = [reference[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"]
        mlp = [reference[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(weight(f"{prefix}self_attn.qkv_proj"), torch.cat(attn))
        assert torch.equal(weight(f"{prefix}mlp.gate_up_proj"), torch.cat(mlp))
        down = reference[f"{prefix}mlp.down_proj.weight"]
        assert torch.equal(weight(f"{prefix}mlp.down_proj"), down)
    assert torch.equal(params["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"], reference["lm_head.weight"])


def test_dequantization_is_chunked_without_changing_values(monkeypatch):
    """Tensors larger than one chunk come out as one pass would give them."""
    from noesis.weights import gguf_quants

    rng = np.random.default_rng(3)
    raw = encode(rng.standard_normal((8, 512)).astype(np.float32), "Q4_K", rng)
    whole = dequantize(torch.from_numpy(raw), "Q4_K", 8 * 512)
    monkeypatch.setattr(gguf_quants, "CHUNK_VALUES", 512)  # 2 blocks per chunk
    assert torch.equal(dequantize(torch.from_numpy(raw), "Q4_K", 8 * 512), whole)
    expected = gguf.quants.dequantize(raw, GGMLType.Q4_K).reshape(-1)
    assert torch.equal(whole, torch.from_numpy(expected))


# ---- greedy parity with transformers ----------------------------------------------------------

LLAMA3_ROPE = {  # short enough to matter in 18 positions; head_dim 64 puts 4 frequencies in-between
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16, "rope_theta": 10000.0,
}
PARITY = {  # case -> (family, tensor type, hidden size, vocabulary kind, model overrides, metadata)
    "llama": ("llama", "Q4_K", 256, "gpt2", {}, {"pre": "llama-bpe", "add_bos": True}),
    "llama3-rope": ("llama", "Q5_0", 256, "gpt2", {"rope_parameters": LLAMA3_ROPE}, {}),
    "mistral": ("mistral", "Q8_0", 64, "llama", {}, {}),
    "qwen2-tied": ("qwen2", "Q4_0", 64, "gpt2", {"tie_word_embeddings": True}, {"pre": "qwen2"}),
    "qwen3": ("qwen3", "Q5_K", 256, "gpt2", {}, {"pre": "qwen2"}),
    "phi3": ("phi3", "Q6_K", 256, "llama", {}, {}),
}
PROMPT = [0, 5, 9, 77, 100, 21]
NEW_TOKENS = 12


@pytest.mark.parametrize("case", list(PARITY))
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, vocabs, case):
    family, qtype, hidden, kind, overrides, metadata = PARITY[case]
    model = hf_model(family, hidden=hidden, **overrides)
    path = tmp_path / f"{case}-{qtype}.gguf"
    reference = write_gguf(path, model, family, qtype, vocabs[kind], **metadata)
    model.load_state_dict(reference)
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False, max_model_len=64,
              gguf_weights="packed")
    assert llm.model_config.architecture == type(model).__name__
    tokens, logprobs = noesis_greedy(llm, PROMPT, NEW_TOKENS)
    ref_tokens, ref_rows = hf_generate(model, PROMPT, NEW_TOKENS)
    assert tokens == ref_tokens
    ref_logprobs = [row[token].item() for row, token in zip(ref_rows, tokens, strict=True)]
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


# ---- tokenizers -------------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    "Hello world", " leading space", "  two spaces", "digits 1234567 and 3.14159", "",
    "日本語 🙂 naïve Ünïcödé", "<s>inside</s> text", "tabs\tand\nnewlines\n\n", " ",
    "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<think>x</think>", "don't 'll",
]
TOKENIZER_CASES = {  # name -> (architecture, vocabulary kind, extra metadata)
    "qwen2-bpe": ("qwen2", "gpt2", {"pre": "qwen2"}),
    "llama3-bpe": ("llama", "gpt2", {"pre": "llama-bpe", "add_bos": True}),
    "unknown-pre-bpe": ("qwen3", "gpt2", {"pre": "not-a-pre-tokenizer"}),
    "llama-spm": ("llama", "llama", {}),
    "phi3-spm": ("phi3", "llama", {}),
}


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_tokenizer_ids_equal_transformers(tmp_path, vocabs, case):
    from transformers import AutoTokenizer

    arch, kind, metadata = TOKENIZER_CASES[case]
    family = "llama" if arch == "llama" else arch
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, hf_model(family), family, "F32", vocabs[kind], **metadata)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    backend, _ = build_tokenizer(open_gguf(path).metadata)
    for text in TOKENIZER_TEXTS:
        ids = reference(text)["input_ids"]
        assert backend.encode(text).ids == ids, text
        assert backend.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


# llama.cpp's split for these pre-tokenizer names: every digit alone, then GPT-2's regex on the
# rest (SmolLM's own tokenizer.json: Digits(individual_digits) before ByteLevel)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@pytest.mark.parametrize("pre", ["smollm", "starcoder", "command-r"])
def test_digit_splitting_pre_tokenizers_split_as_llama_cpp(vocabs, pre):
    import regex

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": vocabs["gpt2"]["tokens"],
                "tokenizer.ggml.token_type": vocabs["gpt2"]["types"],
                "tokenizer.ggml.merges": vocabs["gpt2"]["merges"]}
    backend, _ = build_tokenizer(metadata)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in [t for t in TOKENIZER_TEXTS if "<" not in t]:
        pieces = [p for p in regex.split(r"(\p{N})", text) if p]
        expected = [word for piece in pieces for word in regex.findall(GPT2_REGEX, piece)]
        spelled = [byte_level.pre_tokenize_str(word)[0][0] for word in expected]
        got = [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        assert got == spelled, text
    assert backend.decode(backend.encode("in 2024, 365 days").ids) == "in 2024, 365 days"


def test_chat_template_and_special_tokens_reach_the_engine(tmp_path, vocabs):
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, hf_model("qwen2"), "qwen2", "F16", vocabs["gpt2"], pre="qwen2")
    tokenizer = load_model(path, device="cpu", progress=False).tokenizer
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token_ids == (2,)
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi <|im_end|>"}])
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert ids.count(end) == 1  # the message's own spelling stays text


# ---- errors and noesis info -------------------------------------------------------------------


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path, vocabs):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    _write_vocab(writer, vocabs["gpt2"])
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match=r"'gemma2'.*llama, phi3, qwen2, qwen3"):
        load_model(path, device="cpu", progress=False)


def test_unsupported_tensor_type_names_it_and_the_supported_ones(tmp_path, vocabs):
    path = tmp_path / "q2k.gguf"
    model = hf_model("llama", hidden=256)
    types = {"blk.0.ffn_down.weight": "Q2_K"}
    write_gguf(path, model, "llama", "Q8_0", vocabs["gpt2"], types=types)
    with pytest.raises(UnsupportedModel, match=r"Q2_K.*supported tensor types: F32.*Q6_K.*llama"):
        load_model(path, device="cpu", progress=False)


def test_info_shows_architecture_types_and_sizes(typed_files):
    path, _ = typed_files["Q4_K"]
    info = describe_checkpoint(path)
    assert info["architecture"] == "LlamaForCausalLM (family llama)"
    assert info["gguf architecture"] == "llama (tiny llama)"
    assert info["checkpoint dtype"].startswith("GGUF Q4_K (")
    assert "F32 (" in info["checkpoint dtype"] and "MiB" in info["checkpoint dtype"]
    assert info["layers"] == "2" and info["vocab"] == str(VOCAB)


def test_a_trace_hashes_a_gguf_file_as_model_and_tokenizer(typed_files, tmp_path):
    from noesis.telemetry.trace import model_hashes

    path, _ = typed_files["Q8_0"]
    model, tokenizer = model_hashes(path)
    assert model == tokenizer
    copy = tmp_path / "copy.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    copy.write_bytes(bytes(data))
    assert model_hashes(copy)[0] != model
