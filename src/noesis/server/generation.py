"""Generation: one API call in flight: its engine requests (prompts x n choices), read together.

All choices share one Outbox, so a call has one consumer task however many choices it has, and
that task wakes at most once per engine step. A Generation adds all choices at once (all or
nothing), hands out (choice index, delta) as choices advance, counts each choice's tokens (and
keeps its deltas when a whole response is wanted), records each choice's metrics when it ends,
and aborts whatever is unfinished when it is closed early (client gone, error, shutdown).
"""

from __future__ import annotations

import asyncio

from noesis.engine.async_engine import (
    AsyncEngine,
    Outbox,
    QueueFull,
    RequestFailed,
    RequestStream,
)
from noesis.engine.outputs import RequestOutput, merge_deltas
from noesis.errors import InvalidRequest
from noesis.sampling.params import SamplingParams
from noesis.server.metrics import Metrics


class Generation:
    def __init__(self, engine: AsyncEngine, metrics: Metrics, keep_outputs: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.outbox = Outbox()
        self.streams: list[RequestStream] = []
        self.prompt_lens: list[int] = []  # per choice
        self.num_tokens: list[int] = []  # per choice: generated so far
        self.num_cached: list[int] = []  # per choice: prompt tokens found in the prefix cache
        self._firsts: list[int] = []  # each prompt's first choice
        self._deltas: list[list[RequestOutput]] | None = [] if keep_outputs else None
        self._recorded: list[bool] = []
        self._remaining = 0

    async def start(self, prompts: list[list[int]], params: list[list[SamplingParams]]) -> None:
        """Queue every choice of every prompt; raises (having aborted all) if any is refused."""
        total = sum(len(p) for p in params)
        if total > self.engine.max_in_flight:
            raise InvalidRequest(
                f"{total} generations (prompts x n) can never fit this server's "
                f"{self.engine.max_in_flight} slots (--max-num-seqs + --max-queue)"
            )
        if self.engine.num_in_flight + total > self.engine.max_in_flight:
            raise QueueFull(self.engine.num_in_flight, self.engine.max_in_flight)
        for token_ids, choice_params in zip(prompts, params, strict=True):
            first = len(self.streams)
            self._firsts.append(first)
            self.streams += self.engine.add(token_ids, choice_params, self.outbox, first)
            self.prompt_lens += [len(token_ids)] * len(choice_params)
        self.num_tokens = [0] * total
        self.num_cached = [0] * total
        self._recorded = [False] * total
        self._remaining = total
        if self._deltas is not None:
            self._deltas = [[] for _ in range(total)]
        try:
            await asyncio.gather(*(s.started() for s in self.streams))
        except BaseException:
            for stream in self.streams:  # refused: nothing ran, so nothing to count
                stream.close()
            self._recorded = [True] * total
            raise

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    async def next(self) -> list[tuple[int, RequestOutput]]:
        """The choices that advanced since the last call, each once with its new delta (several
        steps' deltas merged when the caller fell behind). Raises a choice's error."""
        batch = await self.outbox.take()
        for index, item in batch:
            if isinstance(item, RequestFailed):  # this choice alone failed: counted as such
                self._remaining -= 1
                self._record(index, "error", produced=self.num_tokens[index] > 0)
            if isinstance(item, BaseException):
                raise item
            self.num_tokens[index] += len(item.token_ids)
            self.num_cached[index] = item.num_cached_tokens
            if self._deltas is not None:
                self._deltas[index].append(item)
            if item.finished:
                self._remaining -= 1
                self._record(index, item.finish_reason or "abort", produced=True)
        return batch  # type: ignore[return-value]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache, each prompt counted once (as usage counts
        prompt tokens): its first choice's."""
        return sum(self.num_cached[first] for first in self._firsts)

    async def results(self) -> list[RequestOutput]:
        """Wait for every choice to finish; their whole outputs, in choice order."""
        assert self._deltas is not None, "results() needs Generation(keep_outputs=True)"
        try:
            while not self.finished:
                await self.next()
        finally:
            self.close()
        return [merge_deltas(deltas) for deltas in self._deltas]

    def close(self) -> None:
        """Abort the choices that have not finished (and count them as aborted)."""
        for index, stream in enumerate(self.streams):
            if not self._recorded[index]:
                stream.close()
                self._record(index, "abort", produced=self.num_tokens[index] > 0)

    def _record(self, index: int, reason: str, produced: bool) -> None:
        self._recorded[index] = True
        prompt_len = self.prompt_lens[index] if produced else None
        self.metrics.record(reason, self.streams[index].times, prompt_len, self.num_tokens[index])
