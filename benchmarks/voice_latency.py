"""Voice latency on this machine: end of user speech -> first audio over spoken turns, first
sentence's audio after its last token, router accuracy, expert cache hit rate, prefetch time.

    .venv/bin/python benchmarks/voice_latency.py --json /tmp/voice_latency.json

Each question is synthesized once with the configured voice (so the recognizer hears clean
synthetic speech), then played into a fresh pipeline at real-time pace (one turn per pipeline,
no history) with the session's models loaded and warmed up. The answer is "played" into a
recorder at real-time pace. Times are from the moment the voice detector decides the user
stopped speaking (its end-of-turn silence, 0.3 s by default, comes before that moment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from noesis.voice.app import VoiceSession, WavRecorder, wav_source
from noesis.voice.config import load_config
from noesis.voice.experts import MappedFile, PoolStats

QUESTIONS = (
    ("What is seventeen times twenty three?", "calculator"),
    ("Hello there!", "greeting"),
    ("Convert five kilometers to miles.", "convert_units"),
    ("What day of the week is March fifth, twenty twenty four?", "day_of_week"),
    ("My name is Anna, what is my name?", "recall"),
    ("Write a sentence about a cat.", "writing"),
    ("Reverse the word apple.", "string_tool"),
    ("What date is ten days after January third, twenty twenty five?", "add_days"),
    ("Thank you very much.", "greeting"),
    ("How much is one hundred plus two hundred fifty?", "calculator"),
)


def main() -> int:
    args = _parser().parse_args()
    config = load_config(args.config)
    session = VoiceSession.build(config, args.asr, args.tts)
    session.pool.stats = PoolStats()  # count the benchmark's turns, not the warm-up loads
    turns = [run_turn(session, text, task) for text, task in QUESTIONS[: args.turns]]
    result = {
        "command": "python benchmarks/voice_latency.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "asr": session.recognizer.name,
        "tts": session.synthesizer.name,
        "threads": vars(config.threads),
        "turns": turns,
        "summary": summarize(turns),
        "router": router_summary(config.router, turns),
        "experts": session.pool.stats.summary(),
        "sidecars": session.pool.sidecar_stats(),  # the config's [sidecars], per expert
        "cold_prefetch": cold_prefetch(session, config.prefetch_chunk_bytes),
    }
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    parser.add_argument("--asr", choices=("whisper", "grammar"), default="whisper")
    parser.add_argument("--tts", choices=("piper", "espeak"), default="piper")
    parser.add_argument("--config", help="voice config, TOML or JSON")
    parser.add_argument("--json", help="write the results here")
    return parser


def run_turn(session: VoiceSession, text: str, task: str, keep_audio: bool = False) -> dict:
    """One spoken turn; with keep_audio, the answer's audio as "_audio": (samples, rate)."""
    speech = session.synthesizer.synthesize(text)
    rate = session.synthesizer.sample_rate
    question = np.concatenate([np.zeros(int(0.3 * rate), np.float32), speech])
    sink = WavRecorder(rate)
    reports = asyncio.run(session.run(wav_source(question, rate), sink, max_turns=1))
    answered = [r for r in reports if not r.barged_in]
    if not answered:
        return {"question": text, "expected_task": task, "error": "no turn answered"}
    # A pause inside the question can end a turn early; the speech after it barges in and the
    # turn that gets answered is the last one. Its times still count from its own end of speech.
    report = vars(answered[-1])
    report["turns_detected"] = len(reports)
    report.update(question=text, expected_task=task, answer_audio_s=len(sink.samples()) / rate)
    if keep_audio:
        report["_audio"] = (sink.samples(), sink.sample_rate)
    print(f"  {text!r} -> {report['transcript']!r} -> {report['answer']!r}", file=sys.stderr)
    return report


def summarize(turns: list[dict]) -> dict:
    def median_of(key: str, nested: str | None = None) -> float | None:
        values = [
            (t[nested].get(key) if nested else t.get(key)) for t in turns if "error" not in t
        ]
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 4) if values else None

    stages = ("asr_done", "routed", "first_token", "first_chunk", "first_audio")
    summary = {f"{s}_s_median": median_of(s, "seconds_after_speech_end") for s in stages}
    summary["first_sentence_audio_after_its_last_token_s_median"] = median_of(
        "first_sentence_audio_after_its_last_token_s"
    )
    firsts = [t["seconds_after_speech_end"].get("first_audio") for t in turns if "error" not in t]
    within = sum(f is not None and f <= 1.0 for f in firsts)
    summary["first_audio_within_1s"] = f"{within}/{len(turns)}"
    return summary


