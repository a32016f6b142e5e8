"""Voice answers end to end: 40 everyday spoken questions, each synthesized (Piper and espeak-ng),
played into the voice pipeline, and the spoken answer transcribed back by the pipeline's own
recognizer and checked against what the real tool gives; plus end of speech -> first audio in a
warm session and in fresh processes (`noesis voice --in`).

    .venv/bin/python benchmarks/voice_accuracy.py --json /tmp/voice_accuracy.json [--cold 6]

A turn is correct when the transcript of the spoken answer holds the expected answer (digits,
digits with thousands separators, or number words, as a recognizer may write them). The answer
text the model wrote is scored too, to tell a wrong answer from a misheard one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from noesis.tiny.english import number_words
from noesis.tools.builtin import execute
from noesis.voice.app import VoiceSession
from noesis.voice.audio import write_wav
from noesis.voice.config import load_config
from noesis.voice.messages import STAGES

sys.path.insert(0, str(Path(__file__).parent))
from voice_latency import run_turn  # noqa: E402  (benchmarks/ is not a package)

# (question as spoken, the routed task, the tool call whose result is the answer, or the answer)
QUESTIONS: tuple[tuple[str, str, tuple[str, dict] | str], ...] = (
    ("What is twelve times seven?", "calculator", ("calculator", {"expression": "12*7"})),
    ("What is seventeen times twenty three?", "calculator",
     ("calculator", {"expression": "17*23"})),
    ("How much is nine plus thirteen?", "calculator", ("calculator", {"expression": "9+13"})),
    ("What's one hundred minus thirty eight?", "calculator",
     ("calculator", {"expression": "100-38"})),
    ("What is one hundred forty four divided by twelve?", "calculator",
     ("calculator", {"expression": "144/12"})),
    ("What is two to the power of ten?", "calculator", ("calculator", {"expression": "2**10"})),
    ("What is fifteen percent of two hundred?", "calculator",
     ("calculator", {"expression": "200*15/100"})),
    ("Can you add four hundred fifty and two hundred seventy?", "calculator",
     ("calculator", {"expression": "450+270"})),
    ("What is eight squared?", "calculator", ("calculator", {"expression": "8**2"})),
    ("How much is a thousand divided by eight?", "calculator",
     ("calculator", {"expression": "1000/8"})),
    ("Convert five miles to kilometers.", "convert_units",
     ("convert_units", {"value": 5, "from_unit": "mile", "to_unit": "kilometer"})),
    ("How many feet are in ten meters?", "convert_units",
     ("convert_units", {"value": 10, "from_unit": "meter", "to_unit": "foot"})),
    ("What is one hundred degrees Fahrenheit in Celsius?", "convert_units",
     ("convert_units", {"value": 100, "from_unit": "fahrenheit", "to_unit": "celsius"})),
    ("How many grams are in three pounds?", "convert_units",
     ("convert_units", {"value": 3, "from_unit": "pound", "to_unit": "gram"})),
    ("Convert two liters to milliliters.", "convert_units",
     ("convert_units", {"value": 2, "from_unit": "liter", "to_unit": "milliliter"})),
    ("How many inches are in two feet?", "convert_units",
     ("convert_units", {"value": 2, "from_unit": "foot", "to_unit": "inch"})),
    ("What is thirty degrees Celsius in Fahrenheit?", "convert_units",
     ("convert_units", {"value": 30, "from_unit": "celsius", "to_unit": "fahrenheit"})),
    ("What day of the week was July fourth, nineteen seventy six?", "day_of_week",
     ("day_of_week", {"date": "1976-07-04"})),
    ("What day of the week is March fifth, twenty twenty four?", "day_of_week",
     ("day_of_week", {"date": "2024-03-05"})),
    ("Which weekday was January first, two thousand?", "day_of_week",
     ("day_of_week", {"date": "2000-01-01"})),
    ("How many days are there between January first, twenty twenty four and March first, twenty "
     "twenty four?", "days_between",
     ("days_between", {"start": "2024-01-01", "end": "2024-03-01"})),
    ("How many days from June tenth, twenty twenty five to July fourth, twenty twenty five?",
     "days_between", ("days_between", {"start": "2025-06-10", "end": "2025-07-04"})),
    ("How many days are between May first, twenty twenty and May first, twenty twenty one?",
     "days_between", ("days_between", {"start": "2020-05-01", "end": "2021-05-01"})),
    ("What's the capital of Japan?", "lookup_country",
     ("lookup_country", {"country": "Japan", "field": "capital"})),
    ("What is the capital of France?", "lookup_country",
     ("lookup_country", {"country": "France", "field": "capital"})),
    ("Which city is the capital of Canada?", "lookup_country",
     ("lookup_country", {"country": "Canada", "field": "capital"})),
    ("What is the capital city of Kenya?", "lookup_country",
     ("lookup_country", {"country": "Kenya", "field": "capital"})),
    ("Tell me the capital of Peru.", "lookup_country",
     ("lookup_country", {"country": "Peru", "field": "capital"})),
    ("What currency do they use in Japan?", "lookup_country",
     ("lookup_country", {"country": "Japan", "field": "currency"})),
    ("What money do people use in Poland?", "lookup_country",
     ("lookup_country", {"country": "Poland", "field": "currency"})),
    ("What is the currency of Thailand?", "lookup_country",
     ("lookup_country", {"country": "Thailand", "field": "currency"})),
    ("How many letters are in the word banana?", "string_tool",
     ("string_tool", {"operation": "length", "text": "banana"})),
    ("How many letters are in the word elephant?", "string_tool",
     ("string_tool", {"operation": "length", "text": "elephant"})),
    ("How many times does the letter s appear in mississippi?", "string_tool",
     ("string_tool", {"operation": "count_letter", "text": "mississippi", "letter": "s"})),
    ("How many r's are in the word strawberry?", "string_tool",
     ("string_tool", {"operation": "count_letter", "text": "strawberry", "letter": "r"})),
    ("Hello there!", "greeting", "help"),
    ("Thank you very much.", "greeting", "welcome"),
    ("My name is Anna. What is my name?", "recall", "Anna"),
    ("I have three apples. How many apples do I have?", "recall", "3"),
    ("The meeting is on Friday. Which day is the meeting?", "recall", "Friday"),
)  # fmt: skip


def expected_answer(answer: tuple[str, dict] | str) -> str:
    if isinstance(answer, str):
        return answer
    tool, arguments = answer
    result = execute(tool, json.dumps(arguments))
    return result.split(" = ")[1].split(" ")[0] if tool == "convert_units" else result


def spellings(answer: str) -> set[str]:
    """Ways a recognizer may write the answer: 1024, 1,024, one thousand and twenty-four..."""
    forms = {_normal(answer)}
    if re.fullmatch(r"-?\d+(\.\d+)?", answer):
        value = float(answer)
        if value == int(value):
            whole = int(value)
            forms |= {f"{whole:,}", _normal(number_words(whole)),
                      _normal(number_words(whole, conjunction=" "))}  # fmt: skip
    return {form for form in forms if form}


def _normal(text: str) -> str:
    text = text.lower().replace("-", " ")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,024 -> 1024
    text = re.sub(r"[^\w.\s]|(?<!\d)\.|\.(?!\d)", " ", text)
    return " ".join(text.split())


def holds(text: str | None, answer: str) -> bool:
    if not text:
        return False
    said = f" {_normal(text)} "
    return any(f" {form} " in said for form in spellings(answer) | {_normal(answer)})


def warm_turns(session: VoiceSession, questions) -> list[dict]:
    rows = []
    for text, task, answer in questions:
        expected = expected_answer(answer)
        report = run_turn(session, text, task, keep_audio=True)
        if "error" in report:
            rows.append({"question": text, "expected": expected, "error": report["error"]})
            continue
        heard = session.recognizer.transcribe(*report.pop("_audio")).text
        rows.append({
            "question": text, "expected": expected, "transcript": report["transcript"],
            "task": report["task"], "expected_task": task, "answer": report["answer"],
            "answer_heard": heard, "text_correct": holds(report["answer"], expected),
            "correct": holds(heard, expected),
            "first_audio_s": report["seconds_after_speech_end"].get("first_audio"),
            "stages_s": report["seconds_after_speech_end"],
        })  # fmt: skip
        print(f"  {rows[-1]['correct']!s:5} {text!r} -> {report['answer']!r} -> {heard!r}",
              file=sys.stderr)  # fmt: skip
    return rows


def cold_turns(
    session: VoiceSession, questions, tts: str, count: int, config: str | None = None
) -> list[dict]:
    """`noesis voice --in q.wav` in a fresh process per question: the first turn of a process."""
    rows = []
    synth = session.synthesizer
    with tempfile.TemporaryDirectory() as tmp:
        for i, (text, _, _) in enumerate(questions[:count]):
            speech = synth.synthesize(text)
            question = Path(tmp, f"q{i}.wav")
            write_wav(str(question), np.concatenate([np.zeros(int(0.3 * synth.sample_rate),
                                                              np.float32), speech]),
                      synth.sample_rate)  # fmt: skip
            report = Path(tmp, f"r{i}.json")
            began = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "noesis.cli", "voice", "--in", str(question), "--out",
                 str(Path(tmp, f"a{i}.wav")), "--tts", tts, "--report", str(report)]
                + (["--config", config] if config else []),
                check=True, capture_output=True,
            )  # fmt: skip
            turn = json.loads(report.read_text())["turns"][-1]
            rows.append(
                {
                    "question": text,
                    "process_s": round(time.perf_counter() - began, 2),
                    "first_audio_s": turn["seconds_after_speech_end"].get("first_audio"),
                }
            )
            print(f"  cold {rows[-1]}", file=sys.stderr)
    return rows


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> int:
    args = _parser().parse_args()
    config = load_config(args.config)
    questions = QUESTIONS[: args.n]
    result: dict = {
        "command": "python benchmarks/voice_accuracy.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "voices": {},
    }
    for tts in args.tts:
        session = VoiceSession.build(config, "whisper", tts)
        rows = warm_turns(session, questions)
        cold = cold_turns(session, questions, tts, args.cold, args.config) if args.cold else []
        result["voices"][tts] = {
            "turns": rows,
            "correct": sum(r.get("correct", False) for r in rows),
            "text_correct": sum(r.get("text_correct", False) for r in rows),
            "routed_as_expected": sum(r.get("task") == r.get("expected_task") for r in rows),
            "questions": len(rows),
            "warm_first_audio_s_median": _median(r.get("first_audio_s") for r in rows),
            # where the warm turns' time goes: each stage's median, after the end of speech
            "warm_stages_s_median": {
                stage: _median(r.get("stages_s", {}).get(stage) for r in rows)
                for stage in STAGES[1:]
            },
            "cold": cold,
            "cold_first_audio_s_median": _median(r["first_audio_s"] for r in cold),
        }
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def table(result: dict) -> str:
    lines = [f"voice answers end to end ({result['machine']}, {result['date']})", ""]
    lines.append(f"{'voice':<8}{'spoken answer right':>21}{'text right':>12}{'routed':>8}"
                 f"{'first audio warm':>18}{'cold':>8}")  # fmt: skip
    for tts, v in result["voices"].items():
        n = v["questions"]
        cold = v["cold_first_audio_s_median"]
        lines.append(
            f"{tts:<8}{v['correct']:>4}/{n} {100 * v['correct'] / n:5.1f}%{'':>6}"
            f"{v['text_correct']:>5}/{n}{v['routed_as_expected']:>5}/{n}"
            f"{v['warm_first_audio_s_median']:>14} s{('-' if cold is None else f'{cold} s'):>9}"
        )
    for tts, v in result["voices"].items():
        stages = ", ".join(f"{k} {t}" for k, t in v["warm_stages_s_median"].items())
        lines.append(f"{tts} warm medians after the end of speech (s): {stages}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tts", nargs="+", choices=("piper", "espeak"), default=["piper", "espeak"]
    )
    parser.add_argument("--n", type=int, default=len(QUESTIONS), help="first N questions")
    parser.add_argument("--cold", type=int, default=0, help="also N fresh-process turns per voice")
    parser.add_argument("--config", help="voice config, TOML or JSON")
    parser.add_argument("--json", help="write the results here")
    return parser


if __name__ == "__main__":
    sys.exit(main())
