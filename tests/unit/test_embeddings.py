"""Embeddings: the decoder's pooled final hidden states (LLM.embed, Engine.embed) and the BERT
sentence embedder, each against transformers on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from checkpoints import build_checkpoint, build_sentence_bert

from noesis import LLM, SamplingParams
from noesis.errors import CheckpointMismatch, InvalidRequest, PromptTooLong, UnsupportedModel
from noesis.sidecars.embedder import SentenceEmbedder

PROMPTS = [[0, 5, 9, 17, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 7], [3]]
CONTEXT = 32


def reference(model_dir, prompts, pooling):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
            rows.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return F.normalize(torch.stack(rows), dim=-1)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def decoder(request, tmp_path_factory):
    """(checkpoint, LLM): Llama, and Gemma 2 with an 8-token sliding window and soft-capping."""
    extra = {"head_dim": 16, "pad_token_id": 0, "sliding_window": 8,
             "attn_logit_softcapping": 10.0} if request.param == "gemma2" else {}
    path = build_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param,
                            max_position_embeddings=CONTEXT, **extra)
    # A 14-token step budget: the 13- and 2-token prompts go in separate forwards.
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False,
              max_num_batched_tokens=14)
    return path, llm


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_matches_transformers(decoder, pooling):
    path, llm = decoder
    got = torch.tensor(llm.embed(PROMPTS, pooling))
    torch.testing.assert_close(got, reference(path, PROMPTS, pooling), atol=2e-5, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(PROMPTS)))


def test_decoder_embed_text_and_limits(decoder):
    path, llm = decoder
    text = "Hello world"
    (one,) = llm.embed(text)
    ids = llm.tokenizer.encode(text)
    assert one == llm.embed([ids])[0]
    full = [5] * CONTEXT  # a prompt to embed may fill the whole context
    assert len(llm.embed([full])[0]) == llm.model_config.hidden_size
    with pytest.raises(PromptTooLong):
        llm.embed([full + [5]])
    with pytest.raises(InvalidRequest, match="out of range"):
        llm.embed([[0, 10**6]])
    with pytest.raises(ValueError, match="unknown pooling"):
        llm.engine.embed([[1, 2]], "cls")


def test_embedding_between_steps_leaves_generation_alone(decoder):
    """Embeddings run between steps take no KV page and change no running sequence's cache:
    a greedy generation interleaved with them samples the tokens it samples alone."""
    _, llm = decoder
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[0, 9, 8, 7]], params)[0].token_ids
    engine = llm.engine
    request_id = engine.add_request([0, 9, 8, 7], params, stream=False)
    pages_free = engine.allocator.num_free
    finished = []
    while engine.has_unfinished():
        llm.embed(PROMPTS)
        assert engine.allocator.num_free >= pages_free - 1  # only the request's own pages move
        finished += [o for o in engine.step() if o.request_id == request_id and o.finished]
    assert finished[0].token_ids == alone


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_sentence_bert(tmp_path_factory.mktemp("bert") / "mini-bert", max_seq_length=12)


def bert_reference(path, texts, pooling, normalize):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    encoded = [tokenizer.encode(t).ids for t in texts]
    length = max(map(len, encoded))
    ids = torch.tensor([e + [0] * (length - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (length - len(e)) for e in encoded])
    model = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if pooling == "mean":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    elif pooling == "cls":
        pooled = hidden[:, 0]
    else:
        pooled = hidden.masked_fill(mask[..., None] == 0, float("-inf")).amax(1)
    return F.normalize(pooled, dim=-1) if normalize else pooled


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False), ("max", True)])
def test_bert_matches_transformers(bert_dir, tmp_path, pooling, normalize):
    path = bert_dir
    if (pooling, normalize) != ("mean", True):  # the same weights, another pooling config
        path = build_sentence_bert(tmp_path / "other", pooling, normalize, max_seq_length=12)
    embedder = SentenceEmbedder(path)
    texts = ["the quick brown fox", "hello world jumps over the lazy dogs", "blue"]
    got = embedder.embed(texts)
    torch.testing.assert_close(got, bert_reference(path, texts, pooling, normalize),
                               atol=1e-5, rtol=0)
    assert embedder.pooling.mode == pooling and embedder.pooling.normalize == normalize


def test_tokenizer_json_batch_settings_are_ignored(bert_dir, tmp_path):
    """all-MiniLM-L6-v2's tokenizer.json pads every text to 128 ids and truncates there: the
    embedder (and every noesis tokenizer) takes each text's own ids, whole, so the pads never
    reach mean pooling and a long text is refused or cut by the embedder's own limit."""
    import shutil

    from tokenizers import Tokenizer

    batched = tmp_path / "batched"
    shutil.copytree(bert_dir, batched)
    tokenizer = Tokenizer.from_file(str(batched / "tokenizer.json"))
    tokenizer.enable_padding(length=10, pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=10)
    tokenizer.save(str(batched / "tokenizer.json"))
    assert len(tokenizer.encode("blue").ids) == 10  # what the file alone would give
    texts = ["the quick brown fox", "blue"]
    plain, padded = SentenceEmbedder(bert_dir), SentenceEmbedder(batched)
    assert padded.tokenize("blue") == plain.tokenize("blue") and len(plain.tokenize("blue")) == 3
    torch.testing.assert_close(padded.embed(texts), bert_reference(bert_dir, texts, "mean", True),
                               atol=1e-5, rtol=0)
    long = " ".join(["fox"] * 11)  # 13 ids: past the file's 10 and the embedder's 12
    with pytest.raises(PromptTooLong):
        padded.tokenize(long)
    assert len(padded.tokenize(long, truncate=True)) == 12


def test_bert_limits_and_strict_loading(bert_dir, tmp_path):
    embedder = SentenceEmbedder(bert_dir)
    long_text = " ".join(["fox"] * 20)  # 22 tokens with [CLS] and [SEP]; max_seq_length 12
    with pytest.raises(PromptTooLong):
        embedder.embed([long_text])
    truncated = embedder.tokenize(long_text, truncate=True)
    assert len(truncated) == 12 and truncated[0] == 2 and truncated[-1] == 3
    with pytest.raises(InvalidRequest, match="out of range"):
        embedder.embed([[2, 999, 3]])
    with pytest.raises(InvalidRequest, match="empty"):
        embedder.embed([[]])
    from safetensors.torch import load_file, save_file

    broken = build_sentence_bert(tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointMismatch, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        SentenceEmbedder(broken)
    dense = [{"type": "sentence_transformers.models.Dense"}]
    (broken / "modules.json").write_text(json.dumps(dense))
    with pytest.raises(UnsupportedModel, match="Dense"):
        SentenceEmbedder(broken)
