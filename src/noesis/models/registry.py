"""Family name -> model class. Explicit, and loud about what is supported."""

from __future__ import annotations

from noesis.errors import UnsupportedModel
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM

MODEL_CLASSES = {
    "llama": DecoderLM,
    "mistral": DecoderLM,
    "qwen2": DecoderLM,
    "qwen3": DecoderLM,
    "phi3": DecoderLM,
}


def model_class(config: ModelConfig) -> type[DecoderLM]:
    try:
        return MODEL_CLASSES[config.family]
    except KeyError:
        raise UnsupportedModel(
            f"no model class for family {config.family!r}; supported: {sorted(MODEL_CLASSES)}"
        ) from None
