"""ServeConfig: what `noesis serve` was asked for, beyond the engine's own options."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from noesis.engine.engine import EngineConfig
from noesis.errors import ConfigError


@dataclass(frozen=True)
class ServeConfig:
    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required as a Bearer token on /v1/* when set
    max_n: int = 16  # choices per request
    max_tokens_limit: int | None = None  # per choice; default: the context length
    max_queue: int = 256  # requests waiting beyond the running batch before 429
    max_body_bytes: int = 16 << 20
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on SIGTERM
    log_level: str = "info"
    engine_process: bool = True  # the engine in a child process: no GIL shared with HTTP work

    def __post_init__(self) -> None:
        for name in ("max_n", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ConfigError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if self.max_queue < 0 or self.shutdown_timeout < 0:
            raise ConfigError("max_queue and shutdown_timeout must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model
