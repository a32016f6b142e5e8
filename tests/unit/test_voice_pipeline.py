"""Voice pipeline: wiring checks, a whole turn through fake stages, back-pressure, barge-in."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest

from noesis.voice.messages import (
    AudioChunk,
    AudioOut,
    TextChunk,
    TokenDelta,
    UserTranscript,
    Utterance,
)
from noesis.voice.pipeline import Actor, Link, Pipeline, PortError, WiringError
from noesis.voice.protocols import (
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    Transcript,
)
from noesis.voice.stages import (
    AnswerStage,
    AsrStage,
    AudioSource,
    ChunkStage,
    PlayerStage,
    RouteStage,
    TtsStage,
    VadStage,
)

RATE = 16000
BLOCK = 320  # 20 ms


# ---------------------------------------------------------------- fakes of the I/O seams


class EnergyVad:
    """Voiced = frame RMS above a threshold; start after 3 voiced frames, end after 8 silent;
    with `early`, a pause of that many silent frames hands the utterance on (SpeechPaused)."""

    sample_rate = RATE
    frame_samples = 160

    def __init__(self, early: int | None = None) -> None:
        self.early = early
        self.reset()

    def reset(self) -> None:
        self.voiced_run, self.silent_run, self.speaking, self.audio, self.fed = 0, 0, False, [], 0
        self.paused = False

    def feed(self, samples: np.ndarray) -> list:
        events = []
        for start in range(0, len(samples), self.frame_samples):
            frame = samples[start : start + self.frame_samples]
            self.fed += len(frame)
            voiced = float(np.sqrt(np.mean(frame**2))) > 0.05
            if self.speaking:
                self.audio.append(frame)
                self.silent_run = 0 if voiced else self.silent_run + 1
                if voiced and self.paused:
                    self.paused = False
                    events.append(SpeechResumed(self.fed / RATE))
                elif self.silent_run == self.early and not self.paused:
                    self.paused = True
                    events.append(SpeechPaused(self.fed / RATE, np.concatenate(self.audio)))
                if self.silent_run >= 8:
                    events.append(SpeechEnded(self.fed / RATE, np.concatenate(self.audio)))
                    self.speaking, self.audio, self.voiced_run = False, [], 0
                    self.paused = False
            else:
                self.voiced_run = self.voiced_run + 1 if voiced else 0
                if self.voiced_run >= 3:
                    self.speaking, self.silent_run = True, 0
                    events.append(SpeechStarted(self.fed / RATE))
        return events


class FakeAsr:
    name = "fake-asr"

    def __init__(self, text: str = "What is two plus three?") -> None:
        self.text = text
        self.heard: list[int] = []

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript:
        self.heard.append(len(audio))
        time.sleep(0.01)
        return Transcript(self.text, 0.01)


class FakeTts:
    """0.02 s of tone per character, the tone's pitch set by the chunk's first letter."""

    name = "fake-tts"
    sample_rate = RATE

    def synthesize(self, text: str) -> np.ndarray:
        time.sleep(0.005)
        t = np.arange(int(0.02 * RATE * len(text))) / RATE
        return (0.3 * np.sin(2 * np.pi * (200 + ord(text[0])) * t)).astype(np.float32)


class SentenceSplitter:
    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, text: str) -> list[str]:
        self.buffer += text
        pieces = []
        while ". " in self.buffer:
            head, self.buffer = self.buffer.split(". ", 1)
            pieces.append(head + ".")
        return pieces

    def flush(self) -> list[str]:
        rest, self.buffer = self.buffer.strip(), ""
        return [rest] if rest else []


class RecordingSink:
    sample_rate = RATE

    def __init__(self) -> None:
        self.blocks: list[tuple[float, np.ndarray]] = []
        self.stops: list[float] = []

    def write(self, block: np.ndarray) -> None:
        self.blocks.append((time.monotonic(), block))

    def stop(self) -> None:
        self.stops.append(time.monotonic())

    def audio(self) -> np.ndarray:
        return np.concatenate([b for _, b in self.blocks]) if self.blocks else np.zeros(0)


class FakeAnswer:
    """Streams `words` one per `delay` seconds, like LLM.stream; records whether it was cut.
    `later` are the words of the turns after the first."""

    def __init__(self, words: list[str], delay: float = 0.01, later: list[str] | None = None):
        self.words, self.delay, self.later = words, delay, later
        self.aborted = threading.Event()
        self.finished = threading.Event()
        self.histories: list[list[dict]] = []

    def __call__(self, decision, history, stop, first_token):
        self.histories.append(history)
        words = self.words if len(self.histories) == 1 or self.later is None else self.later
        done = False
        try:
            first_token()
            for word in words:
                time.sleep(self.delay)
                yield word
            done = True
        finally:
            (self.finished if done else self.aborted).set()


def tone(seconds: float, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def blocks_of(audio: np.ndarray):
    for start in range(0, len(audio), BLOCK):
        yield audio[start : start + BLOCK]


def route(text: str):
    return ("calculator", 0.9, "fake-expert", "cpu")


def voice_actors(source: Actor, answer: FakeAnswer, sink: RecordingSink, asr=None) -> list[Actor]:
    return [
        source,
        VadStage("vad", EnergyVad()),
        AsrStage("asr", asr or FakeAsr()),
        RouteStage("router", route),
        AnswerStage("llm", answer),
        ChunkStage("chunker", SentenceSplitter),
        TtsStage("tts", FakeTts()),
        PlayerStage("player", sink),
    ]


# ---------------------------------------------------------------- wiring


class Numbers(Actor):
    outputs = (TokenDelta,)

    def __init__(self, name: str, count: int = 3, emit=TokenDelta) -> None:
        super().__init__(name)
        self.count, self.kind = count, emit

    async def produce(self, ctx) -> None:
        for i in range(self.count):
            await ctx.emit(self.kind(i, str(i)))


class Collect(Actor):
    inputs = (TokenDelta,)

    def __init__(self, name: str, delay: float = 0.0) -> None:
        super().__init__(name)
        self.seen: list[str] = []
        self.delay = delay

    async def handle(self, message, ctx) -> None:
        await asyncio.sleep(self.delay)
        self.seen.append(message.text)


def test_wiring_type_mismatch_raises_before_running():
    with pytest.raises(WiringError, match="type mismatch.*tts accepts \\(TextChunk\\)"):
        Pipeline(
            [Numbers("numbers"), TtsStage("tts", FakeTts()), PlayerStage("p", RecordingSink())],
            [Link("numbers", TokenDelta, "tts"), Link("tts", AudioOut, "p")],
        )


def test_wiring_unconnected_ports_raise():
    with pytest.raises(WiringError, match="unconnected output port numbers.TokenDelta"):
        Pipeline([Numbers("numbers"), TtsStage("tts", FakeTts())], links=[])
    with pytest.raises(WiringError, match="unconnected input port tts.TextChunk"):
        Pipeline([TtsStage("tts", FakeTts()), PlayerStage("player", RecordingSink())])
    with pytest.raises(WiringError, match="no actor named 'nobody'"):
        Pipeline([Numbers("numbers"), Collect("c")], [Link("numbers", TokenDelta, "nobody")])
    with pytest.raises(WiringError, match="two actors are named"):
        Pipeline([Numbers("x"), Collect("x")])


def test_auto_wiring_of_the_voice_stages_is_complete():
    source = AudioSource("mic", [], RATE, paced=False)
    pipeline = Pipeline(voice_actors(source, FakeAnswer([]), RecordingSink()))
    links = {str(link) for link in pipeline.links}
    assert "vad --BargeIn--> llm" in links and "vad --BargeIn--> player" in links
    assert "vad --BargeIn--> chunker" in links
    assert "chunker --TextChunk--> tts" in links and len(links) == 10


def test_emitting_an_undeclared_type_fails_the_run():
    pipeline = Pipeline(
        [Numbers("numbers", emit=lambda i, t: TextChunk(i, i, t, False, 0.0)), Collect("c")]
    )
    with pytest.raises(PortError, match="numbers emitted TextChunk"):
        asyncio.run(pipeline.run())


def test_bounded_queues_hold_back_a_fast_producer():
    producer, consumer = Numbers("numbers", count=12), Collect("slow", delay=0.01)
    pipeline = Pipeline([producer, consumer], queue_size=2)
    sizes = []

    async def main():
        watcher = asyncio.create_task(watch())
        await pipeline.run()
        watcher.cancel()

    async def watch():
        while True:
            if pipeline._inboxes:
                sizes.append(pipeline._inboxes["slow"].qsize())
            await asyncio.sleep(0.002)

    asyncio.run(main())
    assert consumer.seen == [str(i) for i in range(12)]
    assert max(sizes) == 2  # the producer waited on the full queue instead of running ahead


def test_each_actor_thread_gets_its_own_torch_thread_budget():
    import torch

    async def main():
        one, two = Actor("one", threads=1), Actor("two", threads=2)
        try:
            return await one.blocking(torch.get_num_threads), await two.blocking(
                torch.get_num_threads
            )
        finally:
            one.close()
            two.close()

    assert asyncio.run(main()) == (1, 2)
    with pytest.raises(WiringError, match="threads must be >= 1"):
        Actor("zero", threads=0)


# ---------------------------------------------------------------- a whole turn


def test_one_turn_flows_from_speech_to_played_audio_in_stage_order():
    answer = FakeAnswer(["Two ", "plus three ", "is five. ", "That ", "is all."])
    sink, asr = RecordingSink(), FakeAsr()
    audio = np.concatenate([silence(0.2), tone(0.4), silence(0.4)])
    source = AudioSource("mic", blocks_of(audio), RATE, paced=False)
    timings = asyncio.run(Pipeline(voice_actors(source, answer, sink, asr)).run(max_turns=1))

    assert len(timings) == 1 and not timings[0].barged_in
    stages = [stage for stage, _ in timings[0].marks]
    assert stages[:4] == ["speech_end", "asr_done", "routed", "first_token"]
    assert stages[-3:] == ["first_audio_ready", "first_audio", "last_audio"]
    assert set(stages[4:6]) == {"first_chunk", "first_chunk_text_ready"}  # the same instant
    # The utterance holds the tone, not the silence around it.
    assert 0.35 * RATE < asr.heard[0] < 0.6 * RATE
    tts = FakeTts()
    expected = np.concatenate(
        [tts.synthesize("Two plus three is five."), tts.synthesize("That is all.")]
    )
    np.testing.assert_array_equal(sink.audio(), expected)
    assert answer.finished.is_set() and not answer.aborted.is_set()


def test_history_carries_finished_turns_into_the_next_answer():
    answer = FakeAnswer(["Five."])
    speech = np.concatenate([silence(0.1), tone(0.3), silence(0.3)])
    source = AudioSource(
        "mic", blocks_of(np.concatenate([speech, silence(1.0), speech])), RATE, paced=True
    )
    timings = asyncio.run(Pipeline(voice_actors(source, answer, RecordingSink())).run(max_turns=2))
    assert [t.turn for t in timings] == [0, 1]
    assert answer.histories[0] == []
    assert answer.histories[1] == [
        {"role": "user", "content": "What is two plus three?"},
        {"role": "assistant", "content": "Five."},
    ]


# ---------------------------------------------------------------- barge-in


class BargingMic(AudioSource):
    """A live microphone: one question, then speech 0.3 s after the assistant starts talking."""

    def __init__(self) -> None:
        super().__init__("mic", [], RATE, paced=True)
        self.barge_sent_at: float | None = None

    async def produce(self, ctx) -> None:
        question = np.concatenate([silence(0.1), tone(0.3), silence(0.3)])
        for block in blocks_of(question):
            await self._send(ctx, block)
        while not ctx.state.speaking:
            await self._send(ctx, silence(BLOCK / RATE))
        for _ in range(15):  # 0.3 s of the answer playing
            await self._send(ctx, silence(BLOCK / RATE))
        for block in blocks_of(np.concatenate([tone(0.3), silence(0.3)])):
            await self._send(ctx, block)

    async def _send(self, ctx, block) -> None:
        await asyncio.sleep(len(block) / RATE)
        await ctx.emit(AudioChunk(block, RATE, time.monotonic()))


def test_barge_in_stops_playback_within_150ms_and_aborts_the_request():
    # A long answer, streamed slowly, so generation is still running when the user barges in.
    # Each sentence is about 1 s of audio: most of one is still to play when the user speaks.
    sentences = [f"This is sentence number {i} of a long answer. " for i in range(200)]
    answer = FakeAnswer(sentences, 0.02, ["Yes."])
    sink = RecordingSink()
    pipeline = Pipeline(voice_actors(BargingMic(), answer, sink))
    timings = asyncio.run(pipeline.run())

    turn = timings[0]
    assert turn.barged_in
    barge_at = turn.at("barge_in")
    assert barge_at is not None and turn.at("first_audio") < barge_at
    next_answer_at = timings[1].at("first_audio") if len(timings) > 1 else float("inf")
    after = [t for t, _ in sink.blocks if barge_at < t < next_answer_at]
    assert not after or max(after) - barge_at <= 0.150, "audio kept playing after the barge-in"
    assert sink.stops and sink.stops[0] - barge_at <= 0.150
    assert answer.aborted.wait(1.0), "the generation was not aborted"
    assert turn.at("last_audio") is None
    # The speech that interrupted is itself a new turn, answered in full.
    assert [t.turn for t in timings] == [0, 1] and not timings[1].barged_in


# ---------------------------------------------------------------- app pieces and dashboard


def voice_args(*argv: str):
    import argparse

    from noesis.voice.app import add_voice_parser

    parser = argparse.ArgumentParser()
    add_voice_parser(parser.add_subparsers())
    return parser.parse_args(["voice", *argv])


def test_voice_command_checks_its_arguments(tmp_path):
    from noesis.errors import InvalidRequest
    from noesis.voice import app

    with pytest.raises(InvalidRequest, match="--in needs --out"):
        app.run(voice_args("--in", "q.wav"))
    with pytest.raises(InvalidRequest, match="no such file"):
        app.run(voice_args("--in", str(tmp_path / "missing.wav"), "--out", "a.wav"))
    with pytest.raises(InvalidRequest, match="--turns must be >= 1"):
        app.run(voice_args("--mic", "--turns", "0"))
    with pytest.raises(SystemExit):  # --in and --mic are exclusive
        voice_args("--in", "q.wav", "--mic")


def test_wav_source_resamples_to_the_detector_rate_and_ends_in_silence():
    from noesis.voice.app import TAIL_SILENCE_S, VAD_RATE, wav_source

    question = (0.3 * np.sin(np.arange(22050) / 22050 * 2 * np.pi * 300)).astype(np.float32)
    source = wav_source(question, 22050)
    blocks = list(source.blocks)
    audio = np.concatenate(blocks)
    assert source.sample_rate == VAD_RATE and source.paced
    assert abs(len(audio) - (VAD_RATE + TAIL_SILENCE_S * VAD_RATE)) <= 1
    assert np.abs(audio[-int(TAIL_SILENCE_S * VAD_RATE) :]).max() == 0.0
    assert 0.25 < np.abs(audio[: VAD_RATE // 2]).max() < 0.35


def test_dashboard_shows_every_actor_and_the_turn_stages():
    from noesis.voice.dashboard import render

    answer, sink = FakeAnswer(["Five."]), RecordingSink()
    audio = np.concatenate([silence(0.1), tone(0.3), silence(0.3)])
    pipeline = Pipeline(
        voice_actors(AudioSource("mic", blocks_of(audio), RATE, False), answer, sink)
    )
    asyncio.run(pipeline.run(max_turns=1))
    lines = render(pipeline, {"hit_rate": 0.5, "hits": 1, "misses": 1, "prefetch_s_median": 0.01})
    names = [line.split()[0] for line in lines[1:9]]
    assert names == ["mic", "vad", "asr", "router", "llm", "chunker", "tts", "player"]
    assert lines[-2].startswith("turn 0: ms after end of speech: asr_done")
    assert "first_audio" in lines[-2] and "hit rate 50%" in lines[-1]


def test_dashboard_into_a_pipe_prints_one_plain_table_at_the_end():
    import io

    from noesis.voice.dashboard import Dashboard

    answer, sink = FakeAnswer(["Five."]), RecordingSink()
    audio = np.concatenate([silence(0.1), tone(0.3), silence(0.3)])
    pipeline = Pipeline(
        voice_actors(AudioSource("mic", blocks_of(audio), RATE, False), answer, sink)
    )
    out = io.StringIO()  # not a terminal

    async def main():
        view = asyncio.ensure_future(Dashboard(pipeline, out=out).run())
        await pipeline.run(max_turns=1)
        view.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await view

    asyncio.run(main())
    text = out.getvalue()
    assert "\033" not in text and text.count("turn 0: ms after end of speech") == 1


def test_wav_question_to_wav_answer_with_the_real_models(tmp_path, whisper):
    """Whole `noesis voice --in --out` turn: Piper speaks a question, Whisper hears it, the
    router picks the calculator, the expert calls it, Piper speaks the answer, and Whisper hears
    the right number in the answer's audio."""
    import json

    from noesis.voice import app
    from noesis.voice.audio import read_wav, write_wav
    from noesis.voice.tts import PiperSynthesizer

    piper = PiperSynthesizer()
    write_wav(
        tmp_path / "q.wav",
        piper.synthesize("What is seventeen times twenty three?"),
        piper.sample_rate,
    )
    args = voice_args(
        "--in",
        str(tmp_path / "q.wav"),
        "--out",
        str(tmp_path / "a.wav"),
        "--report",
        str(tmp_path / "r.json"),
    )
    assert app.run(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    turn = report["turns"][0]
    assert turn["task"] == "calculator" and "391" in turn["answer"]
    stages = turn["seconds_after_speech_end"]
    # Early turns: ASR starts at the first pause, so it may finish before the end of speech is
    # decided (negative); the answer's audio is held until then (positive).
    assert stages["asr_done"] < stages["first_token"] < stages["first_audio"]
    assert stages["first_audio"] > 0
    answer, rate = read_wav(tmp_path / "a.wav")
    assert rate == piper.sample_rate and len(answer) > rate  # over a second of speech
    from noesis.voice.audio import resample

    heard = whisper.transcribe(resample(answer, rate, 16000), 16000).text
    assert "391" in heard.replace(",", ""), heard


def test_barge_in_aborts_the_real_engine_request():
    """The same barge-in with the bundled draft model behind the answer stage: the engine's
    request is aborted, not left running. Each delta is slowed to 20 ms so generation is
    certainly still going when the user speaks."""
    from pathlib import Path

    from noesis.voice.experts import (
        AnswerSettings,
        ExpertPool,
        ExpertSpec,
        answer_function,
        llm_bytes,
        llm_loader,
    )

    models = Path(__file__).resolve().parents[2] / "models"
    pool = ExpertPool(
        [ExpertSpec("draft", models / "noesis-tiny-draft")],
        2**30,
        llm_loader("float32", 1024),
        llm_bytes,
    )
    llm = pool.acquire("draft", "cpu")
    aborted, stream = [], llm.stream

    def slow_stream(prompt, params):
        for delta in stream(prompt, params):
            time.sleep(0.02)
            yield delta

    llm.stream = slow_stream
    real_abort = llm.engine.abort
    llm.engine.abort = lambda request_id: aborted.append(request_id) or real_abort(request_id)
    real_answer = answer_function(pool, AnswerSettings(max_tokens=400), lambda task: ())

    def answer(decision, history, stop, first_token):
        if decision.turn == 0:
            return real_answer(decision, history, stop, first_token)
        return FakeAnswer(["Yes."])(decision, history, stop, first_token)  # the barge-in's turn

    def route_to_draft(text):
        return ("writing", 1.0, "draft", "cpu")

    actors = voice_actors(
        BargingMic(),
        answer,
        RecordingSink(),
        FakeAsr("Tell me a short story about Mira and a fox."),
    )
    actors[3] = RouteStage("router", route_to_draft)
    pipeline = Pipeline(actors)
    try:
        timings = asyncio.run(pipeline.run())
    finally:
        pool.close()
    assert timings[0].barged_in
    assert len(aborted) >= 1 and not llm.engine.has_unfinished()
    spoken_before = pipeline.actors["llm"].answers[0]
    assert 0 < len(spoken_before) < 2000


class ScriptedAsr(FakeAsr):
    """Hears `texts` in order, one per utterance."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        self.texts = iter(texts)

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript:
        self.heard.append(len(audio))
        return Transcript(next(self.texts), 0.0)


@pytest.mark.parametrize("continuation_s", [1.0, 0.0])
def test_speech_resumed_before_the_answer_plays_continues_the_turn(continuation_s):
    # "The meeting is on Friday." <0.25 s pause: the detector ends the turn> "Which day is it?"
    # The answer takes 0.3 s to its first word, so nothing has played when the user resumes.
    audio = np.concatenate([silence(0.05), tone(0.2), silence(0.25), tone(0.2), silence(0.2)])
    source = AudioSource("mic", blocks_of(audio), RATE, paced=True)
    asr = ScriptedAsr(["The meeting is on Friday.", "Which day is it?"])
    answer, sink = FakeAnswer(["Friday."], delay=0.3), RecordingSink()
    actors = voice_actors(source, answer, sink, asr)
    actors[1] = VadStage("vad", EnergyVad(), continuation_s=continuation_s)
    pipeline = Pipeline(actors)
    timings = asyncio.run(pipeline.run())

    assert [t.turn for t in timings] == [0, 1]
    assert timings[0].barged_in and timings[0].at("first_audio") is None
    assert not timings[1].barged_in and timings[1].at("first_audio") is not None
    asked = pipeline.actors["router"].decisions[1].text
    if continuation_s:
        assert asked == "The meeting is on Friday. Which day is it?"
        assert len(asr.heard) == 2 and asr.heard[1] < 0.4 * RATE  # only the new fragment
    else:
        assert asked == "Which day is it?"
    # First audio counts from the end of the last fragment, after the first one ended.
    assert timings[1].at("speech_end") > timings[0].at("speech_end") + 0.4
    assert 0.3 <= timings[1].since_speech_end()["first_audio"] < 1.0


def test_an_early_turn_is_answered_during_the_end_silence_and_plays_once_it_ends():
    # A pause of 3 silent frames (30 ms) hands the utterance on; the end takes 8 (80 ms), and the
    # answer is ready long before: it is recognized and answered early, but plays after the end.
    answer, sink, asr = FakeAnswer(["Five."], delay=0.0), RecordingSink(), FakeAsr()
    audio = np.concatenate([silence(0.05), tone(0.3), silence(0.3)])
    source = AudioSource("mic", blocks_of(audio), RATE, paced=True)
    actors = voice_actors(source, answer, sink, asr)
    actors[1] = VadStage("vad", EnergyVad(early=3))
    (timing,) = asyncio.run(Pipeline(actors).run(max_turns=1))

    assert timing.at("asr_done") < timing.at("speech_end")  # the work started at the pause
    assert timing.at("first_audio_ready") < timing.at("speech_end")
    assert timing.at("first_audio") >= timing.at("speech_end")  # but nothing played before it
    np.testing.assert_array_equal(sink.audio(), FakeTts().synthesize("Five."))


def test_speech_resuming_after_an_early_hand_on_cancels_it_and_the_whole_utterance_is_asked():
    # tone, a 50 ms pause (early at 30 ms, end at 80 ms), tone, silence: one question.
    audio = np.concatenate([silence(0.05), tone(0.2), silence(0.05), tone(0.2), silence(0.3)])
    source = AudioSource("mic", blocks_of(audio), RATE, paced=True)
    asr = ScriptedAsr(["What is two", "What is two plus three?"])
    answer, sink = FakeAnswer(["Five."], delay=0.05), RecordingSink()
    actors = voice_actors(source, answer, sink, asr)
    actors[1] = VadStage("vad", EnergyVad(early=3))
    pipeline = Pipeline(actors)
    timings = asyncio.run(pipeline.run())

    assert [t.turn for t in timings] == [0, 1]
    assert timings[0].barged_in and timings[0].at("first_audio") is None
    assert timings[0].at("speech_end") is None  # it never ended: the user went on
    assert not timings[1].barged_in and timings[1].at("first_audio") is not None
    assert pipeline.actors["router"].decisions[1].text == "What is two plus three?"
    assert asr.heard[1] > 0.4 * RATE  # both 0.2 s fragments: the detector kept the utterance
    np.testing.assert_array_equal(sink.audio(), FakeTts().synthesize("Five."))


class Utterances(Actor):
    outputs = (Utterance,)

    def __init__(self, name: str, utterances: list[Utterance]) -> None:
        super().__init__(name)
        self.utterances = utterances

    async def produce(self, ctx) -> None:
        for utterance in self.utterances:
            await ctx.emit(utterance)


class Transcripts(Actor):
    inputs = (UserTranscript,)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.seen: list[str] = []

    async def handle(self, message, ctx) -> None:
        self.seen.append(message.text)


def test_a_continued_turn_dropped_before_recognition_is_heard_with_its_audio():
    # Turn 0 was cancelled before the recognizer got to it: turn 1 hears both fragments' audio.
    asr = ScriptedAsr(["The meeting is on Friday. Which day is it?"])
    utterance = Utterance(1, tone(0.3), RATE, 0.0, continues=0, earlier_audio=tone(0.4))
    out = Transcripts("out")
    asyncio.run(Pipeline([Utterances("in", [utterance]), AsrStage("asr", asr), out]).run())
    assert asr.heard == [len(tone(0.4)) + len(tone(0.3))]
    assert out.seen == ["The meeting is on Friday. Which day is it?"]
