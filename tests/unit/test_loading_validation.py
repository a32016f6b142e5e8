"""Loading refuses what is not a sane checkpoint, quickly and by name: special files (a named pipe
would block the open forever), oversized metadata, config.json values of the wrong type, out of
range or inconsistent, sizes that cannot fit in memory, and safetensors headers that do not add
up. Each case damages one thing in a copy of a valid tiny checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from noesis import LLM, CheckpointError, ConfigError, SamplingParams
from noesis.errors import InvalidModelConfig
from noesis.models.config import ModelConfig
from noesis.weights.files import CONFIG_MAX_BYTES, TOKENIZER_MAX_BYTES

LOAD_TIMEOUT_S = 30  # a load that hangs (a named pipe opened for reading) fails, not blocks
WEIGHTS = "model.safetensors"
TENSOR = "model.norm.weight"


def load_within(path: Path, timeout: float = LOAD_TIMEOUT_S, **options) -> None:
    """Load `path` in a forked child and raise here what loading raised there. A child still
    loading after `timeout` is killed and the test fails: opening a named pipe blocks forever,
    in Rust code (tokenizers, safetensors) that holds the GIL, so a thread cannot be timed out."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_load_and_report, args=(path, options, send), daemon=True)
    child.start()
    send.close()
    if not receive.poll(timeout):
        child.kill()
        child.join()
        pytest.fail(f"loading {path} did not return within {timeout} s")
    outcome = receive.recv()
    child.join()
    if outcome is not None:
        cls, args, attributes = outcome
        error = cls.__new__(cls)  # errors whose __init__ differs from their args (field=...)
        BaseException.__init__(error, *args)
        error.__dict__.update(attributes)
        raise error


def _load_and_report(path: Path, options: dict, send) -> None:
    try:
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False, **options)
        llm.generate("Hello", SamplingParams(max_tokens=2))
    except Exception as exc:
        send.send((type(exc), exc.args, dict(vars(exc))))
    else:
        send.send(None)


@pytest.fixture
def llama_copy(checkpoints, tmp_path) -> Path:
    return checkpoints.copy("llama", tmp_path / "llama")


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# ---- files that are not regular files ------------------------------------------------------------


def make_fifo(path: Path) -> None:
    if path.exists():
        path.unlink()
    os.mkfifo(path)


def make_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside.json").write_text("{}")


