"""Expert pool: memory-mapped safetensors experts, chunked prefetch, LRU under a byte budget, and
streaming an expert's spoken (final-channel) answer through the tool loop (noesis.session).

Residency is measured with `mincore(2)` (through ctypes) on the pool's own read-only mapping of
each file: the fraction of the file's pages in the page cache. The budget counts what a loaded
expert holds in memory, as its `measure` function reports (weights plus KV pool for noesis.LLM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from noesis.errors import ConfigError, NoesisError
from noesis.weights.files import regular_file_size

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_CHUNK_BYTES = 4 * 2**20
BLOCKED = "content_filter"  # the finish reason of an answer the safety sidecar ended
BLOCKED_SPEECH = " Sorry, I can't help with that."  # said after what was already spoken


class UnknownExpert(NoesisError, KeyError):
    """The pool has no expert of that name."""


class ExpertTooLarge(NoesisError, ValueError):
    """One expert alone needs more memory than the pool's budget."""


# ---------------------------------------------------------------- one mapped file


class MappedFile:
    """A read-only mmap of one file: chunked WILLNEED prefetch, page touching, mincore residency."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = regular_file_size(path)  # a pipe or a device would block or never end
        with open(path, "rb") as handle:
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(self.map, dtype=np.uint8)
        self.address = view.ctypes.data  # valid while the map is open
        del view  # an exported buffer would keep the map from closing

    def advise(self, chunk_bytes: int) -> int:
        """madvise(MADV_WILLNEED) chunk by chunk (one call over the whole file reads ahead only a
        few MB); returns the number of calls. The kernel reads in the background."""
        chunk = max(PAGE_SIZE, chunk_bytes // PAGE_SIZE * PAGE_SIZE)
        calls = 0
        for offset in range(0, self.size, chunk):
            self.map.madvise(mmap.MADV_WILLNEED, offset, min(chunk, self.size - offset))
            calls += 1
        return calls

    def touch(self) -> int:
        """Fault in every page by reading one byte of each; returns a checksum so it is not
        optimized away."""
        view = np.frombuffer(self.map, dtype=np.uint8)
        try:
            return int(view[::PAGE_SIZE].sum())
        finally:
            del view

    def resident_fraction(self) -> float:
        pages = -(-self.size // PAGE_SIZE)
        if pages == 0:
            return 1.0
        vector = (ctypes.c_ubyte * pages)()
        if _libc().mincore(ctypes.c_void_p(self.address), ctypes.c_size_t(self.size), vector):
            raise OSError(ctypes.get_errno(), f"mincore failed on {self.path}")
        return sum(v & 1 for v in vector) / pages

    def drop_from_page_cache(self) -> None:
        """Ask the kernel to forget this file's cached pages (a cold start, for measurements)."""
        self.map.madvise(mmap.MADV_DONTNEED)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


# ---------------------------------------------------------------- the pool


@dataclass(frozen=True)
class ExpertSpec:
    name: str
    path: Path  # a checkpoint directory with *.safetensors, or one .safetensors file

    @property
    def files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"expert {self.name!r}: no *.safetensors in {self.path}")
        return files


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetch_seconds: list[float] = field(default_factory=list)  # until fully resident
    advise_seconds: list[float] = field(default_factory=list)  # the madvise calls alone
    load_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def summary(self) -> dict[str, Any]:
        def median(values: list[float]) -> float | None:
            return round(statistics.median(values), 4) if values else None

        return {
            "hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
            "evictions": self.evictions, "prefetches": len(self.prefetch_seconds),
            "prefetch_s_median": median(self.prefetch_seconds),
            "prefetch_s_max": max(self.prefetch_seconds, default=None),
            "advise_s_median": median(self.advise_seconds),
            "load_s_median": median(self.load_seconds),
        }


@dataclass
class _Loaded:
    value: Any
    device: str
    nbytes: int


