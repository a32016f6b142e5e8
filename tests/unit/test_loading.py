"""Loading: errors that name the problem, tokenizer / EOS / chat template from the checkpoint, and
the incremental detokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import TEXT
from safetensors.torch import load_file, save_file

from noesis import (
    LLM,
    ChatTemplateError,
    CheckpointError,
    CheckpointMismatch,
    InvalidRequest,
    InvalidSamplingParams,
    ModelNotFound,
    PromptTooLong,
    SamplingParams,
    UnsupportedModel,
)
from noesis.tokenizer import IncrementalDetokenizer

SUPPORTED = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
]


def load(path, **options) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", progress=False, **options)


def edit_json(path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def edit_tensors(path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def llama_copy(checkpoints, tmp_path):
    return checkpoints.copy("llama", tmp_path / "llama")


# ---- errors that name the problem --------------------------------------------------------------


def test_unsupported_architecture_lists_supported(llama_copy):
    edit_json(llama_copy / "config.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModel) as info:
        load(llama_copy)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in SUPPORTED)


def test_mixed_sliding_window_layers_are_unsupported(checkpoints, tmp_path):
    path = checkpoints.copy("qwen2-sliding", tmp_path / "mixed")
    edit_json(
        path / "config.json",
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        load(path)


def test_missing_tensor_is_named(llama_copy):
    key = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(llama_copy / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointMismatch, match="missing") as info:
        load(llama_copy)
    assert key in str(info.value)


def test_missing_part_of_a_fused_projection_is_named(llama_copy):
    key = "model.layers.0.self_attn.k_proj.weight"
    edit_tensors(llama_copy / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointMismatch, match=key):
        load(llama_copy)


def test_unexpected_tensor_is_named(llama_copy):
    key = "model.layers.0.self_attn.extra_proj.weight"
    edit_tensors(llama_copy / "model.safetensors", lambda t: t.update({key: torch.zeros(4, 4)}))
    with pytest.raises(CheckpointMismatch, match="unexpected") as info:
        load(llama_copy)
    assert key in str(info.value)


def test_recomputed_buffers_are_not_unexpected(llama_copy):
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_tensors(llama_copy / "model.safetensors", lambda t: t.update({key: torch.ones(8)}))
    load(llama_copy)


@pytest.mark.parametrize(
    ("field", "value", "tensor"),
    [
        ("intermediate_size", 96, "model.layers.0.mlp.gate_proj.weight"),
        ("hidden_size", 48, "model.embed_tokens.weight"),
        ("vocab_size", 300, "model.embed_tokens.weight"),
    ],
)
def test_shape_mismatch_names_the_tensor(llama_copy, field, value, tensor):
    edit_json(llama_copy / "config.json", **{field: value})
    with pytest.raises(CheckpointMismatch, match="shape mismatch") as info:
        load(llama_copy)
    assert tensor in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "bad-header"])
def test_corrupt_or_truncated_file_names_the_file(llama_copy, damage):
    weights = llama_copy / "model.safetensors"
    data = weights.read_bytes()
    damaged = {
        "garbage": os.urandom(len(data)),
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "bad-header": data[:8] + b"{not json" + data[17:],
    }[damage]
    weights.write_bytes(damaged)
    with pytest.raises(CheckpointError) as info:
        load(llama_copy)
    assert str(weights) in str(info.value)
    assert not isinstance(info.value, CheckpointMismatch)


def test_truncated_shard_names_the_shard(tmp_path):
    from checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path / "sharded", "llama", shard_bytes="150KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / sorted(set(index["weight_map"].values()))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=shard.name):
        load(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        load(path)


def test_no_weights_at_all(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load(llama_copy)


def test_missing_tokenizer_json(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load(llama_copy)


def test_missing_directory_or_config(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        load(tmp_path)
    with pytest.raises(ModelNotFound, match="not a checkpoint directory"):
        load(tmp_path / "does" / "not" / "exist")


def test_prompt_longer_than_context(checkpoints):
    llm = checkpoints.llm("llama")
    context = llm.engine.max_model_len
    with pytest.raises(PromptTooLong) as info:
        llm.generate([[5] * context], SamplingParams(max_tokens=1))
    assert info.value.prompt_len == context and info.value.max_model_len == context
    assert str(context) in str(info.value)
    with pytest.raises(PromptTooLong):
        llm.generate("word " * context)
    # all or nothing: the valid prompt added before the bad one is not left running
    with pytest.raises(PromptTooLong):
        llm.generate([[5, 6, 7], [5] * (context + 3)])
    assert not llm.engine.has_unfinished()
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
    short = checkpoints.new_llm("llama", max_model_len=8)
    with pytest.raises(PromptTooLong):
        short.generate([list(range(10, 18))])
    out = short.generate([list(range(10, 15))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3  # capped by the context


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", 2.5), ("max_tokens", 0), ("logprobs", -1)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidSamplingParams, match=f"SamplingParams.{field}") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError) and info.value.field == field


def test_invalid_prompts_are_rejected(checkpoints):
    llm = checkpoints.llm("llama")
    vocab = llm.model_config.vocab_size
    with pytest.raises(InvalidRequest, match=str(vocab)):
        llm.generate([[1, 2, vocab]])
    with pytest.raises(InvalidRequest):
        llm.generate([[]])
    with pytest.raises(InvalidRequest):
        llm.generate(["hi"], {"temperature": 0})
    assert not llm.engine.has_unfinished()


# ---- tokenizer, EOS and chat template from the checkpoint --------------------------------------


def test_eos_ids_come_from_generation_config(checkpoints, tmp_path):
    base = checkpoints.llm("llama")
    assert base.tokenizer.eos_token_ids == (1,)  # written by save_pretrained from config.json
    prompt = [0, 5, 9, 77, 100, 21]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = base.generate([prompt], greedy)[0].token_ids
    index = next(i for i in range(3, 16) if full[i] not in full[:i])
    path = checkpoints.copy("llama", tmp_path / "eos")
    edit_json(path / "generation_config.json", eos_token_id=[full[index], 1])
    llm = load(path)
    assert set(llm.tokenizer.eos_token_ids) == {full[index], 1}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: index + 1]
    assert llm.generate([prompt], greedy)[0].token_ids == full  # ignore_eos runs on


def test_eos_falls_back_to_config_then_tokenizer(checkpoints, tmp_path):
    path = checkpoints.copy("llama", tmp_path / "no-genconfig")
    (path / "generation_config.json").unlink()
    assert load(path).tokenizer.eos_token_ids == (1,)  # config.json eos_token_id
    edit_json(path / "config.json", eos_token_id=None)
    assert load(path).tokenizer.eos_token_ids == (1,)  # tokenizer_config eos_token "</s>"


def test_no_chat_template_chat_raises_generate_works(checkpoints, tmp_path):
    path = checkpoints.copy("llama", tmp_path / "no-template")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = load(path)
    with pytest.raises(ChatTemplateError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


CHATML = (
    "{%- if tools %}<|system|>Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n"
    "{%- endif %}\n"
    "{%- for m in messages %}\n"
    "    {%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m.role) }}{% endif %}\n"
    "<|{{ m.role }}|>\n{{ m.content | trim }}</s>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hello café 日本語 🙂 "},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Numbers 0123?"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]


@pytest.mark.parametrize("template", ["checkpoint", "chatml-tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(checkpoints, tmp_path, template, add_generation_prompt):
    from transformers import AutoTokenizer

    path = checkpoints.copy("llama", tmp_path / "chat")
    tools = None
    if template == "chatml-tools":
        (path / "chat_template.jinja").write_text(CHATML)
        tools = TOOLS
    llm = load(path)
    ids = llm.render_chat(CONVERSATION, tools, add_generation_prompt)
    hf = AutoTokenizer.from_pretrained(path)
    text = hf.apply_chat_template(
        CONVERSATION, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ids == hf.encode(text, add_special_tokens=False)
    assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
    if template == "checkpoint":
        assert ids[0] == 0  # the template writes BOS itself, and only once
        assert ids.count(0) == 1
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.chat(CONVERSATION, params, tools, add_generation_prompt)
    assert out.prompt_token_ids == ids
    if tools:  # raise_exception() in a template surfaces as ChatTemplateError
        with pytest.raises(ChatTemplateError, match="bad role robot"):
            llm.render_chat([{"role": "robot", "content": "x"}], tools)


# ---- incremental detokenizer ------------------------------------------------------------------


def feed(tokenizer, prompt_ids, output_ids) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    ids, deltas = list(prompt_ids), []
    for token in output_ids:
        ids.append(token)
        deltas.append(detok.step(ids))
    deltas.append(detok.flush(ids))
    return deltas


@pytest.mark.parametrize("prompt", ["", "The quick", "日本"])
def test_detokenizer_never_splits_a_character(checkpoints, prompt):
    tokenizer = checkpoints.llm("llama").tokenizer
    text = "Ünïcödé: café, naïve, 日本語, emoji 🙂🙂. " + TEXT
    # one byte-level token per byte: every multi-byte character arrives in pieces
    byte_ids = [tokenizer.token_to_id(_byte_token(b)) for b in text.encode()]
    assert None not in byte_ids
    prompt_ids = tokenizer.encode(prompt) if prompt else [0]
    deltas = feed(tokenizer, prompt_ids, byte_ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 20  # it did wait inside characters
    merged = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(feed(tokenizer, prompt_ids, merged)) == text


def test_detokenizer_flushes_an_unfinished_character(checkpoints):
    tokenizer = checkpoints.llm("llama").tokenizer
    cut = [tokenizer.token_to_id(_byte_token(b)) for b in "ok 🙂".encode()[:-1]]
    deltas = feed(tokenizer, [0], cut)
    assert "".join(deltas) == tokenizer.decode(cut) == "ok \ufffd"


def test_detokenizer_keeps_word_boundaries_of_metaspace_tokenizers():
    """SentencePiece-style decoders drop the space of a leading "▁word"; a window that starts
    with a few already-read tokens keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from noesis.tokenizer import Tokenizer

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(
        [TEXT] * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False)
    )
    tokenizer = Tokenizer(backend, {}, None, ())
    prompt = tokenizer.encode("The quick brown")
    words = tokenizer.encode("fox jumps over the lazy dog, café 日本語 🙂")
    assert "".join(feed(tokenizer, prompt, words)) == " " + tokenizer.decode(words)


def test_stream_concatenation_equals_text_and_decode(checkpoints):
    """Random models emit arbitrary byte tokens; what streams must add up to the final text."""
    llm = checkpoints.llm("llama")
    saw_multibyte = False
    for seed in range(6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        streamed = "".join(llm.stream("emoji 🙂 日本語", params))
        out = llm.generate(["emoji 🙂 日本語"], params)[0]
        assert streamed == out.text == llm.tokenizer.decode(out.token_ids)
        saw_multibyte |= any(ord(c) > 127 for c in out.text)
    assert saw_multibyte
    assert not llm.engine.has_unfinished()


def _byte_token(byte: int) -> str:
    """The byte-level BPE symbol of one byte (GPT-2's printable mapping)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if byte in printable:
        return chr(byte)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(byte))
