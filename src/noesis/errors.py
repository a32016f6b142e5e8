"""Exceptions raised to callers. Each names the problem; none is an `assert`."""

from __future__ import annotations


class NoesisError(Exception):
    """Base class of every error noesis raises on purpose."""


class InvalidRequest(NoesisError, ValueError):
    """A request or one of its parameters is not acceptable."""


class InvalidSamplingParams(InvalidRequest):
    """A SamplingParams field is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"SamplingParams.{field}: {message}")
        self.field = field


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the model's context window."""

    def __init__(self, prompt_len: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {prompt_len} tokens but the model's context holds {max_model_len}; "
            "shorten the prompt"
        )
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class ModelNotFound(NoesisError, FileNotFoundError):
    """The model path or Hub repo id could not be resolved to a checkpoint directory."""


class UnsupportedModel(NoesisError, ValueError):
    """The checkpoint's architecture or a config feature is not implemented."""


class CheckpointError(NoesisError, ValueError):
    """A checkpoint file is unreadable, corrupt or truncated."""


class InvalidModelConfig(CheckpointError):
    """config.json holds a value of the wrong type, out of range, or inconsistent with another;
    `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config.json: {field}: {message}")
        self.field = field


class CheckpointMismatch(CheckpointError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped."""


class ChatTemplateError(NoesisError, ValueError):
    """The checkpoint has no chat template, or rendering it failed."""


class OutOfKVCache(InvalidRequest):
    """A single request needs more KV pages than the whole pool holds."""


class ConfigError(NoesisError, ValueError):
    """An engine option (device, dtype, sizes) is invalid or cannot be satisfied."""


def check_count(name: str, value: object, lo: int, hi: int) -> None:
    """An option that must be a whole number in [lo, hi] (a bool is none): a ConfigError naming
    it otherwise. The one range check of the engine's and the server's options."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {value}")
