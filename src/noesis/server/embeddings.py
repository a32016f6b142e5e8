"""/v1/embeddings: the request's inputs -> token ids -> the embedder its `model` names -> OpenAI's
list of embeddings (floats, or base64 of little-endian float32), with usage.

Two kinds of embedder: the served decoder, pooled by the engine loop between two steps
(AsyncEngine.embed), and sentence-embedding encoders (`--embedding-model`), run on a worker
thread of this process.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from noesis.engine.async_engine import AsyncEngine
from noesis.errors import ConfigError, PromptTooLong, UnsupportedModel
from noesis.server.config import ServeConfig
from noesis.server.errors import APIError
from noesis.server.protocol import EmbeddingRequest
from noesis.sidecars.embedder import SentenceEmbedder
from noesis.tokenizer import Tokenizer


def load_encoders(config: ServeConfig) -> list[SentenceEmbedder]:
    """The --embedding-model checkpoints, loaded; each name must differ from the others'."""
    encoders = [SentenceEmbedder(path) for path in config.embedding_models]
    names = [config.model_name] + [encoder.name for encoder in encoders]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"--embedding-model: two served models would be named {repeated}; "
                          "give the checkpoints directories of different names")
    return encoders


class Embeddings:
    """The embedders a server offers, by model name: the decoder's, then the encoders'."""

    def __init__(self, decoder_name: str, engine: AsyncEngine, tokenizer: Tokenizer,
                 max_model_len: int, encoders: list[SentenceEmbedder]) -> None:
        self.decoder_name = decoder_name
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.encoders = {encoder.name: encoder for encoder in encoders}

    @property
    def names(self) -> list[str]:
        return list(self.encoders)

    async def respond(self, body: EmbeddingRequest) -> dict[str, Any]:
        """The response body; APIError (400) for input the chosen model cannot embed."""
        encoder = self.encoders.get(body.model)
        if encoder is None:
            vectors, tokens = await self._decoder(body)
        else:
            vectors, tokens = await self._encoder(encoder, body)
        if body.dimensions is not None:
            vectors = _truncated(vectors, body.dimensions)  # a 400 when more than there are
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}

    async def _decoder(self, body: EmbeddingRequest) -> tuple[np.ndarray, int]:
        prompts = [self._decoder_ids(i, one) for i, one in enumerate(body.inputs())]
        try:
            vectors = await self.engine.embed(prompts, body.pooling or "last")
        except UnsupportedModel as exc:
            raise APIError(400, str(exc), "model", "model_not_supported") from exc
        return vectors, sum(map(len, prompts))

    def _decoder_ids(self, index: int, one: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(one) if isinstance(one, str) else one
        if len(ids) > self.max_model_len:
            raise _too_long(index, PromptTooLong(len(ids), self.max_model_len))
        return ids

    async def _encoder(self, encoder: SentenceEmbedder,
                       body: EmbeddingRequest) -> tuple[np.ndarray, int]:
        if body.pooling is not None:
            raise APIError(400, f"pooling: {encoder.name!r} pools as its checkpoint's "
                           f"1_Pooling config says ({encoder.pooling.mode})", "pooling",
                           "unsupported_parameter")
        if body.dimensions is not None and not encoder.truncatable:
            raise APIError(400, f"dimensions: {encoder.name!r} does not support shortened "
                           "embeddings", "dimensions", "unsupported_parameter")
        ids = []
        for index, one in enumerate(body.inputs()):
            try:
                ids.append(encoder.tokenize(one) if isinstance(one, str) else
                           encoder.check_ids(one))
            except PromptTooLong as exc:
                raise _too_long(index, exc) from exc
        vectors = await asyncio.to_thread(encoder.embed, ids)
        return vectors.numpy(), sum(map(len, ids))


def _truncated(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` components, renormalized to unit length (Matryoshka style)."""
    if dimensions > vectors.shape[1]:
        raise APIError(400, f"dimensions={dimensions} is more than this model's "
                       f"{vectors.shape[1]}", "dimensions", "invalid_value")
    cut = vectors[:, :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def _too_long(index: int, exc: PromptTooLong) -> APIError:
    return APIError(400, f"input[{index}]: {exc}", f"input[{index}]", "context_length_exceeded")

