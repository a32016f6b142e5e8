"""Capability-driven loading: `capabilities=` asks for what to load and is checked against the
checkpoint before any weight is read; a Qwen2.5-VL (and Qwen2-VL) checkpoint loads its text
model alone (the bytes read prove no vision tensor was) and matches transformers on text; and an
image or audio part sent to a text-only load is refused by name, from the Python API and from
the server (through the official client)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from checkpoints import build_tokenizer, hf_generate, noesis_greedy

from noesis import LLM
from noesis.engine.config import EngineConfig
from noesis.errors import ConfigError, InvalidRequest
from noesis.models.capabilities import check_messages
from noesis.options import add_option_flags, apply_config_file, given_options

PROMPT = list(range(30, 50))
NEW_TOKENS = 8
TOL = 1e-4
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


# Qwen2.5-VL and Qwen2-VL: transformers' config and model classes, and a one-block vision tower.
VISION_LANGUAGE = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                        out_hidden_size=64, fullatt_block_indexes=[0])),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
}  # fmt: skip


@pytest.fixture(scope="module")
def vision_language(tmp_path_factory):
    """name -> a tiny random checkpoint as transformers writes it (the Hub's layout: the text
    model under model.* and lm_head, the vision tower under visual.*), its config.json in the
    Hub's spelling of M-RoPE, and the shapes of its tensors; each built once."""
    import transformers
    from safetensors import safe_open

    built = {}

    def build(name: str):
        if name in built:
            return built[name]
        config_class, model_class, vision = VISION_LANGUAGE[name]
        path = tmp_path_factory.mktemp(name)
        text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=0, eos_token_id=1, initializer_range=0.3,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # fmt: skip
        config = getattr(transformers, config_class)(
            text_config=text, vision_config=vision, image_token_id=5, video_token_id=6
        )
        torch.manual_seed(0)
        getattr(transformers, model_class)(config).save_pretrained(path)
        build_tokenizer(path)
        hub_style(path / "config.json")
        with safe_open(path / "model.safetensors", "pt") as f:
            shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118
        built[name] = path, shapes
        return built[name]

    return build


def hub_style(config_path):
    """M-RoPE as the Hub's Qwen2-VL and Qwen2.5-VL configs spell it: rope_scaling
    {"type": "mrope", ...}."""
    config = json.loads(config_path.read_text())
    text = config["text_config"]
    params = text.pop("rope_parameters")
    text["rope_theta"] = params["rope_theta"]
    text["rope_scaling"] = {"type": "mrope", "mrope_section": params["mrope_section"]}
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llm(vision_language):
    path, _ = vision_language("qwen2_5_vl")
    return LLM(str(path), device="cpu", dtype="float32", progress=False, max_num_seqs=4)


@pytest.mark.parametrize("name", list(VISION_LANGUAGE))
def test_a_qwen_vl_checkpoint_loads_its_text_model_alone_and_matches_transformers(
    vision_language, llm, name
):
    import transformers

    from noesis.engine.loading import describe_checkpoint

    path, shapes = vision_language(name)
    vision = [key for key in shapes if key.startswith("visual.")]
    text_bytes = 4 * sum(torch.Size(s).numel() for k, s in shapes.items() if k not in vision)
    assert vision and text_bytes
    if name != "qwen2_5_vl":
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    assert llm.model_config.capabilities == ("text", "vision")
    assert llm.model_config.rope.rope_type == "default"  # M-RoPE on text positions
    assert llm.engine.loaded.bytes_read == text_bytes  # not one vision tensor read
    model_class = getattr(transformers, VISION_LANGUAGE[name][1])
    ref = model_class.from_pretrained(path, dtype=torch.float32).eval()
    ref_tokens, ref_rows = hf_generate(ref, PROMPT, NEW_TOKENS)
    tokens, logprobs = noesis_greedy(llm, PROMPT, NEW_TOKENS)
    assert tokens == ref_tokens
    rows = zip(tokens, logprobs, strict=True)
    worst = max(abs(lp - ref_rows[i, t].item()) for i, (t, lp) in enumerate(rows))
    assert worst <= TOL, f"max |logprob difference| {worst:.3g}"
    line = describe_checkpoint(path)["capabilities"]
    assert line.startswith("text ") and "(loaded); vision " in line
    assert line.endswith("(not loaded)")