class ExpertPool:
    """Experts by name. `prefetch` warms an expert's files; `acquire` returns it loaded (a hit
    when already loaded on that device), evicting least recently used experts to stay within
    `budget_bytes`. Thread-safe: the router prefetches while the answer stage acquires."""

    def __init__(
        self,
        specs: list[ExpertSpec],
        budget_bytes: int,
        load: Callable[[ExpertSpec, str], Any],
        measure: Callable[[Any], int],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        wait_resident_s: float = 2.0,
    ) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.budget_bytes = budget_bytes
        self.load, self.measure = load, measure
        self.chunk_bytes = chunk_bytes
        self.wait_resident_s = wait_resident_s  # how long prefetch waits to time the read-in
        self.stats = PoolStats()
        self._maps: dict[str, list[MappedFile]] = {}
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()

    def spec(self, name: str) -> ExpertSpec:
        if name not in self.specs:
            raise UnknownExpert(f"no expert named {name!r} (experts: {sorted(self.specs)})")
        return self.specs[name]

    def mapped(self, name: str) -> list[MappedFile]:
        with self._lock:
            if name not in self._maps:
                self._maps[name] = [MappedFile(path) for path in self.spec(name).files]
            return self._maps[name]

    def prefetch(self, name: str, touch: bool = False) -> float:
        """Read an expert's files into the page cache ahead of use: chunked MADV_WILLNEED (or,
        with `touch`, faulting every page in). Returns seconds until resident (or until
        `wait_resident_s`), which the stats keep."""
        files = self.mapped(name)
        start = time.perf_counter()
        for mapped in files:
            mapped.touch() if touch else mapped.advise(self.chunk_bytes)
        self.stats.advise_seconds.append(time.perf_counter() - start)
        while self.residency(name) < 1.0 and time.perf_counter() - start < self.wait_resident_s:
            time.sleep(0.002)
        seconds = time.perf_counter() - start
        self.stats.prefetch_seconds.append(seconds)
        return seconds

    def residency(self, name: str) -> float:
        """Fraction of the expert's file pages in the page cache (mincore)."""
        files = self.mapped(name)
        total = sum(f.size for f in files)
        return sum(f.resident_fraction() * f.size for f in files) / total if total else 1.0

    def acquire(self, name: str, device: str) -> Any:
        with self._lock:
            loaded = self._loaded.get(name)
            if loaded is not None and loaded.device == device:
                self._loaded.move_to_end(name)
                self.stats.hits += 1
                return loaded.value
            self.stats.misses += 1
            if loaded is not None:
                self._evict(name)
            start = time.perf_counter()
            value = self.load(self.spec(name), device)
            self.stats.load_seconds.append(time.perf_counter() - start)
            nbytes = self.measure(value)
            if nbytes > self.budget_bytes:
                raise ExpertTooLarge(
                    f"expert {name!r} needs {nbytes} bytes, over the pool budget of "
                    f"{self.budget_bytes}; raise pool.memory_budget_bytes"
                )
            while self._loaded and self.used_bytes + nbytes > self.budget_bytes:
                self._evict(next(iter(self._loaded)))
            self._loaded[name] = _Loaded(value, device, nbytes)
            return value

    def is_loaded(self, name: str, device: str) -> bool:
        loaded = self._loaded.get(name)
        return loaded is not None and loaded.device == device

    @property
    def used_bytes(self) -> int:
        return sum(loaded.nbytes for loaded in self._loaded.values())

    def loaded_names(self) -> list[str]:
        """Least recently used first."""
        return list(self._loaded)

    def sidecar_stats(self) -> dict[str, dict]:
        """Per loaded expert running sidecars: each sidecar's windows, drops and latency."""
        with self._lock:
            runtimes = {name: getattr(getattr(loaded.value, "engine", None), "sidecars", None)
                        for name, loaded in self._loaded.items()}  # fmt: skip
        return {name: runtime.stats() for name, runtime in runtimes.items() if runtime}

    def _evict(self, name: str) -> None:
        self._loaded.pop(name)
        self.stats.evictions += 1

    def close(self) -> None:
        with self._lock:
            self._loaded.clear()
            for files in self._maps.values():
                for mapped in files:
                    mapped.close()
            self._maps.clear()


# ---------------------------------------------------------------- noesis.LLM experts


def llm_loader(
    dtype: str, max_model_len: int, draft: Path | None = None, telemetry: str | None = None,
    sidecars: Any = None,
) -> Callable[[ExpertSpec, str], Any]:
    """Load an expert through noesis.LLM, with a KV pool sized for one conversation and prefix
    caching on: every turn starts with the same system and tool declarations (hundreds of
    tokens, warmed once by `warm_prefix`), and each tool round's request repeats the turn so far.
    On two CPU cores re-reading them cost 0.25 s before the first token and again after the
    tool's result. With `draft` (a checkpoint sharing the experts' tokenizer), every other expert
    decodes speculatively with it: the same greedy text, fewer target forwards. With
    `telemetry` (a path), each expert's engine writes its own telemetry file beside it,
    expert_telemetry_path's. `sidecars` (a noesis.sidecars.config.SidecarsConfig) run beside
    each expert's decoding, its own runtime per engine."""

    def load(spec: ExpertSpec, device: str):
        from noesis.llm import LLM
        from noesis.speculative.config import SpeculativeConfig

        speculative = None
        if draft is not None and spec.path != draft:
            speculative = SpeculativeConfig("draft", draft=str(draft))
        engine_telemetry = expert_telemetry_path(telemetry, spec.name) if telemetry else False
        return LLM(
            str(spec.path), device=device, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=2, progress=False, enable_prefix_caching=True, speculative=speculative,
            telemetry=engine_telemetry, sidecars=sidecars,
        )

    return load


