"""Request bodies parsed where they cannot stall the streams in flight.

Decoding, counting the nesting of and `json.loads`-ing a body of megabytes are C calls that hold
the GIL for tens of milliseconds each (a 15 MB prompt: ~10 ms of UTF-8 decoding, ~10 of depth
counting, ~20 of parsing), and a worker thread holding the GIL stalls the event loop that writes
every stream's tokens just the same. So: a small body is parsed right here, a mid-sized one on a
thread (its C calls are short), and one over PROCESS_BYTES in a worker process, which hands back
the validated request (or raises its APIError) for the cost of one copy.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor

from noesis.engine.children import become_child
from noesis.server.config import RequestLimits
from noesis.server.protocol import parse_body

INLINE_BYTES = 8192  # a thread hop costs more than parsing this
PROCESS_BYTES = 1 << 20


WORKER_NICENESS = 10  # below the server: streams in flight get the cores first


def _start_worker(parent: int) -> None:
    """In the worker process: name it, tie it to the server, and lower its priority. On a
    machine with few cores, parsing a 15 MB body takes a core for ~40 ms; at the server's own
    priority that slice comes out of the engine's steps, at a lower one out of idle time."""
    become_child("noesis-bodies", parent)
    os.nice(WORKER_NICENESS)


class BodyParser:
    """Parses request bodies by size: here, on a thread, or in one worker process (started with
    the server by `warm`, reused, gone with this process)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def parse(self, body: bytes | bytearray, model: type, limits: RequestLimits):
        """The validated request; raises the APIError (400) that names what is wrong."""
        if len(body) <= INLINE_BYTES:
            return parse_body(body, model, limits)
        if len(body) <= PROCESS_BYTES:
            return await asyncio.to_thread(parse_body, body, model, limits)
        loop = asyncio.get_running_loop()
        parse = functools.partial(parse_body, body, model, limits)
        return await loop.run_in_executor(self._worker(), parse)

    def warm(self) -> None:
        """Start the worker now (in the background), so that the first large body does not
        wait for a process to start."""
        self._worker().submit(int)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _worker(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(os.getpid(),),
                )
            return self._pool
