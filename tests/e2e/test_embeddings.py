"""/v1/embeddings through the official openai client: the served decoder (last-token or mean
pooling) and a BERT sentence embedder (--embedding-model), equal to transformers on the same
weights; batches, token ids, base64, dimensions, usage, and errors for bad input. The shared
server (conftest.py) serves both: a server start of its own cost seconds of both cores."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import BERT_NAME, MODEL_NAME
from tokenizers import Tokenizer

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def embed_server(server):
    return server


@pytest.fixture(scope="module")
def client(embed_server) -> openai.OpenAI:
    return embed_server.client()


def decoder_reference(model_dir, prompts, pooling="last"):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            rows.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return F.normalize(torch.stack(rows), dim=-1).numpy()


def ids_of(model_dir, text):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def vectors(response):
    return np.array([item.embedding for item in response.data])


def test_decoder_texts_floats_and_base64(client, tiny_model):
    ids = [ids_of(tiny_model, t) for t in TEXTS]
    expected = decoder_reference(tiny_model, ids)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(vectors(floats), expected, atol=2e-5)
    assert [item.index for item in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    single = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1])  # base64 on the wire
    np.testing.assert_allclose(vectors(single)[0], expected[1], atol=2e-5)


def test_decoder_token_ids_mean_pooling_and_dimensions(client, tiny_model):
    prompts = [[0, 5, 9, 17], [0, 7, 7]]
    one = client.embeddings.create(model=MODEL_NAME, input=prompts[0], encoding_format="float")
    np.testing.assert_allclose(vectors(one)[0], decoder_reference(tiny_model, prompts[:1])[0],
                               atol=2e-5)
    mean = client.embeddings.create(model=MODEL_NAME, input=prompts, encoding_format="float",
                                    extra_body={"pooling": "mean"})
    np.testing.assert_allclose(vectors(mean), decoder_reference(tiny_model, prompts, "mean"),
                               atol=2e-5)
    short = client.embeddings.create(model=MODEL_NAME, input=prompts, dimensions=16)
    cut = decoder_reference(tiny_model, prompts)[:, :16]
    np.testing.assert_allclose(vectors(short), cut / np.linalg.norm(cut, axis=1, keepdims=True),
                               atol=2e-5)


def test_bert_encoder(client, bert_dir):
    texts = ["the quick brown fox", "hello world jumps over the lazy dogs"]
    got = client.embeddings.create(model=BERT_NAME, input=texts)
    tokenizer = Tokenizer.from_file(str(bert_dir / "tokenizer.json"))
    model = transformers.BertModel.from_pretrained(bert_dir).eval()
    for row, text in zip(vectors(got), texts, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(text).ids])).last_hidden_state[0]
        np.testing.assert_allclose(row, F.normalize(hidden.mean(0), dim=-1).numpy(), atol=1e-5)
    assert got.model == BERT_NAME
    listed = {model.id for model in client.models.list()}
    assert listed == {MODEL_NAME, BERT_NAME}


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": ""}, "input", 400),
        ({"input": []}, "input", 400),
        ({"input": ["ok", ""]}, "input[1]", 400),
        ({"input": [[]]}, "input[0]", 400),
        ({"input": 5}, "input", 400),
        ({"input": [1.5]}, "input", 400),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", 400),
        ({"input": "x", "dimensions": 0}, "dimensions", 400),
        ({"input": "x", "dimensions": 65}, "dimensions", 400),
        ({"input": [[0, 10**6]]}, None, 400),
        ({"input": [0] * 1025}, "input[0]", 400),
        ({"input": "x", "model": "nope"}, "model", 404),
        ({"input": "fox", "model": BERT_NAME, "dimensions": 8}, "dimensions", 400),
        ({"input": "fox", "model": BERT_NAME, "pooling": "mean"}, "pooling", 400),
        ({"input": " ".join(["fox"] * 20), "model": BERT_NAME}, "input[0]", 400),
    ],
)
def test_bad_input_is_an_openai_error(embed_server, body, param, status):
    response = httpx.post(embed_server.url + "/v1/embeddings",
                          json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