def expert_telemetry_path(path: str, expert: str) -> str:
    """One expert's telemetry file: `path` with the expert's name before its suffix
    (voice.jsonl -> voice.noesis-tiny.jsonl). Each engine writes its own file: several writing
    one file would interleave partial lines."""
    target = Path(path)
    return str(target.with_name(f"{target.stem}.{expert}{target.suffix}"))


def llm_bytes(llm) -> int:
    """Weights plus KV pool of a loaded noesis.LLM."""
    model = llm.engine.loaded.model
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    return weights + llm.engine.kv.nbytes


# ---------------------------------------------------------------- answering


@dataclass(frozen=True)
class AnswerSettings:
    max_tokens: int = 160
    temperature: float = 0.0
    max_tool_steps: int = 3
    system: str | None = None


def stream_answer(
    llm,
    messages: list[dict[str, Any]],
    tool_names: tuple[str, ...],
    settings: AnswerSettings,
    stop: threading.Event,
    on_first_token: Callable[[], None] = lambda: None,
) -> Iterator[str]:
    """Yield the final-channel text of the answer to the last user message as it is generated,
    running the built-in tools the model calls in between (Session.stream). Only final-channel
    text is yielded; analysis and tool calls are not. Setting `stop` (or closing the iterator)
    aborts the request.

    Decoding is grounded, as `noesis chat` decodes: a well-formed turn, enum arguments from their
    values, the text a string tool works on and the country copied from the user's words (free,
    the model counted the letters of "stawberry"). The grammar costs no measurable time here."""
    from noesis.sampling.params import SamplingParams
    from noesis.session import Session
    from noesis.tools.builtin import builtin_tools

    tools = builtin_tools(tool_names)
    # No stop strings: the engine holds back the last characters of the text while they could
    # begin one, which would delay speech; a closed final message ends the turn instead.
    params = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens)
    system = [{"role": "developer", "content": settings.system}] if settings.system else []
    session = Session(llm, max_tool_rounds=settings.max_tool_steps - 1)
    events = session.stream(
        system + messages, tools, params=params, constrained=True, grounded=True
    )
    try:
        yield from _spoken(events, stop, on_first_token, stray_calls=not tool_names)
    finally:
        events.close()  # aborts the generation in flight


def warm_prefix(llm, tool_names: tuple[str, ...], settings: AnswerSettings) -> None:
    """Run a short turn with the tools a route declares, so that the prompt's shared beginning
    (system message, developer message with the tools) is in the prefix cache before the first
    real question of that route; its few tokens also run a draft's first proposals and their
    verification, when the expert decodes speculatively."""
    warm = replace(settings, max_tokens=4, max_tool_steps=1)
    for _ in stream_answer(llm, [{"role": "user", "content": "Hello"}], tool_names, warm,
                           threading.Event()):
        pass


def _spoken(
    events: Iterator[Any],
    stop: threading.Event,
    on_first_token: Callable[[], None],
    stray_calls: bool,
) -> Iterator[str]:
    """The final answer's text deltas, until it closes, `stop` is set, or the model calls a tool
    none was declared for."""
    from noesis.harmony.parser import ContentDelta, MessageEnd, MessageStart
    from noesis.session import AssistantTurn, Tokens

    first, in_final = True, False
    for event in events:
        if stop.is_set():
            return
        if isinstance(event, Tokens) and first:
            on_first_token()
            first = False
        elif isinstance(event, MessageStart):
            in_final = event.channel == "final" and not event.recipient
        elif isinstance(event, ContentDelta) and in_final:
            yield event.text
        elif isinstance(event, MessageEnd) and in_final:
            return  # answered; whatever the model runs on to is not wanted
        elif isinstance(event, AssistantTurn) and event.finish_reason == BLOCKED:
            yield BLOCKED_SPEECH  # the safety sidecar ended the answer: say so, not silence
            return
        elif isinstance(event, AssistantTurn) and event.tool_calls and stray_calls:
            return  # a call with no tools declared: nothing to run, nothing more to say


def answer_function(pool: ExpertPool, settings: AnswerSettings, tools_of: Callable[[str], tuple]):
    """What AnswerStage calls: acquire the routed expert, stream its spoken answer."""

    def answer(decision, history, stop, on_first_token):
        llm = pool.acquire(decision.expert, decision.device)
        messages = history + [{"role": "user", "content": decision.text}]
        return stream_answer(llm, messages, tools_of(decision.task), settings, stop, on_first_token)

    return answer
