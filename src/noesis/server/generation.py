"""Generation: one API call in flight: its engine requests (prompts x n choices), merged in order.

It adds all choices at once (all or nothing), merges their outputs into one stream of
(choice index, output), records each choice's metrics when it ends, and aborts whatever is
unfinished when it is closed early (client gone, error, shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from noesis.engine.async_engine import AsyncEngine, QueueFull, RequestStream
from noesis.engine.outputs import RequestOutput
from noesis.errors import InvalidRequest
from noesis.sampling.params import SamplingParams
from noesis.server.metrics import Metrics


class Generation:
    def __init__(self, engine: AsyncEngine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.streams: list[RequestStream] = []
        self.last: list[RequestOutput | None] = []
        self._recorded: list[bool] = []

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
            self.streams += self.engine.add(token_ids, choice_params)
        self.last = [None] * len(self.streams)
        self._recorded = [False] * len(self.streams)
        try:
            await asyncio.gather(*(s.started() for s in self.streams))
        except BaseException:
            for stream in self.streams:  # refused: nothing ran, so nothing to count
                self.engine.abort(stream.request_id)
            self._recorded = [True] * len(self.streams)
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, cumulative output) as choices advance, until all have finished."""
        merged: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, s, merged)) for i, s in enumerate(self.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                self.last[index] = item
                if item.finished:
                    remaining -= 1
                    self._record(index, item.finish_reason or "abort")
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    async def results(self) -> list[RequestOutput]:
        async for _ in self.outputs():
            pass
        return self.last  # type: ignore[return-value]

    def close(self) -> None:
        """Abort the choices that have not finished (and count them as aborted)."""
        for index, stream in enumerate(self.streams):
            if not self._recorded[index]:
                self.engine.abort(stream.request_id)
                self._record(index, "abort")

    def _record(self, index: int, reason: str) -> None:
        self._recorded[index] = True
        self.metrics.record(self.last[index], self.streams[index].times, reason)

    @staticmethod
    async def _pump(index: int, stream: RequestStream, merged: asyncio.Queue) -> None:
        try:
            async for out in stream:
                merged.put_nowait((index, out))
        except Exception as exc:
            merged.put_nowait((index, exc))
