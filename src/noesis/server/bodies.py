"""Request bodies parsed where they cannot stall the streams in flight.

Decoding, counting the nesting of and `json.loads`-ing a body of megabytes are C calls that hold
the GIL for tens of milliseconds each (a 15 MB prompt: ~10 ms of UTF-8 decoding, ~10 of depth
counting, ~20 of parsing), and a worker thread holding the GIL stalls the event loop that writes
every stream's tokens just the same. So: a small body is parsed right here, a mid-sized one on a
thread (its C calls are short), and one over PROCESS_BYTES in a worker process, which hands back
the validated request (or the refusal) for the cost of one copy.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from noesis.engine.children import become_child
from noesis.server.config import RequestLimits
from noesis.server.errors import APIError
from noesis.server.protocol import parse_body

INLINE_BYTES = 8192  # a thread hop costs more than parsing this
PROCESS_BYTES = 1 << 20


@dataclass(frozen=True)
class _Refusal:
    """An APIError as it crosses back from the worker (its __init__ does not match its args)."""

    status: int
    message: str
    param: str | None
    code: str | None

    def error(self) -> APIError:
        return APIError(self.status, self.message, self.param, self.code)


class BodyParser:
    """Parses request bodies by size: here, on a thread, or in one worker process (spawned on
    the first large body, reused, gone with this process)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def parse(self, body: bytes | bytearray, model: type, limits: RequestLimits):
        """The validated request; raises the APIError (400) that names what is wrong."""
        if len(body) <= INLINE_BYTES:
            return parse_body(bytes(body), model, limits)
        if len(body) <= PROCESS_BYTES:
            return await asyncio.to_thread(parse_body, bytes(body), model, limits)
        loop = asyncio.get_running_loop()
        parse = functools.partial(_parse_in_worker, body, model, limits)
        result = await loop.run_in_executor(self._worker(), parse)
        if isinstance(result, _Refusal):
            raise result.error()
        return result

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
                    initializer=become_child,
                    initargs=("noesis-bodies", os.getpid()),
                )
            return self._pool


def _parse_in_worker(body: bytearray, model: type, limits: RequestLimits):
    try:
        return parse_body(bytes(body), model, limits)
    except APIError as exc:
        return _Refusal(exc.status, exc.message, exc.param, exc.code)