def router_summary(router_dir: Path, turns: list[dict]) -> dict:
    trained = json.loads((router_dir / "training_summary.json").read_text())
    routed = [t for t in turns if t.get("task")]
    correct = sum(t["task"] == t["expected_task"] for t in routed)
    return {
        "heldout_accuracy": trained["heldout_accuracy"],
        "heldout_spoken_accuracy": trained["heldout_spoken_accuracy"],
        "benchmark_transcripts": f"{correct}/{len(routed)}",
    }


def cold_prefetch(session: VoiceSession, chunk_bytes: int) -> list[dict]:
    """Per expert: time until its files are fully in the page cache after dropping them, with
    chunked WILLNEED, one WILLNEED over the whole file, and touching every page."""
    rows = []
    for name, spec in session.pool.specs.items():
        for method in ("chunked_willneed", "single_willneed", "touch"):
            files = [MappedFile(path) for path in spec.files]
            try:
                for mapped in files:
                    mapped.drop_from_page_cache()
                cold = _residency(files)
                start = time.perf_counter()
                for mapped in files:
                    if method == "touch":
                        mapped.touch()
                    else:
                        mapped.advise(chunk_bytes if method == "chunked_willneed" else mapped.size)
                advised = time.perf_counter() - start
                while _residency(files) < 1.0 and time.perf_counter() - start < 5.0:
                    time.sleep(0.001)
                rows.append({
                    "expert": name, "method": method,
                    "bytes": sum(f.size for f in files), "resident_before": round(cold, 3),
                    "call_s": round(advised, 4), "resident_after_s": round(
                        time.perf_counter() - start, 4),
                    "resident_at_end": round(_residency(files), 3),
                })
            finally:
                for mapped in files:
                    mapped.close()
    return rows


def _residency(files: list[MappedFile]) -> float:
    total = sum(f.size for f in files)
    return sum(f.resident_fraction() * f.size for f in files) / total


def table(result: dict) -> str:
    lines = [f"voice latency ({result['asr']}, {result['tts']}, {result['machine']})", ""]
    lines.append(f"{'question':<44}{'task':<15}{'asr':>6}{'tok1':>6}{'chunk1':>7}{'audio1':>7}"
                 f"{'tts1':>6}")
    for t in result["turns"]:
        if "error" in t:
            lines.append(f"{t['question'][:43]:<44}{t['error']}")
            continue
        s = t["seconds_after_speech_end"]
        lines.append(
            f"{t['question'][:43]:<44}{(t['task'] or '-'):<15}{_ms(s.get('asr_done')):>6}"
            f"{_ms(s.get('first_token')):>6}{_ms(s.get('first_chunk')):>7}"
            f"{_ms(s.get('first_audio')):>7}"
            f"{_ms(t['first_sentence_audio_after_its_last_token_s']):>6}"
        )
    lines.append("(ms after the end of speech; tts1: first sentence's audio after its last token)")
    lines.append("")
    for key, value in result["summary"].items():
        lines.append(f"{key:<52}{value}")
    lines.append(f"{'router held-out accuracy':<52}{result['router']['heldout_accuracy']}")
    lines.append(f"{'router on benchmark transcripts':<52}"
                 f"{result['router']['benchmark_transcripts']}")
    experts = result["experts"]
    lines.append(f"{'expert cache hit rate':<52}{experts['hit_rate']} "
                 f"({experts['hits']} hits, {experts['misses']} misses)")
    for expert, stats in result["sidecars"].items():
        for name, s in stats.items():
            mean = s["latency_s"] / s["completed"] if s["completed"] else 0.0
            lines.append(f"sidecar {name} on {expert}: {s['windows']} windows, {s['completed']} "
                         f"run ({_ms(mean)} ms each), {s['drops']} dropped, {s['errors']} "
                         f"failed, decisions {s['decisions']}")
    for row in result["cold_prefetch"]:
        lines.append(f"cold prefetch {row['expert']:<18}{row['method']:<18}"
                     f"{row['bytes'] / 2**20:6.1f} MiB  resident after "
                     f"{_ms(row['resident_after_s'])} ms"
                     f" (calls {_ms(row['call_s'])} ms)")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


if __name__ == "__main__":
    sys.exit(main())
