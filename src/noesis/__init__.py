"""noesis: a local LLM inference runtime on PyTorch.

Names are imported lazily so that the pure-Python planner (scheduler, page allocator) can be
imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "noesis.llm",
    "Engine": "noesis.engine.engine",
    "EngineConfig": "noesis.engine.engine",
    "SamplingParams": "noesis.sampling.params",
    "RequestOutput": "noesis.engine.outputs",
    "SpeculativeConfig": "noesis.speculative.config",
    **{
        name: "noesis.errors"
        for name in (
            "NoesisError", "InvalidRequest", "InvalidSamplingParams", "PromptTooLong",
            "ModelNotFound", "UnsupportedModel", "CheckpointError", "CheckpointMismatch",
            "ChatTemplateError", "ConfigError", "OutOfKVCache", "InvalidModelConfig",
        )
    },
}

__all__ = [
    "LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "SpeculativeConfig",
    "NoesisError",
    "InvalidRequest", "InvalidSamplingParams", "PromptTooLong", "ModelNotFound",
    "UnsupportedModel", "CheckpointError", "CheckpointMismatch", "ChatTemplateError",
    "ConfigError", "OutOfKVCache", "InvalidModelConfig",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'noesis' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


if TYPE_CHECKING:
    from noesis.engine.engine import Engine, EngineConfig
    from noesis.engine.outputs import RequestOutput
    from noesis.errors import (
        ChatTemplateError,
        CheckpointError,
        CheckpointMismatch,
        ConfigError,
        InvalidModelConfig,
        InvalidRequest,
        InvalidSamplingParams,
        ModelNotFound,
        NoesisError,
        OutOfKVCache,
        PromptTooLong,
        UnsupportedModel,
    )
    from noesis.llm import LLM
    from noesis.sampling.params import SamplingParams
    from noesis.speculative.config import SpeculativeConfig
