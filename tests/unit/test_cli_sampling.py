"""`noesis generate` / `chat` sampling flags: a flag given wins, then the checkpoint's
generation_config.json, then the CLI's own fallback (temperature 0.7, the rest SamplingParams')."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from noesis import LLM, InvalidSamplingParams
from noesis.cli import SAMPLING_FALLBACK, _parser, _sampling, _sampling_flags


class CheckpointDir:
    """What _sampling reads of a loaded LLM: its model directory (LLM's own method on it)."""

    def __init__(self, model_dir) -> None:
        self.engine = SimpleNamespace(loaded=SimpleNamespace(model_dir=model_dir))

    def get_default_sampling_params(self, **overrides):
        return LLM.get_default_sampling_params(self, **overrides)


def params(model_dir, *flags: str):
    args = _parser().parse_args(["generate", "-p", "hello", *flags])
    return _sampling(_sampling_flags(args), CheckpointDir(model_dir))


def knobs(p) -> tuple:
    return p.temperature, p.top_p, p.top_k, p.repetition_penalty


def test_the_checkpoint_recommends_what_no_flag_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_k": 40, "repetition_penalty": 1.1}))
    assert knobs(params(tmp_path)) == (0.3, 1.0, 40, 1.1)
    given = params(tmp_path, "--temperature", "0", "--top-k", "5", "--top-p", "0.5", "--seed", "3")
    assert knobs(given) == (0.0, 0.5, 5, 1.1) and given.seed == 3


def test_without_generation_config_the_cli_defaults_stay(tmp_path):
    assert knobs(params(tmp_path)) == (SAMPLING_FALLBACK["temperature"], 1.0, 0, 1.0)
    assert params(tmp_path, "-t", "1.2").temperature == 1.2


def test_a_bad_flag_is_refused_before_any_model_loads():
    args = _parser().parse_args(["generate", "-p", "hello", "--top-p", "1.5"])
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        _sampling_flags(args)
