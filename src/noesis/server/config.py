"""ServeConfig: what `noesis serve` was asked for, beyond the engine's own options, and the
RequestLimits every request is held to before any work is done for it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from noesis.errors import ConfigError
from noesis.errors import check_count as _check_range

if TYPE_CHECKING:  # the request checks (protocol.py) import this module in a torch-free worker
    from noesis.engine.engine import EngineConfig


def _default_engine() -> EngineConfig:
    from noesis.engine.engine import EngineConfig

    return EngineConfig()

COUNT_MAX = 2**31 - 1  # counts and sizes: anything larger is a typo, not a wish
MAX_SECONDS = 1e9  # finite, and small enough for the event loop's timers
MAX_JSON_DEPTH = 512  # json.loads recurses per level: stay clear of Python's recursion limit


@dataclass(frozen=True)
class RequestLimits:
    """What one request may bring, checked on the wire types before tokenizing or queueing.

    Each has a `noesis serve` flag of the same name (`max_json_depth` -> `--max-json-depth`).
    """

    max_json_depth: int = 64  # nesting of the body's JSON, checked before it is parsed (<= 512)
    # Characters of one prompt (a chat's message text, or one completion prompt). None: the
    # context length times the tokenizer's longest token: more characters cannot fit.
    max_prompt_chars: int | None = None
    max_messages: int = 2048
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 1024  # characters of one stop string
    max_tools: int = 128
    max_schema_bytes: int = 256 << 10  # compact JSON of one tool's parameters / response schema
    max_schema_depth: int = 48  # nesting of one such schema

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name != "max_prompt_chars":
                check_count(f.name, value)
        check_count("max_json_depth", self.max_json_depth, hi=MAX_JSON_DEPTH)


@dataclass(frozen=True)
class ServeConfig:
    model: str
    engine: EngineConfig = field(default_factory=_default_engine)
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    # When set, every route but /health (and /metrics with metrics_public) needs it as a
    # Bearer token; an empty key is refused rather than read as "no key".
    api_key: str | None = None
    metrics_public: bool = False  # /metrics without the key (for a scraper on a trusted network)
    enable_docs: bool = False  # /docs, /redoc, /openapi.json (behind the key like the rest)
    # Browser origins allowed to call the API (CORS), e.g. ("http://localhost:3000",); "*" for
    # any. Empty: no CORS headers, so browsers on other origins cannot read the responses.
    cors_origins: tuple[str, ...] = ()
    max_n: int = 16  # choices per request
    max_tokens_limit: int | None = None  # per choice; default: the context length
    max_queue: int = 256  # requests waiting beyond the running batch before 429
    max_body_bytes: int = 16 << 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on SIGTERM
    stats_interval: float = 10.0  # seconds between engine stats lines in the log; 0: none
    log_level: str = "info"
    engine_process: bool = True  # the engine in a child process: no GIL shared with HTTP work
    chat_template: str | None = None  # Jinja text replacing the checkpoint's (--chat-template)
    tool_dialect: str | None = None  # tool-call format by name (--tool-dialect; default: detected)
    # Sentence-embedding checkpoints (BERT family) served on /v1/embeddings beside the decoder,
    # each under its directory's name (--embedding-model PATH, repeatable).
    embedding_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_n", "max_body_bytes"):
            check_count(name, getattr(self, name))
        if self.max_tokens_limit is not None:
            check_count("max_tokens_limit", self.max_tokens_limit)
        check_count("max_queue", self.max_queue, lo=0)
        check_count("port", self.port, lo=0, hi=65535)
        _check_seconds("shutdown_timeout", self.shutdown_timeout)
        _check_seconds("stats_interval", self.stats_interval)
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(
                    f"cors_origins: {origin!r} is not an origin (scheme://host[:port]) or '*'"
                )
        if self.api_key is not None:
            _check_api_key(self.api_key)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


def check_count(name: str, value: object, lo: int = 1, hi: int = COUNT_MAX) -> None:
    """A whole number in [lo, hi], or a ConfigError naming the field."""
    _check_range(name, value, lo, hi)


def _check_seconds(name: str, value: object) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 <= value <= MAX_SECONDS:  # NaN fails both comparisons
        raise ConfigError(f"{name} must be between 0 and {MAX_SECONDS:g} seconds, got {value!r}")


def _check_api_key(key: str) -> None:
    if not key.strip():
        raise ConfigError(
            "the API key is empty: an empty key would leave the server open; pass a real key, "
            "or none at all for a server without one"
        )
    if key != key.strip():  # the header's token is read stripped: such a key never matches
        raise ConfigError("the API key starts or ends with whitespace, which no client can send")
