"""Voice benchmark: word error rate of the recognizers on synthesized speech, and synthesis time.

    python benchmarks/voice_wer.py [--threads 2] [--limit N] [--window-s 30 10] \
        [--json .bench/voice_wer.json]

Speech comes from tests/unit/voice_synth.py: the sentences and commands there, spoken by the Piper
voice (en_US-joe-medium) and by espeak-ng, resampled to 16 kHz. Whisper tiny.en transcribes
everything; the pocketsphinx grammar recognizer transcribes the commands. WER is corpus-level
(errors / reference words, after lowercasing and dropping punctuation). Synthesis time is per
sentence, after one warm-up. `--window-s` compares Whisper encoder windows on the same audio
(30: Whisper's own; shorter: WhisperRecognizer(window_s=...)). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))

import voice_synth  # noqa: E402

from noesis.voice.asr import GrammarRecognizer, WhisperRecognizer, word_error_rate  # noqa: E402

VOICES = ("piper", "espeak")


def synthesize_all(texts: tuple[str, ...]) -> tuple[dict, dict]:
    """16 kHz audio per (voice, text), and seconds spent synthesizing each text per voice."""
    audio, seconds = {}, {voice: [] for voice in VOICES}
    for voice in VOICES:
        voice_synth.speech(voice, "Warm up.")
        for text in texts:
            start = time.perf_counter()
            audio[voice, text] = voice_synth.speech(voice, text)
            seconds[voice].append(time.perf_counter() - start)
    return audio, seconds


def score(recognizer, audio: dict, voice: str, texts: tuple[str, ...], label: str) -> dict:
    pairs, seconds, audio_seconds, wrong = [], [], 0.0, []
    for text in texts:
        samples = audio[voice, text]
        transcript = recognizer.transcribe(samples, voice_synth.RATE)
        pairs.append((text, transcript.text))
        seconds.append(transcript.seconds)
        audio_seconds += samples.size / voice_synth.RATE
        if word_error_rate([(text, transcript.text)]) > 0:
            wrong.append({"reference": text, "hypothesis": transcript.text})
    return {
        "recognizer": recognizer.name,
        "voice": voice,
        "set": label,
        "utterances": len(texts),
        "wer": word_error_rate(pairs),
        "mean_seconds": statistics.mean(seconds),
        "real_time_factor": sum(seconds) / audio_seconds,
        "errors": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "voice_wer.json")
    parser.add_argument(
        "--window-s",
        type=float,
        nargs="+",
        default=[30.0],
        help="Whisper encoder windows to compare, seconds (30: the full window)",
    )
    args = parser.parse_args()

    sentences = voice_synth.SENTENCES[: args.limit]
    commands = voice_synth.COMMANDS
    audio, synth_seconds = synthesize_all(sentences + commands)
    whispers = [
        WhisperRecognizer(threads=args.threads, window_s=None if window >= 30 else window)
        for window in args.window_s
    ]
    grammar = GrammarRecognizer()
    results = []
    for voice in VOICES:
        for whisper in whispers:
            results.append(score(whisper, audio, voice, sentences, "sentences"))
            results.append(score(whisper, audio, voice, commands, "commands"))
        results.append(score(grammar, audio, voice, commands, "commands"))

    print(f"{'recognizer':<26}{'voice':<8}{'set':<10}{'n':>4}{'WER':>8}{'s/utt':>8}{'RTF':>7}")
    for r in results:
        print(
            f"{r['recognizer']:<26}{r['voice']:<8}{r['set']:<10}{r['utterances']:>4}"
            f"{r['wer']:>8.1%}{r['mean_seconds']:>8.3f}{r['real_time_factor']:>7.3f}"
        )
    synthesis = {
        voice: {"mean_seconds_per_sentence": statistics.mean(s[: len(sentences)])}
        for voice, s in synth_seconds.items()
    }
    for voice, figures in synthesis.items():
        print(f"synthesis {voice}: {figures['mean_seconds_per_sentence']:.3f} s per sentence")
    meta = {"machine": platform.machine(), "python": platform.python_version(), **vars(args)}
    meta["json"] = str(args.json)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"meta": meta, "results": results, "synthesis": synthesis}, indent=2)
    )
    print(f"\nJSON written to {args.json}")


if __name__ == "__main__":
    main()
