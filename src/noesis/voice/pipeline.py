"""Actors and their wiring: typed ports checked before anything runs, bounded queues, barge-in.

An actor declares the message types it accepts (`inputs`) and emits (`outputs`). A Pipeline links
output ports to input ports, one bounded asyncio queue per receiving actor, so a slow stage holds
back the ones before it. Control messages (BargeIn) skip the queues: they reach their targets at
once and drop the queued messages of the turn they cancel. Blocking work (recognition, generation,
synthesis) runs on the actor's own thread, whose torch intra-op thread count is the actor's budget.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, ClassVar

from noesis.errors import NoesisError
from noesis.voice.messages import (
    BargeIn,
    Control,
    TurnTiming,
)

DEFAULT_QUEUE_SIZE = 4
THREADSAFE_POLL_S = 0.05  # how often a worker thread blocked on a full queue checks for shutdown


class WiringError(NoesisError, ValueError):
    """The actors do not fit together: a type mismatch, an unknown actor or an unconnected port."""


class PortError(NoesisError, TypeError):
    """An actor emitted a message type it did not declare as an output."""


class PipelineClosed(NoesisError, RuntimeError):
    """The pipeline shut down while a worker thread was still emitting."""


class Actor:
    """One stage. Subclasses set `inputs`/`outputs` and implement `handle` (or `produce` for a
    source, an actor with no inputs). `control` must return quickly: it runs on the event loop."""

    inputs: ClassVar[tuple[type, ...]] = ()
    outputs: ClassVar[tuple[type, ...]] = ()

    def __init__(self, name: str, threads: int = 1) -> None:
        if threads < 1:
            raise WiringError(f"actor {name!r}: threads must be >= 1, got {threads}")
        self.name = name
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None

    async def handle(self, message: Any, ctx: Context) -> None:
        raise NotImplementedError(f"{type(self).__name__} accepts messages but has no handle()")

    async def produce(self, ctx: Context) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a source but has no produce()")

    def control(self, message: Control) -> None:
        """React at once to a control message (stop playback, abort a request)."""

    async def blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on this actor's thread, under its intra-op thread budget."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1,
                thread_name_prefix=f"voice-{self.name}",
                initializer=_budget_threads,
                initargs=(self.threads,),
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _budget_threads(threads: int) -> None:
    """Pin this worker thread's torch (OpenMP) intra-op pool. The count is per thread: touch a
    parallel op first so torch's lazy per-thread init cannot later overwrite it."""
    import torch

    torch.ones(1 << 16).sum()
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Link:
    source: str
    message: type
    target: str

    def __str__(self) -> str:
        return f"{self.source} --{self.message.__name__}--> {self.target}"


def auto_links(actors: Iterable[Actor]) -> list[Link]:
    """Link every output type to every actor that accepts it."""
    actors = list(actors)
    return [
        Link(source.name, kind, target.name)
        for source in actors
        for kind in source.outputs
        for target in actors
        if kind in target.inputs and target is not source
    ]


def check_wiring(actors: dict[str, Actor], links: list[Link]) -> None:
    """Raise WiringError on an unknown actor, a type the source does not emit or the target does
    not accept, and on any output or input port left unconnected."""
    problems = []
    for link in links:
        source, target = actors.get(link.source), actors.get(link.target)
        if source is None or target is None:
            missing = link.source if source is None else link.target
            problems.append(f"{link}: no actor named {missing!r}")
            continue
        if link.message not in source.outputs:
            problems.append(f"{link}: type mismatch, {source.name} emits {_names(source.outputs)}")
        if link.message not in target.inputs:
            problems.append(f"{link}: type mismatch, {target.name} accepts {_names(target.inputs)}")
    linked_out = {(link.source, link.message) for link in links}
    linked_in = {(link.target, link.message) for link in links}
    for actor in actors.values():
        for kind in actor.outputs:
            if (actor.name, kind) not in linked_out:
                problems.append(f"unconnected output port {actor.name}.{kind.__name__}")
        for kind in actor.inputs:
            if (actor.name, kind) not in linked_in:
                problems.append(f"unconnected input port {actor.name}.{kind.__name__}")
    if problems:
        raise WiringError("; ".join(problems))


def _turn_of(message: Any) -> int | None:
    """The turn a message belongs to; None for turn-free messages (microphone audio), which no
    barge-in may drop."""
    return getattr(message, "turn", None)


