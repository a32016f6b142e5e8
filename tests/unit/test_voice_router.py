"""Voice router: features, the bundled weights (size, accuracy on unseen questions), loading
errors, and routing rules from configuration (devices, tools, file formats)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from noesis.errors import CheckpointError, ConfigError
from noesis.tiny import corpus, tools
from noesis.voice.config import DEFAULTS, load_config, pick_device
from noesis.voice.router import Router, RouterConfig, features, normalize

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-router"


@pytest.fixture(scope="module")
def router() -> Router:
    return Router.load(BUNDLED)


def test_normalize_makes_typed_and_spoken_text_alike():
    assert normalize("What is 17 times 23?") == normalize("what is 45 times 99")
    assert normalize("Convert 3.5 km to Miles!") == "convert 0 0 km to miles"
    assert normalize("12*7%") == "00*0%"


def test_features_are_stable_and_in_range():
    config = RouterConfig(labels=("a", "b"), num_buckets=64)
    ids = features("Hello there", config)
    assert ids == features("hello there!", config)
    assert all(0 <= i < 64 for i in ids)
    # 2 words + 1 bigram + character 3- and 4-grams of " hello there "
    assert len(ids) == 2 + 1 + (13 - 2) + (13 - 3)


def test_bundled_router_is_small(router: Router):
    assert router.num_parameters <= 1_000_000
    size = sum(f.stat().st_size for f in BUNDLED.iterdir())
    assert size < 5 * 2**20
    assert router.config.labels == tuple(corpus.GENERATORS)


def test_bundled_router_labels_unseen_questions(router: Router):
    # Held-out questions past the 3000 used for the reported accuracy: unseen entities.
    examples = [corpus.example(0, "heldout", i) for i in range(5000, 5400)]
    predicted = router.predict_batch([e.prompt_messages[-1]["content"] for e in examples])
    correct = sum(label == e.task for (label, _), e in zip(predicted, examples, strict=True))
    assert correct / len(examples) >= 0.97
    label, probability = router.predict("what is seventeen times twenty three")
    assert label == "calculator" and 0.5 < probability <= 1.0
    assert router.predict("Hello there!")[0] == "greeting"


def test_router_load_rejects_missing_and_mismatched_files(tmp_path: Path, router: Router):
    with pytest.raises(CheckpointError, match="has no config.json"):
        Router.load(tmp_path)
    router.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not fit its config"):
        Router.load(tmp_path)


def test_routing_rules_pick_expert_tools_and_an_available_device():
    config = load_config()
    route = config.route("calculator", cuda_available=False)
    assert (route.expert, route.device, route.tools) == (
        "noesis-tiny-ternary", "cpu", ("calculator",))
    assert config.route("calculator", cuda_available=True).device == "cpu"  # the CPU kernel
    assert config.route("writing", cuda_available=True).device == "cuda"
    assert config.route("greeting", cuda_available=True).expert == "noesis-tiny-draft"
    # the catch-all rule declares every built-in tool the bundled model knows (issue 23)
    assert config.route("writing", cuda_available=False).tools == tuple(tools.DECLARATION_ORDER)
    config.check_labels(tuple(corpus.GENERATORS))
    assert pick_device(("cuda", "cpu")) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="none of the devices"):
        pick_device(("cuda",), cuda_available=False)


def test_config_files_override_defaults(tmp_path: Path):
    toml = tmp_path / "voice.toml"
    toml.write_text(
        '[threads]\nllm = 2\n\n[[rules]]\ntasks = ["*"]\nexpert = "noesis-tiny-draft"\n'
        'device = ["cpu"]\n'
    )
    config = load_config(toml)
    assert config.threads.llm == 2 and config.threads.tts == DEFAULTS["threads"]["tts"]
    assert config.route("calculator").expert == "noesis-tiny-draft"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"tasks": ["*"], "expert": "nope", "device": ["cpu"]}]}))
    with pytest.raises(ConfigError, match="names expert 'nope'"):
        load_config(bad)
    bad.write_text(json.dumps({"generation": {"draft": "nope"}}))
    with pytest.raises(ConfigError, match="generation.draft names expert 'nope'"):
        load_config(bad)
    assert load_config().generation.draft == "noesis-tiny-draft"  # speculates for the others
    bad.write_text(json.dumps({"threads": {"tts": 0}}))
    with pytest.raises(ConfigError, match="threads.tts"):
        load_config(bad)
    assert load_config(toml).asr_window_s == DEFAULTS["asr"]["window_s"]
    bad.write_text(json.dumps({"asr": {"window_s": 30}}))  # Whisper's own window
    assert load_config(bad).asr_window_s == 30.0
    for wrong in ({"window_s": 0.5}, {"window_s": "10"}, {"window_s": 10, "beam": 2}):
        bad.write_text(json.dumps({"asr": wrong}))
        with pytest.raises(ConfigError, match="window_s"):
            load_config(bad)
    bad.write_text(json.dumps({"colour": 1}))
    with pytest.raises(ConfigError, match="unknown voice config keys"):
        load_config(bad)
    only_greetings = load_config(toml)
    object.__setattr__(only_greetings, "rules", only_greetings.rules[:0])
    with pytest.raises(ConfigError, match="miss the router's tasks"):
        only_greetings.check_labels(("greeting",))


def test_model_paths_are_bundled_names_absolute_or_relative_to_the_repository(tmp_path: Path):
    from noesis.weights.hub import bundled_models

    config = load_config()  # bundled names: found from an installed wheel as from a clone
    assert config.router == bundled_models()["noesis-router"]
    assert config.experts["noesis-tiny"] == bundled_models()["noesis-tiny"]
    toml = tmp_path / "voice.toml"
    toml.write_text(f'router = "models/noesis-router"\n[experts]\nmine = "{tmp_path}"\n')
    config = load_config(toml)
    assert (config.router / "config.json").is_file()  # a clone's relative path still works
    assert config.experts["mine"] == tmp_path
