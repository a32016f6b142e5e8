"""Live terminal view of a running voice pipeline: per-actor latency, queue depth, the current
turn's stage times and the expert pool, redrawn in place with plain ANSI escapes."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from noesis.voice.messages import STAGES
from noesis.voice.pipeline import Pipeline

REFRESH_SECONDS = 0.25


def render(pipeline: Pipeline, pool_summary: dict | None = None) -> list[str]:
    """The dashboard as lines of text (no escapes), for any terminal or a log."""
    now = time.monotonic()
    lines = [f"{'actor':<10}{'thr':>4}{'queue':>7}{'done':>6}{'last ms':>9}{'med ms':>9}  state"]
    for name, actor in pipeline.actors.items():
        stats = pipeline.stats[name]
        inbox = pipeline._inboxes.get(name)
        queue = f"{inbox.qsize()}/{pipeline.queue_size}" if inbox is not None else "-"
        busy = stats.busy_since
        state = f"busy {1000 * (now - busy):.0f} ms" if busy is not None else "idle"
        lines.append(
            f"{name:<10}{actor.threads:>4}{queue:>7}{stats.count:>6}"
            f"{_ms(stats.last):>9}{_ms(stats.median):>9}  {state}"
        )
    lines += ["", _turn_line(pipeline)]
    if pool_summary:
        hit_rate = pool_summary.get("hit_rate")
        rate = "-" if hit_rate is None else f"{100 * hit_rate:.0f}%"
        lines.append(
            f"experts: hit rate {rate} ({pool_summary['hits']} hits, {pool_summary['misses']} "
            f"misses), prefetch median {_ms(pool_summary['prefetch_s_median'])} ms"
        )
    return lines


def _turn_line(pipeline: Pipeline) -> str:
    timings = pipeline.timings()
    if not timings:
        return "turn: waiting for speech"
    last = timings[-1]
    since = last.since_speech_end()
    parts = [f"{stage} {1000 * since[stage]:.0f}" for stage in STAGES[1:] if stage in since]
    state = " (barged in)" if last.barged_in else ""
    return f"turn {last.turn}{state}: ms after end of speech: " + (", ".join(parts) or "-")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


class Dashboard:
    """Redraws `render` every REFRESH_SECONDS while the pipeline runs."""

    def __init__(self, pipeline: Pipeline, pool=None, out: TextIO | None = None) -> None:
        self.pipeline = pipeline
        self.pool = pool
        self.out = out or sys.stderr
        self._drawn = 0

    async def run(self) -> None:
        # Not a terminal (a pipe, a log file): no redrawing, one table when the run ends.
        live = self.out.isatty()
        try:
            while True:
                if live:
                    self.draw()
                await asyncio.sleep(REFRESH_SECONDS)
        finally:  # the run ends by cancelling this task
            self.draw()

    def draw(self) -> None:
        summary = self.pool.stats.summary() if self.pool is not None else None
        lines = render(self.pipeline, summary)
        if not self.out.isatty():
            self.out.write("".join(f"{line}\n" for line in lines))
            self.out.flush()
            return
        up = f"\033[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "".join(f"\033[2K{line}\n" for line in lines))
        self.out.flush()
        self._drawn = len(lines)
