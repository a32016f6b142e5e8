"""The voice stages on the actor framework (noesis.voice.pipeline): audio source, voice
activity and turns, recognition, routing, answering, text chunks, synthesis and playback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from noesis.voice.messages import (
    AudioChunk,
    AudioOut,
    BargeIn,
    Control,
    RouteDecision,
    TextChunk,
    TokenDelta,
    UserTranscript,
    Utterance,
)
from noesis.voice.pipeline import Actor, Context, WiringError
from noesis.voice.protocols import (
    SpeechEnded,
    SpeechPaused,
    SpeechRecognizer,
    SpeechResumed,
    SpeechStarted,
    SpeechSynthesizer,
    VoiceActivityDetector,
)
from noesis.voice.spoken import speakable

# Speech resumed this soon after a turn's end, before its answer plays, continues that turn.
CONTINUATION_S = 1.5


class TextSplitter(Protocol):
    """Cuts streamed answer text into speakable pieces."""

    def feed(self, text: str) -> list[str]: ...

    def flush(self) -> list[str]: ...


class AudioSink(Protocol):
    """Where played audio goes: a speaker or a recording. `write` must not block for long."""

    sample_rate: int

    def write(self, block: np.ndarray) -> None: ...

    def stop(self) -> None: ...


class AudioSource(Actor):
    """Microphone blocks (or a file's, paced as if live) as AudioChunk messages."""

    outputs = (AudioChunk,)

    def __init__(
        self,
        name: str,
        blocks: Iterable[np.ndarray],
        sample_rate: int,
        paced: bool,
        threads: int = 1,
    ) -> None:
        super().__init__(name, threads)
        self.blocks = iter(blocks)
        self.sample_rate = sample_rate
        self.paced = paced  # file audio: release each block when it would have been captured

    async def produce(self, ctx: Context) -> None:
        start, fed = time.monotonic(), 0
        while True:
            block = await self.blocking(next, self.blocks, None)
            if block is None:
                return
            fed += len(block)
            if self.paced:
                await asyncio.sleep(max(0.0, start + fed / self.sample_rate - time.monotonic()))
            await ctx.emit(AudioChunk(block, self.sample_rate, time.monotonic()))


class VadStage(Actor):
    """Cuts utterances; user speech while a turn is active is a barge-in on that turn.

    Speech resumed within `continuation_s` of a turn's end, before any of its answer has played,
    continues that turn (a pause between sentences of one question): the pending answer is
    cancelled and the next utterance carries the earlier one (`Utterance.continues`), so the joined
    words are answered. Its timings count from the end of the last fragment. 0 turns it off.

    A detector with an early end (SpeechPaused) has the turn begin at the pause: it is recognized,
    routed and answered while the detector waits out the rest of the end-of-turn silence, and its
    audio plays only once the end is decided (`speech_end`, from which timings count). Speech
    that resumes first cancels it; the next pause hands on the whole utterance."""

    inputs = (AudioChunk,)
    outputs = (Utterance, BargeIn)

    def __init__(
        self,
        name: str,
        vad: VoiceActivityDetector,
        threads: int = 1,
        continuation_s: float = CONTINUATION_S,
    ) -> None:
        super().__init__(name, threads)
        self.vad = vad
        self.continuation_s = continuation_s
        self._last: tuple[int, np.ndarray, float] | None = None  # turn, its audio, speech end
        self._continues: tuple[int, np.ndarray] | None = None  # the turn the next one continues
        self._early: int | None = None  # the turn handed on at a pause, not yet decided

    async def handle(self, chunk: AudioChunk, ctx: Context) -> None:
        if chunk.sample_rate != self.vad.sample_rate:
            raise WiringError(
                f"{self.name}: audio at {chunk.sample_rate} Hz, the detector takes "
                f"{self.vad.sample_rate} Hz"
            )
        for event in await self.blocking(self.vad.feed, chunk.samples):
            now = time.monotonic()
            if isinstance(event, SpeechStarted) and ctx.state.active is not None:
                if self._continuable(ctx, now):
                    self._continues = self._last[:2]
                await ctx.emit(BargeIn(ctx.state.active, now))
            elif isinstance(event, SpeechPaused):
                self._early = await self._hand_on(event.audio, chunk.sample_rate, ctx, now)
                ctx.state.hold(self._early)
            elif isinstance(event, SpeechResumed) and self._early is not None:
                turn, self._early = self._early, None
                await ctx.emit(BargeIn(turn, now))  # not the end: the whole utterance comes next
            elif isinstance(event, SpeechEnded):
                turn, self._early = self._early, None
                if turn is None or ctx.cancelled(turn):
                    turn = await self._hand_on(event.audio, chunk.sample_rate, ctx, now, True)
                else:
                    ctx.mark(turn, "speech_end", now)
                    ctx.state.decide(turn)
                earlier = self._continues[1] if self._continues else None
                self._continues = None
                joined = event.audio if earlier is None else np.concatenate([earlier, event.audio])
                self._last = (turn, joined, now)

    async def _hand_on(
        self, audio: np.ndarray, rate: int, ctx: Context, now: float, ended: bool = False
    ) -> int:
        """Begin a turn with this utterance (`ended`: its end is decided) and send it on."""
        turn = ctx.state.begin_turn()
        if ended:
            ctx.mark(turn, "speech_end", now)
        continues, earlier = self._continues or (None, None)
        await ctx.emit(Utterance(turn, audio, rate, now, continues, earlier))
        return turn

    def _continuable(self, ctx: Context, now: float) -> bool:
        """Whether speech starting now continues the active turn rather than barging in."""
        if self._last is None or self.continuation_s <= 0:
            return False
        turn, _, speech_end = self._last
        return (
            turn == ctx.state.active
            and now - speech_end <= self.continuation_s
            and not ctx.reached(turn, "first_audio")
        )


class AsrStage(Actor):
    inputs = (Utterance,)
    outputs = (UserTranscript,)

    def __init__(self, name: str, recognizer: SpeechRecognizer, threads: int = 1) -> None:
        super().__init__(name, threads)
        self.recognizer = recognizer
        self.heard: dict[int, UserTranscript] = {}

    async def handle(self, utterance: Utterance, ctx: Context) -> None:
        audio, earlier = utterance.audio, None
        if utterance.continues is not None:
            earlier = self.heard.get(utterance.continues)
            if earlier is None and utterance.earlier_audio is not None:  # dropped before ASR
                audio = np.concatenate([utterance.earlier_audio, audio])
        heard = await self.blocking(self.recognizer.transcribe, audio, utterance.sample_rate)
        ctx.mark(utterance.turn, "asr_done")
        text = heard.text.strip()
        if earlier is not None:
            text = f"{earlier.text} {text}".strip()
        if not text:  # noise, not words: nothing to answer
            ctx.finish_turn(utterance.turn)
            return
        transcript = UserTranscript(utterance.turn, text, heard.seconds)
        self.heard[utterance.turn] = transcript
        await ctx.emit(transcript)


RouteResult = tuple[str, float, str, str]  # (task, confidence, expert, device)


class RouteStage(Actor):
    """Transcript -> expert (the route function also starts prefetching the expert's weights)."""

    inputs = (UserTranscript,)
    outputs = (RouteDecision,)

    def __init__(self, name: str, route: Callable[[str], RouteResult], threads: int = 1):
        super().__init__(name, threads)
        self.route = route
        self.decisions: dict[int, RouteDecision] = {}

    async def handle(self, transcript: UserTranscript, ctx: Context) -> None:
        decision = await self.blocking(self.route, transcript.text)
        ctx.mark(transcript.turn, "routed")
        self.decisions[transcript.turn] = RouteDecision(transcript.turn, transcript.text, *decision)
        await ctx.emit(self.decisions[transcript.turn])


class AnswerStage(Actor):
    """Runs the routed expert and streams final-channel text; a barge-in aborts the request.

    `answer(decision, history, should_stop, on_first_token)` yields text deltas from the worker
    thread; closing it must abort the generation (noesis.LLM.stream does)."""

    inputs = (RouteDecision, BargeIn)
    outputs = (TokenDelta,)

    def __init__(
        self,
        name: str,
        answer: Callable[..., Iterator[str]],
        threads: int = 1,
        history_turns: int = 3,
    ) -> None:
        super().__init__(name, threads)
        self.answer = answer
        self.history_turns = history_turns  # earlier exchanges the model sees: bounds the prompt
        self.history: list[dict[str, Any]] = []
        self.answers: dict[int, str] = {}  # what was generated (cut short by a barge-in)
        self._stops: dict[int, threading.Event] = {}

    async def handle(self, decision: RouteDecision, ctx: Context) -> None:
        loop = asyncio.get_running_loop()
        stop = self._stops.setdefault(decision.turn, threading.Event())
        if ctx.cancelled(decision.turn):
            stop.set()
        try:
            text = await self.blocking(self._generate, decision, ctx, loop, stop)
        finally:
            self._stops.pop(decision.turn, None)
        self.answers[decision.turn] = text
        if stop.is_set() or ctx.cancelled(decision.turn):
            return
        self.history += [
            {"role": "user", "content": decision.text},
            {"role": "assistant", "content": text},
        ]
        del self.history[: max(0, len(self.history) - 2 * self.history_turns)]
        await ctx.emit(TokenDelta(decision.turn, "", done=True))

    def _generate(self, decision, ctx: Context, loop, stop: threading.Event) -> str:
        """On the worker thread: stream deltas into the pipeline until done or stopped."""

        def first_token() -> None:
            loop.call_soon_threadsafe(ctx.mark, decision.turn, "first_token", time.monotonic())

        deltas = self.answer(decision, list(self.history), stop, first_token)
        text = []
        try:
            for delta in deltas:
                if stop.is_set():
                    break
                text.append(delta)
                ctx.emit_threadsafe(TokenDelta(decision.turn, delta), loop)
        finally:
            deltas.close()  # aborts the request when it is still running
        return "".join(text)

    def control(self, message: Control) -> None:
        if isinstance(message, BargeIn):
            self._stops.setdefault(message.turn, threading.Event()).set()


class ChunkStage(Actor):
    """Answer text -> speakable chunks, so speech starts after the first sentence."""

    inputs = (TokenDelta, BargeIn)
    outputs = (TextChunk,)

    def __init__(self, name: str, make_splitter: Callable[[], TextSplitter]) -> None:
        super().__init__(name)
        self.make_splitter = make_splitter
        self._open: dict[int, tuple[TextSplitter, int]] = {}  # turn -> (splitter, next index)

    async def handle(self, delta: TokenDelta, ctx: Context) -> None:
        splitter, index = self._open.get(delta.turn) or (self.make_splitter(), 0)
        now = time.monotonic()
        pieces = splitter.feed(delta.text) if delta.text else []
        if delta.done:
            pieces += splitter.flush()
            self._open.pop(delta.turn, None)
        else:
            self._open[delta.turn] = (splitter, index + len(pieces))
        for offset, piece in enumerate(pieces):
            last = delta.done and offset == len(pieces) - 1
            ctx.mark(delta.turn, "first_chunk", now)
            await ctx.emit(TextChunk(delta.turn, index + offset, piece, last, now))
        if delta.done and not pieces:  # nothing (more) to say: close the turn with silence
            await ctx.emit(TextChunk(delta.turn, index, "", True, now))

    def control(self, message: Control) -> None:
        if isinstance(message, BargeIn):
            self._open.pop(message.turn, None)  # its text will never be finished


class TtsStage(Actor):
    inputs = (TextChunk,)
    outputs = (AudioOut,)

    def __init__(self, name: str, synthesizer: SpeechSynthesizer, threads: int = 1) -> None:
        super().__init__(name, threads)
        self.synthesizer = synthesizer

    async def handle(self, chunk: TextChunk, ctx: Context) -> None:
        rate = self.synthesizer.sample_rate
        if chunk.text.strip():
            samples = await self.blocking(self.synthesizer.synthesize, speakable(chunk.text))
        else:
            samples = np.zeros(0, dtype=np.float32)
        if ctx.cancelled(chunk.turn):  # barged in while synthesizing: drop it
            return
        ctx.mark(chunk.turn, "first_audio_ready")
        await ctx.emit(AudioOut(chunk.turn, chunk.index, samples, rate, chunk.last, chunk.ready_at))


class PlayerStage(Actor):
    """Plays audio in short blocks at real-time pace, so a barge-in cuts it within one block."""

    inputs = (AudioOut, BargeIn)

    def __init__(
        self, name: str, sink: AudioSink, block_seconds: float = 0.02, lead_seconds: float = 0.06
    ) -> None:
        super().__init__(name)
        self.sink = sink
        self.block_seconds = block_seconds
        self.lead_seconds = lead_seconds  # how far ahead of the play clock blocks are written
        self.stopped_at: dict[int, float] = {}
        self._play_until = 0.0  # monotonic time when everything written so far has played

    async def handle(self, audio: AudioOut, ctx: Context) -> None:
        if audio.sample_rate != self.sink.sample_rate:
            raise WiringError(
                f"{self.name}: audio at {audio.sample_rate} Hz, "
                f"the sink plays {self.sink.sample_rate} Hz"
            )
        await ctx.state.decided(audio.turn)  # a turn handed on early plays once it has ended
        if ctx.cancelled(audio.turn):
            return
        ctx.state.speaking = True
        step = max(1, int(self.block_seconds * audio.sample_rate))
        for start in range(0, len(audio.samples), step):
            await asyncio.sleep(max(0.0, self._play_until - self.lead_seconds - time.monotonic()))
            if ctx.cancelled(audio.turn):
                return
            block = audio.samples[start : start + step]
            now = time.monotonic()
            self.sink.write(block)
            ctx.mark(audio.turn, "first_audio", now)
            if audio.index == 0 and start == 0:
                ctx.mark(audio.turn, "first_chunk_text_ready", audio.text_ready_at)
            self._play_until = max(self._play_until, now) + len(block) / audio.sample_rate
        if audio.last:
            await asyncio.sleep(max(0.0, self._play_until - time.monotonic()))
            if not ctx.cancelled(audio.turn):
                ctx.mark(audio.turn, "last_audio", first=False)
                ctx.finish_turn(audio.turn)

    def control(self, message: Control) -> None:
        if isinstance(message, BargeIn):
            self.sink.stop()
            self._play_until = 0.0
            self.stopped_at[message.turn] = time.monotonic()
