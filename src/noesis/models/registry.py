"""Family name -> model class. Explicit, and loud about what is supported."""

from __future__ import annotations

from noesis.errors import UnsupportedModel
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM
from noesis.models.gemma import GemmaLM
from noesis.models.lfm2 import Lfm2LM

MODEL_CLASSES: dict[str, type[DecoderLM] | type[GemmaLM] | type[Lfm2LM]] = {
    "llama": DecoderLM,
    "mistral": DecoderLM,
    "qwen2": DecoderLM,
    "qwen3": DecoderLM,
    "phi3": DecoderLM,
    "qwen3_moe": DecoderLM,
    "mixtral": DecoderLM,
    "gpt_oss": DecoderLM,
    "gemma2": GemmaLM,
    "gemma3": GemmaLM,
    "lfm2": Lfm2LM,
}


def model_class(config: ModelConfig) -> type[DecoderLM] | type[GemmaLM] | type[Lfm2LM]:
    try:
        return MODEL_CLASSES[config.family]
    except KeyError:
        raise UnsupportedModel(
            f"no model class for family {config.family!r}; supported: {sorted(MODEL_CLASSES)}"
        ) from None