def link_to_device(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/null")  # a character device; /dev/zero would read without end


@pytest.mark.parametrize(
    ("name", "damage", "kind"),
    [
        ("config.json", make_fifo, "named pipe"),
        ("config.json", make_directory, "directory"),
        ("config.json", link_to_device, "character device"),
        ("tokenizer.json", make_fifo, "named pipe"),
        ("tokenizer.json", link_to_device, "character device"),
        ("tokenizer_config.json", make_fifo, "named pipe"),
        ("generation_config.json", make_fifo, "named pipe"),
        ("chat_template.jinja", make_fifo, "named pipe"),
        (WEIGHTS, make_fifo, "named pipe"),
        (WEIGHTS, make_directory, "directory"),
        ("model.safetensors.index.json", make_fifo, "named pipe"),
    ],
)
def test_special_files_are_refused_quickly(llama_copy, name, damage, kind):
    damage(llama_copy / name)
    with pytest.raises(CheckpointError) as info:
        load_within(llama_copy)
    message = str(info.value)
    assert name in message and kind in message, message


def test_an_extra_safetensors_directory_is_refused(llama_copy):
    (llama_copy / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors is a directory"):
        load_within(llama_copy)


def test_symlinks_to_regular_files_load(llama_copy, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("config.json", "tokenizer.json", WEIGHTS):
        shutil.move(llama_copy / name, elsewhere / name)
        (llama_copy / name).symlink_to(elsewhere / name)
    llm = LLM(str(llama_copy), device="cpu", dtype="float32", progress=False)
    assert len(llm.generate("Hello", SamplingParams(max_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize(
    ("name", "limit"),
    [("config.json", CONFIG_MAX_BYTES), ("tokenizer.json", TOKENIZER_MAX_BYTES)],
)
def test_oversized_metadata_is_refused_unread(llama_copy, name, limit):
    path = llama_copy / name
    with open(path, "r+b") as handle:  # sparse: no disk, and it would be invalid JSON if read
        handle.truncate(100_000_000)
    assert path.stat().st_size > limit
    with pytest.raises(CheckpointError, match="limit") as info:
        load_within(llama_copy)
    assert name in str(info.value)


# ---- config.json values -------------------------------------------------------------------------


def test_config_that_is_not_an_object(llama_copy):
    (llama_copy / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, not a list"):
        load_within(llama_copy)
    with pytest.raises(InvalidModelConfig, match="top level"):
        ModelConfig.from_hf([1, 2, 3])


@pytest.mark.parametrize(
    ("changes", "field", "shown"),
    [
        ({"hidden_size": "64"}, "hidden_size", "'64' (a string)"),
        ({"hidden_size": 64.5}, "hidden_size", "64.5 (a number)"),
        ({"hidden_size": True}, "hidden_size", "True (a boolean)"),
        ({"hidden_size": [64]}, "hidden_size", "a list"),
        ({"hidden_size": 0}, "hidden_size", "below the minimum 1"),
        ({"intermediate_size": -128}, "intermediate_size", "-128 is below the minimum 1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers", "below the minimum"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers", "1,000,000,000 is above the limit"),
        ({"vocab_size": 10**12}, "vocab_size", "1,000,000,000,000 is above the limit 4,194,304"),
        ({"num_attention_heads": 10**6}, "num_attention_heads", "above the limit"),
        ({"head_dim": 1 << 20}, "head_dim", "above the limit 4,096"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings", "GiB"),
        ({"max_position_embeddings": 4096.0}, "max_position_embeddings", "a number"),
        ({"num_attention_heads": 3, "head_dim": None}, "num_attention_heads",
         "3 does not divide hidden_size=64"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "not a multiple"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "above 0"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", "expected true or false"),
        ({"eos_token_id": ["1"]}, "eos_token_id", "expected an integer"),
        ({"architectures": "LlamaForCausalLM"}, "architectures", "a list of names"),
        ({"text_config": [1]}, "text_config", "expected a JSON object"),
        ({"quantization_config": "ternary"}, "quantization_config", "expected a JSON object"),
        ({"rope_parameters": [10000.0]}, "rope_parameters", "expected a JSON object"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_theta",
         "a string"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "factor", "above 0"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2}},
         "partial_rotary_factor", "above the limit 1.0"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                              "long_factor": [1.0]}}, "short_factor", "needs rotary dimension"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                              "high_freq_factor": 4.0}}, "high_freq_factor", "above"),
    ],
)
def test_bad_config_values_name_the_field(llama_copy, changes, field, shown):
    edit_config(llama_copy, **changes)
    with pytest.raises(InvalidModelConfig) as info:
        load_within(llama_copy)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"config.json: {field}: ") and shown in message, message


def test_missing_required_field(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    del config["vocab_size"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidModelConfig, match="vocab_size: required field is missing"):
        load_within(llama_copy)


def test_weights_that_cannot_fit_name_the_largest_part(llama_copy):
    # every size within its limit, together some 24 TiB in float32: refused before allocating
    edit_config(llama_copy, hidden_size=65536, intermediate_size=524288, num_hidden_layers=64)
    with pytest.raises(ConfigError) as info:
        load_within(llama_copy)
    message = str(info.value)
    assert "weights in float32 would need" in message and "GiB" in message, message
    assert "the MLP weights (num_hidden_layers=64, intermediate_size=524,288" in message


def test_rope_tables_for_a_huge_context_are_refused_by_their_memory(llama_copy):
    with pytest.raises(ConfigError) as info:
        load_within(llama_copy, max_model_len=10**12)
    message = str(info.value)
    assert "RoPE cos/sin tables would need" in message, message
    assert "max_model_len=1,000,000,000,000" in message


# ---- safetensors headers ------------------------------------------------------------------------


def edit_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a safetensors file, keeping its data bytes."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length :])


def set_entry(**changes):
    return lambda header: header[TENSOR].update(changes)


def past_the_end(header: dict) -> None:
    begin, end = header[TENSOR]["data_offsets"]
    header[TENSOR]["data_offsets"] = [begin + 10**9, end + 10**9]


@pytest.mark.parametrize(
    ("edit", "shown"),
    [
        (set_entry(dtype="Q99"), "dtype 'Q99' is not supported"),
        (set_entry(shape=[1 << 40, 1 << 40]), "needs"),
        (set_entry(shape=[-64]), "is not a list of sizes"),
        (set_entry(shape="64"), "is not a list of sizes"),
        (set_entry(shape=[65]), "span 256"),
        (set_entry(data_offsets=[8, 4]), "are not [begin, end]"),
        (past_the_end, "past the end of the file"),
        (lambda header: header.update({TENSOR: [1, 2]}), "not a JSON object"),
    ],
)
def test_bad_safetensors_header_names_file_and_tensor(llama_copy, edit, shown):
    weights = llama_copy / WEIGHTS
    edit_header(weights, edit)
    with pytest.raises(CheckpointError) as info:
        load_within(llama_copy)
    message = str(info.value)
    assert f"{weights}: tensor {TENSOR}: " in message and shown in message, message


def test_absurd_header_length_names_the_file(llama_copy):
    weights = llama_copy / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes((1 << 60).to_bytes(8, "little") + data[8:])
    with pytest.raises(CheckpointError, match="header length") as info:
        load_within(llama_copy)
    assert str(weights) in str(info.value)


def test_shard_index_cannot_point_outside_the_checkpoint(llama_copy):
    index = {"metadata": {}, "weight_map": {TENSOR: "../elsewhere.safetensors"}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"outside the checkpoint directory"):
        load_within(llama_copy)
