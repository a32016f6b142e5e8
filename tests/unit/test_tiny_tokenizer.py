"""noesis.tiny.tokenizer: Harmony special tokens are single ids, text round-trips, and transformers
loads the saved files with the chat template."""

import pytest

from noesis.tiny import corpus, harmony, tokenizer


@pytest.fixture(scope="module")
def trained():
    return tokenizer.train(corpus.texts(0, "train", 400), vocab_size=1000)


def test_special_tokens_are_single_fixed_ids(trained):
    for index, token in enumerate(harmony.SPECIAL_TOKENS):
        assert trained.encode(token).ids == [index]
    text = "<|start|>assistant<|channel|>final<|message|>Hi<|return|>"
    ids = trained.encode(text).ids
    assert ids[0] == 2 and ids[-1] == 7 and 5 in ids and 4 in ids


def test_round_trip_of_held_out_text(trained):
    for example in corpus.generate(0, "heldout", 20):
        text = example.text()
        assert trained.decode(trained.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_split(trained):
    pieces = trained.encode("12345").tokens
    assert pieces == ["1", "2", "3", "4", "5"]


def test_transformers_loads_it_with_the_chat_template(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer.save(trained, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == (
        "<|return|>",
        "<|endoftext|>",
        "<|startoftext|>",
    )
    example = next(e for e in corpus.generate(1, "heldout", 20) if e.expected_tool)
    assert (
        hf.apply_chat_template(example.messages, tools=example.tools, tokenize=False)
        == example.text()
    )
    prompt = hf.apply_chat_template(
        example.prompt_messages, tools=example.tools, tokenize=False, add_generation_prompt=True
    )
    assert prompt == harmony.render(example.prompt_messages, example.tools, True)
    assert (
        hf(example.text(), add_special_tokens=False)["input_ids"]
        == trained.encode(example.text()).ids
    )
