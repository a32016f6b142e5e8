"""noesis: a local LLM inference runtime on PyTorch."""

from noesis.engine.engine import Engine, EngineConfig
from noesis.engine.outputs import RequestOutput
from noesis.errors import (
    ChatTemplateError,
    CheckpointError,
    CheckpointMismatch,
    ConfigError,
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

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "NoesisError",
    "InvalidRequest",
    "InvalidSamplingParams",
    "PromptTooLong",
    "ModelNotFound",
    "UnsupportedModel",
    "CheckpointError",
    "CheckpointMismatch",
    "ChatTemplateError",
    "ConfigError",
    "OutOfKVCache",
]
