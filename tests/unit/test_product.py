"""Issue 22's product side: EngineConfig checked when built, CLI flags and config files from its
fields, device defaults, the stats line, model management on a fake Hugging Face cache, extras."""

import json
import math
from pathlib import Path

import pytest
import tomllib

from noesis import cli
from noesis.engine.config import EngineConfig
from noesis.engine.stats import EngineStats
from noesis.errors import ConfigError, ModelNotFound
from noesis.models_cli import list_models
from noesis.options import options_of
from noesis.server.stats_log import StatsLog
from noesis.weights.hub import bundled_models, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("options, name", [
    ({"page_size": 0}, "page_size"), ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"), ({"kv_cache_memory": 2**63}, "kv_cache_memory"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": math.nan}, "gpu_memory_utilization"),
    ({"device": "tpu"}, "device"), ({"device": "cuda:x"}, "device"), ({"dtype": "int3"}, "dtype"),
    ({"cuda_graphs": 1}, "cuda_graphs"), ({"seed": -1}, "seed"), ({"revision": 3}, "revision"),
])
def test_every_bad_field_is_a_config_error_naming_it(options, name):
    with pytest.raises(ConfigError, match=name):
        EngineConfig(**options)


def test_device_defaults_are_filled_in_once_the_device_is_known():
    assert (EngineConfig().for_device("cuda").max_num_seqs, EngineConfig().for_device(
        "cuda").max_num_batched_tokens) == (256, 8192)  # a batch of 128 runs as one wave
    cpu = EngineConfig().for_device("cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 2048)
    assert EngineConfig(max_num_seqs=3).for_device("cuda").max_num_seqs == 3


def _serve_config(monkeypatch, argv):
    seen = {}
    monkeypatch.setattr("noesis.server.app.serve", lambda config: seen.update(c=config))
    monkeypatch.delenv("NOESIS_API_KEY", raising=False)
    assert cli.main(["serve", "--model", "m", *argv]) in (0, None)
    return seen["c"]


def test_serve_has_a_flag_for_every_engine_option_and_passes_them_on(monkeypatch):
    help_text = cli._parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in options_of(EngineConfig):
        assert "--" + (f.metadata["flag"] or f.name.replace("_", "-")) in help_text
    config = _serve_config(monkeypatch, [
        "--gpu-memory-utilization", "0.5", "--max-model-len", "64", "--no-cuda-graphs",
        "--revision", "v1", "--kv-cache-memory", "4096", "--no-prefix-caching",
        "--stats-interval", "0"])
    engine = config.engine
    assert (engine.gpu_memory_utilization, engine.max_model_len, engine.cuda_graphs,
            engine.revision, engine.kv_cache_memory, engine.enable_prefix_caching) == (
        0.5, 64, False, "v1", 4096, False)
    assert config.stats_interval == 0
    assert _serve_config(monkeypatch, []).engine.enable_prefix_caching  # serve's default


def test_serve_runs_the_safety_sidecar_unless_told_not_to(monkeypatch, tmp_path, capsys):
    def names(*argv):
        sidecars = _serve_config(monkeypatch, list(argv)).engine.sidecars
        return [spec.name for spec in sidecars.sidecars]

    assert names() == ["safety"]  # the server's default
    assert names("--no-safety") == []
    off = tmp_path / "off.toml"
    off.write_text("[sidecars.safety]\nenabled = false\n[sidecars.intent]\n")
    assert names("--sidecars", str(off)) == ["intent"]
    assert names("--sidecars", str(off), "--safety") == ["intent"]  # the file's word stands
    # `noesis info --sidecars` lists what the server would run
    from noesis.weights.hub import bundled_models

    assert cli.main(["info", "--model", str(bundled_models()["noesis-tiny"]), "--sidecars"]) == 0
    assert "safety" in capsys.readouterr().out.split("sidecars", 1)[1]


@pytest.mark.parametrize("flag, value", [("--page-size", "0"), ("--dtype", "int3"),
                                         ("--gpu-memory-utilization", "2")])
def test_a_bad_engine_flag_is_a_usage_error_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        cli._parser().parse_args(["chat", flag, value])
    assert info.value.code == 2 and flag in capsys.readouterr().err


def test_a_config_file_sets_options_under_the_command_line(monkeypatch, tmp_path, capsys):
    path = tmp_path / "serve.toml"
    path.write_text('max_num_seqs = 7\nport = 9001\ncors_origins = ["http://a.test"]\n'
                    'cuda_graphs = false\nmax-num-batched-tokens = 99\n')
    config = _serve_config(monkeypatch, ["--config", str(path), "--port", "9002"])
    assert (config.engine.max_num_seqs, config.engine.max_num_batched_tokens,
            config.engine.cuda_graphs) == (7, 99, False)
    assert config.port == 9002 and config.cors_origins == ("http://a.test",)
    json_path = tmp_path / "serve.json"
    json_path.write_text(json.dumps({"max_num_seqs": 5, "max_nun_seqs": 6, "hots": "x"}))
    assert cli.main(["serve", "--config", str(json_path)]) == 1
    assert "unknown config keys ['hots', 'max_nun_seqs']" in capsys.readouterr().err
    json_path.write_text(json.dumps({"page_size": 0}))
    assert cli.main(["serve", "--config", str(json_path)]) == 1
    assert "page_size must be between 1" in capsys.readouterr().err


def test_the_stats_line_covers_the_interval_and_an_idle_server_is_quiet():
    log = StatsLog(engine=None, interval_s=10)
    assert log.line(EngineStats(), 0.0) is None  # the baseline
    assert log.line(EngineStats(), 10.0) is None  # nothing happened
    busy = EngineStats(running=3, waiting=1, kv_pages_total=200, kv_pages_used=50,
                       prefix_query_tokens=400, prefix_hit_tokens=100, prompt_tokens=1000,
                       generation_tokens=500)
    assert log.line(busy, 20.0) == (
        "engine: prompt 100.0 tok/s, generation 50.0 tok/s, running 3, waiting 1, KV 25.0% used, "
        "prefix cache hits 25.0% of prompt tokens")


def _fake_hf_cache(root: Path, repo: str, config: dict) -> Path:
    """A Hugging Face cache entry laid out as huggingface_hub writes it (blobs + snapshot links)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in (("config.json", json.dumps(config)), ("model.safetensors", "x" * 2000)):
        blob = folder / "blobs" / f"blob-{name}"
        blob.write_text(data)
        (snapshot / name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_list_shows_bundled_local_and_cached_models(hf_cache, tmp_path, capsys):
    _fake_hf_cache(hf_cache, "org/quant", {"model_type": "qwen3", "quantization_config": {
        "quant_method": "awq", "bits": 4}})
    local = tmp_path / "mine" / "ckpt"
    local.mkdir(parents=True)
    (local / "config.json").write_text('{"model_type": "llama"}')
    by_name = {e.name: e for e in list_models([str(tmp_path / "mine")])}
    assert by_name["noesis-tiny"].source == "bundled"
    assert (by_name[str(local)].source, by_name[str(local)].family) == ("local", "llama")
    cached = by_name["org/quant"]
    assert (cached.source, cached.family, cached.quantization) == ("hf-cache", "qwen3",
                                                                   "awq (4-bit)")
    assert cached.size_bytes >= 2000
    assert cli.main(["list"]) == 0 and "org/quant" in capsys.readouterr().out


def test_rm_removes_a_cache_entry_only_and_names_resolve_alike(hf_cache, capsys):
    snapshot = _fake_hf_cache(hf_cache, "org/small", {"model_type": "llama"})
    assert resolve_model_dir("org/small") == snapshot  # offline, from the cache
    assert resolve_model_dir("noesis-tiny") == bundled_models()["noesis-tiny"]
    assert cli.main(["rm", "noesis-tiny", "--yes"]) == 1  # bundled: refused
    assert cli.main(["rm", "org/other", "--yes"]) == 1
    assert "org/small" in capsys.readouterr().err  # the cached models are listed
    assert cli.main(["rm", "org/small", "--yes"]) == 0
    assert not (hf_cache / "models--org--small").exists()


def test_pull_offline_says_what_to_do(hf_cache):
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE.*local checkpoint directory.*copy"):
        resolve_model_dir("org/absent")
    assert cli.main(["pull", "org/absent"]) == 1


def test_core_install_does_not_pull_the_server_and_the_wheel_carries_the_models():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(name in core for name in ("fastapi", "uvicorn", "prometheus"))
    assert {"server", "voice", "mic", "dev"} <= set(project["optional-dependencies"])
    bundled = ROOT / "src" / "noesis" / "bundled"
    assert bundled.resolve() == (ROOT / "models").resolve()  # package data: bundled/*/*


def test_every_command_prints_its_help():
    commands = cli._parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        assert parser.format_help().startswith("usage: "), name  # a stray % in help raises