def _names(types: tuple[type, ...]) -> str:
    return "(" + ", ".join(t.__name__ for t in types) + ")" if types else "nothing"


@dataclass
class TurnState:
    """Which turn the conversation is in, shared by the actors."""

    next_turn: int = 0
    active: int | None = None  # the turn being answered, from its utterance to its last audio
    speaking: bool = False  # audio of the active turn is playing
    # Turns handed on at a pause, before the detector decided they ended: their answers are
    # prepared but not played until then (the event is set when decided or cancelled).
    undecided: dict[int, asyncio.Event] = field(default_factory=dict)

    def begin_turn(self) -> int:
        turn = self.next_turn
        self.next_turn += 1
        self.active = turn
        return turn

    def hold(self, turn: int) -> None:
        self.undecided[turn] = asyncio.Event()

    def decide(self, turn: int) -> None:
        """The turn's end is decided, or the turn is cancelled: its audio may go (or be dropped)."""
        held = self.undecided.pop(turn, None)
        if held is not None:
            held.set()

    async def decided(self, turn: int) -> None:
        held = self.undecided.get(turn)
        if held is not None:
            await held.wait()


@dataclass
class StageStats:
    """Seconds spent in one actor's handle(), for the dashboard."""

    recent: deque = field(default_factory=lambda: deque(maxlen=50))
    count: int = 0
    busy_since: float | None = None

    def record(self, seconds: float) -> None:
        self.count += 1
        self.recent.append(seconds)

    @property
    def median(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    @property
    def last(self) -> float | None:
        return self.recent[-1] if self.recent else None


class Context:
    """What an actor may do: emit its declared messages, mark turn stages, end a turn."""

    def __init__(self, pipeline: Pipeline, actor: Actor) -> None:
        self.pipeline = pipeline
        self.actor = actor
        self.state = pipeline.state

    async def emit(self, message: Any) -> None:
        kind = type(message)
        if kind not in self.actor.outputs:
            raise PortError(
                f"{self.actor.name} emitted {kind.__name__}, not among its outputs "
                f"{_names(self.actor.outputs)}"
            )
        if isinstance(message, Control):
            self.pipeline._control(self.actor, message)
            return
        await self.pipeline._deliver(self.actor, message)

    def emit_threadsafe(self, message: Any, loop: asyncio.AbstractEventLoop) -> None:
        """emit() from a worker thread; blocks while the receiving queue is full."""
        future = asyncio.run_coroutine_threadsafe(self.emit(message), loop)
        while True:
            try:
                return future.result(THREADSAFE_POLL_S)
            except FutureTimeout:  # distinct from the builtin TimeoutError before Python 3.11
                if self.pipeline.closing:
                    future.cancel()
                    raise PipelineClosed("pipeline closed while emitting") from None

    def mark(self, turn: int, stage: str, at: float | None = None, first: bool = True) -> None:
        self.pipeline.mark(turn, stage, at, first)

    def cancelled(self, turn: int) -> bool:
        return turn in self.pipeline.cancelled

    def reached(self, turn: int, stage: str) -> bool:
        """Whether `stage` of `turn` has been marked."""
        return stage in self.pipeline._marks.get(turn, {})

    def finish_turn(self, turn: int) -> None:
        self.pipeline._finish_turn(turn)


class Pipeline:
    """Checked wiring of actors; `run()` drives them until the sources are done and every queue
    is empty, or `max_turns` turns have finished, or `stop()`."""

    def __init__(
        self,
        actors: Iterable[Actor],
        links: Iterable[Link] | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        actors = list(actors)
        self.actors: dict[str, Actor] = {}
        for actor in actors:
            if actor.name in self.actors:
                raise WiringError(f"two actors are named {actor.name!r}")
            self.actors[actor.name] = actor
        if queue_size < 1:
            raise WiringError(f"queue_size must be >= 1, got {queue_size}")
        self.links = auto_links(actors) if links is None else list(links)
        check_wiring(self.actors, self.links)
        self.routes: dict[tuple[str, type], list[str]] = defaultdict(list)
        for link in self.links:
            self.routes[(link.source, link.message)].append(link.target)
        self.queue_size = queue_size
        self.state = TurnState()
        self.stats = {name: StageStats() for name in self.actors}
        self.cancelled: set[int] = set()
        self.closing = False
        self._marks: dict[int, dict[str, float]] = defaultdict(dict)
        self._finished_turns: list[int] = []
        self._max_turns: int | None = None
        self._inboxes: dict[str, asyncio.Queue] = {}
        self._pending = 0
        self._sources_running = 0
        self._done: asyncio.Event | None = None

    # ------------------------------------------------------------ running

    async def run(self, max_turns: int | None = None) -> list[TurnTiming]:
        """Run every actor; re-raises the first actor failure. Returns the timings of all turns."""
        self._max_turns = max_turns
        self._done = asyncio.Event()
        self._inboxes = {
            name: asyncio.Queue(self.queue_size) for name, a in self.actors.items() if a.inputs
        }
        sources = [a for a in self.actors.values() if not a.inputs]
        self._sources_running = len(sources)
        tasks = [asyncio.create_task(self._source(a), name=a.name) for a in sources]
        tasks += [
            asyncio.create_task(self._serve(a), name=a.name)
            for a in self.actors.values()
            if a.inputs
        ]
        if not sources:
            self._check_done()
        done_waiter = asyncio.create_task(self._done.wait())
        try:
            await self._wait(done_waiter, tasks)
        finally:
            self.closing = True
            for task in [done_waiter, *tasks]:
                task.cancel()
            await asyncio.gather(done_waiter, *tasks, return_exceptions=True)
            for actor in self.actors.values():
                actor.close()
        return self.timings()

    @staticmethod
    async def _wait(done_waiter: asyncio.Task, tasks: list[asyncio.Task]) -> None:
        """Until the pipeline is done; the first actor failure is raised."""
        waiting = {done_waiter, *tasks}
        while not done_waiter.done():
            finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                if task is not done_waiter and task.exception() is not None:
                    raise task.exception()

    def stop(self) -> None:
        if self._done is not None:
            self._done.set()

    async def _source(self, actor: Actor) -> None:
        try:
            await actor.produce(Context(self, actor))
        finally:
            self._sources_running -= 1
            self._check_done()

    async def _serve(self, actor: Actor) -> None:
        inbox, ctx, stats = self._inboxes[actor.name], Context(self, actor), self.stats[actor.name]
        while True:
            message = await inbox.get()
            try:
                if _turn_of(message) in self.cancelled:
                    continue
                stats.busy_since = start = time.monotonic()
                await actor.handle(message, ctx)
                stats.record(time.monotonic() - start)
            finally:
                stats.busy_since = None
                self._pending -= 1
                self._check_done()

    async def _deliver(self, source: Actor, message: Any) -> None:
        for target in self.routes[(source.name, type(message))]:
            if _turn_of(message) in self.cancelled:
                return
            self._pending += 1
            await self._inboxes[target].put(message)

    def _control(self, source: Actor, message: Control) -> None:
        if isinstance(message, BargeIn):
            self._cancel_turn(message.turn, message.at)
        for target in self.routes[(source.name, type(message))]:
            self.actors[target].control(message)

    def _cancel_turn(self, turn: int, at: float) -> None:
        """Mark the turn cancelled and drop its queued messages from every inbox."""
        self.cancelled.add(turn)
        self.mark(turn, "barge_in", at)
        self.state.decide(turn)  # a player holding its audio lets go (and drops it)
        if self.state.active == turn:
            self.state.active = None
            self.state.speaking = False
        for inbox in self._inboxes.values():
            kept = []
            while not inbox.empty():
                message = inbox.get_nowait()
                if _turn_of(message) in self.cancelled:
                    self._pending -= 1
                else:
                    kept.append(message)
            for message in kept:
                inbox.put_nowait(message)
        self._check_done()

    def _finish_turn(self, turn: int) -> None:
        if self.state.active == turn:
            self.state.active = None
            self.state.speaking = False
        self._finished_turns.append(turn)
        if self._max_turns is not None and len(self._finished_turns) >= self._max_turns:
            self.stop()

    def _check_done(self) -> None:
        if self._done is not None and self._sources_running == 0 and self._pending == 0:
            self._done.set()

    # ------------------------------------------------------------ timings

    def mark(self, turn: int, stage: str, at: float | None = None, first: bool = True) -> None:
        """Record when `stage` of `turn` happened (default: now); `first` keeps an earlier mark."""
        marks = self._marks[turn]
        if first and stage in marks:
            return
        marks[stage] = time.monotonic() if at is None else at

    def timings(self) -> list[TurnTiming]:
        return [
            TurnTiming(
                turn, tuple(sorted(marks.items(), key=lambda kv: kv[1])), turn in self.cancelled
            )
            for turn, marks in sorted(self._marks.items())
        ]
