"""Periodic engine stats in the server log: one line every `--stats-interval` seconds while there is
work (throughput over the interval, batch and queue, KV use, prefix-cache hit rate)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from noesis.engine.async_engine import AsyncEngine
    from noesis.engine.stats import EngineStats

log = logging.getLogger("noesis.server")


class StatsLog:
    def __init__(self, engine: AsyncEngine, interval_s: float) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._last: EngineStats | None = None
        self._last_time = 0.0

    async def run(self) -> None:
        """Log a line every interval until cancelled."""
        self.line(self.engine.stats(), time.monotonic())  # the baseline
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line(self.engine.stats(), time.monotonic())
            if text is not None:
                log.info("%s", text)

    def line(self, stats: EngineStats, now: float) -> str | None:
        """The line for the interval ending now (None when the engine did nothing and holds
        nothing: an idle server stays quiet); the first call only sets the baseline."""
        last, elapsed = self._last, now - self._last_time
        self._last, self._last_time = stats, now
        if last is None or elapsed <= 0:
            return None
        prompt = stats.prompt_tokens - last.prompt_tokens
        generated = stats.generation_tokens - last.generation_tokens
        if not (prompt or generated or stats.running or stats.waiting):
            return None
        return format_stats(stats, prompt / elapsed, generated / elapsed)


def format_stats(stats: EngineStats, prompt_per_s: float, generation_per_s: float) -> str:
    kv = 100 * stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
    queries = stats.prefix_query_tokens
    hits = f"{100 * stats.prefix_hit_tokens / queries:.1f}%" if queries else "-"
    return (
        f"engine: prompt {prompt_per_s:.1f} tok/s, generation {generation_per_s:.1f} tok/s, "
        f"running {stats.running}, waiting {stats.waiting}, KV {kv:.1f}% used, "
        f"prefix cache hits {hits} of prompt tokens"
    )
