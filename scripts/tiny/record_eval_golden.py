"""Re-record tests/data/tiny_eval_golden.json: the eval harness's per-item outcomes (greedy, CPU,
float32) on its three conversations, with the bundled model's hash. Run after retraining the model,
and only then: the test that reads the file exists to catch a harness change that moves them.

    PYTHONPATH=src python scripts/tiny/record_eval_golden.py [--note "why"]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
from pathlib import Path

from noesis import LLM
from noesis.tiny import corpus, harness, natural

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "tiny_eval_golden.json"
MODEL = ROOT / "models" / "noesis-tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--note", default="", help="appended to the provenance")
    args = parser.parse_args()
    golden = json.loads(GOLDEN.read_text())
    fields = {f.name for f in dataclasses.fields(natural.NaturalExample)}
    examples = [
        (natural.NaturalExample if e["_natural"] else corpus.Example)(
            **{k: tuple(v) if k == "entities" else v for k, v in e.items() if k in fields}
        )
        for e in golden["examples"]
    ]
    llm = LLM(str(MODEL), device="cpu", dtype="float32", progress=False)
    result = harness.run(llm, examples, harness.EvalConfig(), None)

    def decode(turn) -> str:
        return llm.tokenizer.decode(turn.token_ids, skip_special_tokens=False)

    greedy = {}
    for trace, score in zip(result.traces, result.scores, strict=True):
        got = dataclasses.asdict(score)
        greedy[trace.example.id] = {
            "score": {k: v for k, v in got.items() if k != "end_to_end"},
            "end_to_end": got["end_to_end"],
            "first_text": decode(trace.own.turns[0]),
            "supplied_text": trace.supplied and decode(trace.supplied.turns[0]),
            "own_text": decode(trace.own.turns[-1]) if len(trace.own.turns) > 1 else None,
        }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    golden["provenance"] = (
        f"re-recorded by scripts/tiny/record_eval_golden.py at commit {commit} (the harness"
        f" through the Session), greedy, max_tokens 128, CPU float32. {args.note}"
    ).strip()
    golden["model_sha256"] = hashlib.sha256((MODEL / "model.safetensors").read_bytes()).hexdigest()
    golden["greedy"] = greedy
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {len(greedy)} items")


if __name__ == "__main__":
    main()
