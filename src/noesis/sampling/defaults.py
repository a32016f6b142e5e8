"""Sampling defaults a checkpoint recommends in its generation_config.json (as vLLM reads them)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from noesis.errors import InvalidSamplingParams
from noesis.sampling.params import SamplingParams
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file

log = logging.getLogger("noesis")

# The knobs taken from generation_config.json; the others (max_length, do_sample, ...) describe
# transformers' generate(), not a request's sampling.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The GENERATION_KEYS that generation_config.json sets, each one SamplingParams accepts;
    {} without the file. A value SamplingParams refuses is left out with a warning: a
    checkpoint's odd recommendation must not stop it from loading."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json_file(path, CONFIG_MAX_BYTES)
    defaults = {}
    for key in GENERATION_KEYS:
        value = config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})
        except InvalidSamplingParams as exc:
            log.warning("generation_config.json: %s is ignored: %s", key, exc)
            continue
        defaults[key] = value
    return defaults
