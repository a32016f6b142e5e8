"""`noesis voice`: build the voice pipeline from configuration and run a WAV -> WAV turn or live
microphone turns, with an optional live dashboard and a JSON timing report."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from noesis.errors import InvalidRequest, NoesisError
from noesis.tools.builtin import builtin_tools
from noesis.tools.isolation import shared_pool
from noesis.voice.config import VoiceConfig, load_config
from noesis.voice.experts import (
    AnswerSettings,
    ExpertPool,
    ExpertSpec,
    answer_function,
    llm_bytes,
    llm_loader,
    warm_prefix,
)
from noesis.voice.messages import TurnTiming
from noesis.voice.pipeline import Pipeline
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

VAD_RATE = 16000
# A pause this long hands the utterance on (recognized, routed, answered) while the detector
# waits out the rest of the 0.3 s end-of-turn silence; speech that resumes cancels that work.
EARLY_END_S = 0.1
BLOCK_SAMPLES = 512  # 32 ms, the Silero frame
TAIL_SILENCE_S = 1.0  # appended to a WAV question so the detector sees the end of the turn


class NoSpeech(NoesisError, ValueError):
    """The input audio holds no speech the voice detector could find."""


def add_voice_parser(subparsers) -> argparse.ArgumentParser:
    voice = subparsers.add_parser(
        "voice", help="spoken turns: a WAV question to a WAV answer, or the microphone"
    )
    source = voice.add_mutually_exclusive_group(required=True)
    source.add_argument("--in", dest="input", metavar="WAV", help="the question, a WAV file")
    source.add_argument("--mic", action="store_true", help="listen on the default microphone")
    voice.add_argument("--out", metavar="WAV", help="with --in: write the spoken answer here")
    voice.add_argument("--dashboard", action="store_true", help="live per-actor latency view")
    voice.add_argument("--report", metavar="FILE", help="write per-turn timings as JSON")
    voice.add_argument("--config", metavar="FILE", help="voice config, TOML or JSON")
    voice.add_argument("--asr", choices=("whisper", "grammar"), default="whisper")
    voice.add_argument("--tts", choices=("piper", "espeak"), default="piper")
    voice.add_argument("--turns", type=int, help="with --mic: stop after this many turns")
    voice.add_argument(
        "--telemetry", metavar="PATH",
        help="per-step and per-request telemetry as JSON lines, a file per expert model beside "
             "PATH (voice.jsonl -> voice.noesis-tiny.jsonl, ...), as --telemetry on generate")
    voice.set_defaults(handler=run)
    return voice


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    config = load_config(args.config)
    if args.mic:
        return _run_mic(args, config)
    samples, rate = _read_question(args.input)
    session = VoiceSession.build(config, args.asr, args.tts, args.telemetry)
    sink = WavRecorder(session.synthesizer.sample_rate)
    source = wav_source(samples, rate)
    reports = asyncio.run(session.run(source, sink, max_turns=1, dashboard=args.dashboard))
    if not reports:
        raise NoSpeech(f"no speech found in {args.input}")
    from noesis.voice.audio import write_wav

    write_wav(args.out, sink.samples(), sink.sample_rate)
    _print_turns(reports)
    _write_report(args.report, reports, session)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.input and not args.out:
        raise InvalidRequest("--in needs --out (where to write the spoken answer)")
    if args.mic and args.out:
        raise InvalidRequest("--out goes with --in; --mic plays the answers")
    if args.turns is not None and args.turns < 1:
        raise InvalidRequest(f"--turns must be >= 1, got {args.turns}")


def _read_question(path: str) -> tuple[np.ndarray, int]:
    from noesis.voice.audio import read_wav

    if not Path(path).is_file():
        raise InvalidRequest(f"--in {path}: no such file")
    return read_wav(path)


def _run_mic(args: argparse.Namespace, config: VoiceConfig) -> int:
    from noesis.voice.audio import Microphone

    with Microphone(VAD_RATE, BLOCK_SAMPLES) as mic:  # no device: fails before models load
        session = VoiceSession.build(config, args.asr, args.tts, args.telemetry)
        sink = SpeakerSink(session.synthesizer.sample_rate)
        listening = threading.Event()
        listening.set()
        source = AudioSource("mic", mic_blocks(mic, listening), VAD_RATE, paced=False)
        print("Listening; speak. Ctrl-C quits.", file=sys.stderr)
        try:
            reports = asyncio.run(session.run(source, sink, args.turns, args.dashboard))
        except KeyboardInterrupt:
            reports = session.reports()
        finally:
            listening.clear()
            sink.close()
    _print_turns(reports)
    _write_report(args.report, reports, session)
    return 0


# ---------------------------------------------------------------- the session


@dataclass
class TurnReport:
    turn: int
    transcript: str | None
    task: str | None
    confidence: float | None
    expert: str | None
    device: str | None
    answer: str | None
    barged_in: bool
    seconds_after_speech_end: dict[str, float]
    first_sentence_audio_after_its_last_token_s: float | None

    @classmethod
    def of(cls, timing: TurnTiming, stages: dict[str, Any]) -> TurnReport:
        heard = stages["asr"].heard.get(timing.turn)
        decision = stages["router"].decisions.get(timing.turn)
        ready, played = timing.at("first_chunk_text_ready"), timing.at("first_audio")
        return cls(
            turn=timing.turn,
            transcript=heard.text if heard else None,
            task=decision.task if decision else None,
            confidence=round(decision.confidence, 4) if decision else None,
            expert=decision.expert if decision else None,
            device=decision.device if decision else None,
            answer=stages["llm"].answers.get(timing.turn),
            barged_in=timing.barged_in,
            seconds_after_speech_end={k: round(v, 4) for k, v in timing.since_speech_end().items()},
            first_sentence_audio_after_its_last_token_s=(
                round(played - ready, 4) if ready is not None and played is not None else None
            ),
        )


class VoiceSession:
    """The loaded pieces (router, expert pool, detector, recognizer, synthesizer) and the
    pipeline built from them; one session can run several pipelines in turn."""

    def __init__(self, config: VoiceConfig, router, pool: ExpertPool, vad_factory,
                 recognizer, synthesizer) -> None:
        self.config = config
        self.router, self.pool = router, pool
        self.vad_factory = vad_factory
        self.recognizer, self.synthesizer = recognizer, synthesizer
        self.pipeline: Pipeline | None = None

    @classmethod
    def build(cls, config: VoiceConfig, asr: str = "whisper", tts: str = "piper",
              telemetry: str | None = None) -> VoiceSession:
        from noesis.voice.router import Router

        router = Router.load(config.router)
        config.check_labels(router.config.labels)
        pool = ExpertPool(
            [ExpertSpec(name, path) for name, path in config.experts.items()],
            config.memory_budget_bytes,
            llm_loader(config.generation.dtype, config.generation.max_model_len,
                       config.experts.get(config.generation.draft), telemetry, config.sidecars),
            llm_bytes,
            config.prefetch_chunk_bytes,
        )
        session = cls(config, router, pool, _vad_factory(config), _recognizer(asr, config),
                      _synthesizer(tts, config))
        session.warm_up()
        return session

    def warm_up(self) -> None:
        """Load every routed expert and run a one-token turn with each route's tools, so the first
        turn does not pay for loading, first-call allocations or reading its route's system and
        tool declarations (they stay in the expert's prefix cache); start the tool worker process
        with the isolated tools' modules imported. Loads count as pool misses."""
        routes = {self.config.route(label) for label in self.router.config.labels}
        settings = self.answer_settings()
        for route in sorted(routes, key=lambda r: (r.expert, r.device, r.tools)):
            warm_prefix(self.pool.acquire(route.expert, route.device), route.tools, settings)
        self.recognizer.transcribe(np.zeros(VAD_RATE // 2, dtype=np.float32), VAD_RATE)
        self.synthesizer.synthesize("Hello.")
        isolated = [t.function for r in routes for t in builtin_tools(r.tools) if t.isolated]
        if isolated:  # the first calculator call started its worker process: +0.37 s cold
            shared_pool().warm(isolated)

    def build_pipeline(self, source: AudioSource, sink) -> Pipeline:
        threads = self.config.threads
        answer = answer_function(
            self.pool, self.answer_settings(), lambda task: self.config.route(task).tools
        )
        from noesis.voice.text_chunks import TextChunker

        actors = [
            source,
            VadStage("vad", self.vad_factory(), threads.vad),
            AsrStage("asr", self.recognizer, threads.asr),
            RouteStage("router", self.route, threads.router),
            AnswerStage("llm", answer, threads.llm),
            ChunkStage("chunker", TextChunker),
            TtsStage("tts", self.synthesizer, threads.tts),
            PlayerStage("player", sink),
        ]
        return Pipeline(actors, queue_size=self.config.queue_size)

    def answer_settings(self) -> AnswerSettings:
        generation = self.config.generation
        return AnswerSettings(
            generation.max_tokens, generation.temperature, generation.max_tool_steps,
            generation.system or None,
        )

    def route(self, text: str) -> tuple[str, float, str, str]:
        """Label the transcript, pick the expert, and start reading its weights if not loaded."""
        task, probability = self.router.predict(text)
        route = self.config.route(task)
        if not self.pool.is_loaded(route.expert, route.device):
            threading.Thread(target=self.pool.prefetch, args=(route.expert,), daemon=True).start()
        return task, probability, route.expert, route.device

    async def run(self, source: AudioSource, sink, max_turns: int | None = None,
                  dashboard: bool = False) -> list[TurnReport]:
        self.pipeline = self.build_pipeline(source, sink)
        view = None
        if dashboard:
            from noesis.voice.dashboard import Dashboard

            view = asyncio.create_task(Dashboard(self.pipeline, self.pool).run())
        try:
            await self.pipeline.run(max_turns)
        finally:
            if view is not None:
                view.cancel()
                await asyncio.gather(view, return_exceptions=True)
        return self.reports()

    def reports(self) -> list[TurnReport]:
        if self.pipeline is None:
            return []
        stages = self.pipeline.actors
        return [
            TurnReport.of(t, stages) for t in self.pipeline.timings() if t.at("speech_end")
        ]


def _vad_factory(config: VoiceConfig):
    from noesis.voice.vad import EndOfTurnDetector, SileroVad, TurnConfig

    turn = TurnConfig(early_end_seconds=EARLY_END_S)
    return lambda: EndOfTurnDetector(turn, SileroVad(threads=config.threads.vad))


def _recognizer(kind: str, config: VoiceConfig):
    if kind == "whisper":
        from noesis.voice.asr import WhisperRecognizer

        window = config.asr_window_s
        return WhisperRecognizer(
            threads=config.threads.asr, window_s=window if window < 30 else None
        )
    from noesis.voice.asr import GrammarRecognizer

    return GrammarRecognizer()


def _synthesizer(kind: str, config: VoiceConfig):
    if kind == "piper":
        from noesis.voice.tts import PiperSynthesizer

        return PiperSynthesizer(threads=config.threads.tts)
    from noesis.voice.tts import EspeakSynthesizer

    return EspeakSynthesizer()


# ---------------------------------------------------------------- audio in and out


def wav_source(samples: np.ndarray, sample_rate: int, name: str = "mic") -> AudioSource:
    """A WAV question played into the pipeline at real-time pace, then silence."""
    from noesis.voice.audio import resample

    audio = resample(samples, sample_rate, VAD_RATE) if sample_rate != VAD_RATE else samples
    audio = np.concatenate([audio, np.zeros(int(TAIL_SILENCE_S * VAD_RATE), np.float32)])
    blocks = [audio[i : i + BLOCK_SAMPLES] for i in range(0, len(audio), BLOCK_SAMPLES)]
    return AudioSource(name, blocks, VAD_RATE, paced=True)


def mic_blocks(mic, listening: threading.Event) -> Iterator[np.ndarray]:
    while listening.is_set():
        try:
            yield mic.read(timeout=0.2)
        except queue.Empty:
            continue


class WavRecorder:
    """AudioSink that keeps what was played, for --out."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self._blocks: list[np.ndarray] = []

    def write(self, block: np.ndarray) -> None:
        self._blocks.append(np.array(block, dtype=np.float32))

    def stop(self) -> None:
        """Nothing is buffered past what was written: a recording keeps what was played."""

    def samples(self) -> np.ndarray:
        return np.concatenate(self._blocks) if self._blocks else np.zeros(0, np.float32)


class SpeakerSink:
    """AudioSink on the default output device; `stop` drops what the device has not played."""

    def __init__(self, sample_rate: int) -> None:
        from noesis.voice.audio import AudioDeviceUnavailable, sounddevice_module

        sd = sounddevice_module()
        try:
            sd.query_devices(kind="output")
        except (sd.PortAudioError, ValueError) as exc:
            raise AudioDeviceUnavailable(f"no output audio device available ({exc})") from exc
        self.sample_rate = sample_rate
        self._pending: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self._stream = sd.OutputStream(
            samplerate=sample_rate, channels=1, dtype="float32", callback=self._fill
        )
        self._stream.start()

    def write(self, block: np.ndarray) -> None:
        with self._lock:
            self._pending.append(np.asarray(block, dtype=np.float32))

    def stop(self) -> None:
        with self._lock:
            self._pending.clear()

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

    def _fill(self, out: np.ndarray, frames: int, time_info, status) -> None:
        out.fill(0.0)
        filled = 0
        with self._lock:
            while filled < frames and self._pending:
                block = self._pending[0]
                take = min(frames - filled, len(block))
                out[filled : filled + take, 0] = block[:take]
                filled += take
                if take == len(block):
                    self._pending.popleft()
                else:
                    self._pending[0] = block[take:]


# ---------------------------------------------------------------- output


def _print_turns(reports: list[TurnReport]) -> None:
    for report in reports:
        first = report.seconds_after_speech_end.get("first_audio")
        latency = f"{1000 * first:.0f} ms" if first is not None else "-"
        print(f"heard      {report.transcript!r}")
        print(f"routed     {report.task} ({report.confidence}) -> {report.expert} on "
              f"{report.device}")
        print(f"answered   {report.answer!r}{' [barged in]' if report.barged_in else ''}")
        print(f"first audio {latency} after the end of speech")


def _write_report(path: str | None, reports: list[TurnReport], session: VoiceSession) -> None:
    if not path:
        return
    pipeline = session.pipeline
    document = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "asr": session.recognizer.name,
        "tts": session.synthesizer.name,
        "turns": [vars(report) for report in reports],
        "experts": session.pool.stats.summary(),
        "actors": {
            name: {"threads": pipeline.actors[name].threads, "handled": s.count,
                   "median_s": s.median}
            for name, s in pipeline.stats.items()
        } if pipeline else {},
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