@pytest.mark.parametrize(("asked", "match"), [
    (("text", "vision"), "vision is not supported yet: noesis has no vision encoder"),
    (("text", "audio"), "has no audio capability; it has text, vision"),
])  # fmt: skip
def test_a_capability_it_cannot_load_is_refused_before_any_weight(vision_language, monkeypatch,
                                                                  asked, match):
    import noesis.engine.loading as loading

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loading, "load_weights", no_weights)
    with pytest.raises(ConfigError, match=match):
        LLM(str(vision_language("qwen2_5_vl")[0]), device="cpu", capabilities=asked,
            progress=False)


def test_vision_on_a_text_only_checkpoint_names_what_it_has(checkpoints):
    with pytest.raises(ConfigError, match="LlamaForCausalLM checkpoint has no vision capability; "
                                          "it has text$"):
        LLM(str(checkpoints.path("llama")), device="cpu", capabilities=["text", "vision"])


@pytest.mark.parametrize(("value", "match"), [
    (("vision",), "must include text"),
    ((), "one or more of text, vision, audio"),
    (("text", "text"), "no repeats"),
    (("text", "video"), "one or more of text, vision, audio"),
    (("text", 3), "one or more"),
    (5, "one or more"),
])  # fmt: skip
def test_the_option_is_checked_when_built(value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(capabilities=value)


def test_the_option_takes_a_tuple_a_list_or_the_flags_text():
    assert EngineConfig().capabilities == ("text",)
    assert EngineConfig(capabilities=["text"]).capabilities == ("text",)
    assert EngineConfig(capabilities="text,vision").capabilities == ("text", "vision")


def test_the_flag_is_built_from_the_field():
    import argparse

    parser = argparse.ArgumentParser()
    add_option_flags(parser, EngineConfig)
    args = parser.parse_args(["--capabilities", "text,vision"])
    assert given_options(EngineConfig, args)["capabilities"] == ("text", "vision")
    assert parser.parse_args([]).capabilities == ("text",)
    with pytest.raises(SystemExit):
        parser.parse_args(["--capabilities", "text,smell"])
    args = parser.parse_args([])
    apply_config_file(parser, args, [], {"capabilities": ["text", "vision"]})  # a TOML list
    assert args.capabilities == ("text", "vision")


@pytest.mark.parametrize(("part", "match"), [
    (IMAGE, r"messages\[1\]\.content\[1\]: an image input \('image_url'\) needs the vision "
            "capability, and this model was loaded text-only"),
    ({"type": "image", "url": "x"}, "describe the image in words"),
    ({"type": "input_image", "image_url": "x"}, "needs the vision capability"),
    (AUDIO, r"audio input \('input_audio'\) needs the audio capability.*transcribe it"),
])  # fmt: skip
def test_the_chat_api_refuses_an_image_or_audio_part_on_a_text_only_load(llm, part, match):
    """Today's templates drop such a part, or print it as text: refused instead, by name."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}]
    with pytest.raises(InvalidRequest, match=match):
        llm.chat(messages)
    with pytest.raises(InvalidRequest, match=match):
        llm.generate_turn(messages)
    assert not llm.engine.has_unfinished()
    text_only = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert llm.render_chat(text_only)  # text parts still pass


def test_a_load_with_a_capability_reads_its_parts():
    check_messages([{"role": "user", "content": [IMAGE]}], ("text", "vision"))
    with pytest.raises(InvalidRequest, match="loaded with text, vision"):
        check_messages([{"role": "user", "content": [AUDIO]}], ("text", "vision"))


@pytest.fixture(scope="module")
def client(llm):
    from starlette.testclient import TestClient

    from noesis.engine.transport import EngineThread
    from noesis.server.app import create_app
    from noesis.server.config import ServeConfig

    app = create_app(ServeConfig("vl", engine_process=False), EngineThread(llm.engine))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


@pytest.mark.parametrize("part", [IMAGE, AUDIO], ids=["image", "audio"])
def test_the_chat_route_refuses_them_openai_style(client, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="vl", messages=messages, max_tokens=2)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == "messages[0].content[1]" and error["code"] == "unsupported_value"
    assert "loaded text-only" in error["message"]


@pytest.mark.parametrize(("content", "param"), [
    ([{"type": "input_text", "text": "What is it?"},
      {"type": "input_image", "image_url": "https://example.com/cat.png"}], "input[0][1]"),
    ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
     "input[0][0]"),
])  # fmt: skip
def test_the_responses_route_refuses_them_openai_style(client, content, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="vl", input=[{"role": "user", "content": content}],
                                max_output_tokens=2)  # fmt: skip
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and "loaded text-only" in error["message"]
    answer = client.responses.create(model="vl", input="Hi", max_output_tokens=2)
    assert answer.status in ("completed", "incomplete")  # text still answers
