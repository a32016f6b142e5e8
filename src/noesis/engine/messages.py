"""What crosses between the engine loop and its client: commands, reports, the engine's
description, and errors packed so that they survive a pipe."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from noesis.engine.engine import Engine
from noesis.engine.outputs import RequestOutput
from noesis.engine.stats import EngineStats
from noesis.errors import NoesisError
from noesis.sampling.defaults import generation_defaults
from noesis.tokenizer import Tokenizer

# ("add", request_id, token_ids, params) | ("abort", request_id) | ("stop",)
# | ("embed", embed_id, prompts, pooling)
Command = tuple[Any, ...]


class EngineDead(NoesisError):
    """The engine stopped (shutdown or a failure) before the request finished."""


class EngineStepError(NoesisError):
    """An engine step failed; the requests it carried were aborted."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about the engine it drives."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int
    # generation_config.json's temperature, top_p, top_k, repetition_penalty, where it sets them:
    # what a request that leaves them unset samples with (noesis.sampling.defaults)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        return cls(engine.tokenizer, engine.max_model_len, engine.config.max_num_seqs,
                   generation_defaults(engine.loaded.model_dir))


@dataclass(slots=True)
class Report:
    """One round of the engine loop: the adds it took or refused, the step's outputs, the
    requests a failed step took down (and why), and the engine state after it all."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    error: BaseException | None = None  # why `failed` failed
    stats: EngineStats | None = None
    # (embed_id, pooled embeddings [N, D] as a float32 numpy array, or why not) per "embed"
    embedded: list[tuple[str, Any]] = field(default_factory=list)


def pack_error(exc: BaseException) -> tuple:
    """An exception as (class, args, attributes): our errors' __init__ signatures differ from
    their args, so plain pickling cannot rebuild them."""
    packed = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.dumps(packed)
    except Exception:
        return (NoesisError, (f"{type(exc).__name__}: {exc}",), {})
    return packed


def unpack_error(packed: tuple) -> BaseException:
    cls, args, attributes = packed
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc
