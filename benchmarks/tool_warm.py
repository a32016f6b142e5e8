"""The intent sidecar's tool warm-up, on this machine: how long a Session's first isolated tool
call waits for its result, with the intent sidecar on (the predicted tool's worker process
starts while the turn decodes) and off (the call starts it), each run on a fresh worker pool as
a new `noesis chat` has.

    .venv/bin/python benchmarks/tool_warm.py --repeats 5 --json /tmp/tool_warm.json

The bundled model answers each question greedily with every built-in tool declared; off and on
alternate. "call" is from the turn that made the call (parsed) to its executed result, "answer"
from the question to the final answer.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from noesis import LLM
from noesis.session import AssistantTurn, ExecutedToolCall, Session, SessionResponse
from noesis.sidecars.intent import IntentSidecar
from noesis.sidecars.runtime import SidecarRuntime
from noesis.tiny import corpus
from noesis.tools import ToolExecutor
from noesis.tools.builtin import DECLARATION_ORDER, builtin_tools
from noesis.tools.isolation import WorkerPool
from noesis.weights.hub import bundled_models

MODEL = Path(__file__).resolve().parents[1] / "models" / "noesis-tiny"
QUESTIONS = ("What is 17 * 23?", "How many km is 12 miles?", "What is 2 to the power of 10?",
             "Convert 30 celsius to fahrenheit.")


def one(llm: LLM, question: str, intent: bool) -> dict:
    """One answer on a cold pool: (call ms, answer ms, the tool called)."""
    pool = WorkerPool()
    runtime = SidecarRuntime([IntentSidecar.load(bundled_models()["noesis-router"])]) \
        if intent else None  # fmt: skip
    llm.engine.sidecars = runtime
    session = Session(llm, executor=ToolExecutor(workers=pool))
    start = turn_end = time.perf_counter()
    call_ms, tool = None, None
    try:
        events = session.stream([corpus.user(question)], tools=builtin_tools(DECLARATION_ORDER),
                                deterministic=True)  # fmt: skip
        for event in events:
            if isinstance(event, AssistantTurn):
                turn_end = time.perf_counter()
            elif isinstance(event, ExecutedToolCall) and call_ms is None:
                call_ms, tool = (time.perf_counter() - turn_end) * 1e3, event.name
            elif isinstance(event, SessionResponse):
                answer_ms = (time.perf_counter() - start) * 1e3
    finally:
        llm.engine.sidecars = None
        if runtime is not None:
            runtime.close()
        pool.close()
    return {"call_ms": call_ms, "answer_ms": answer_ms, "tool": tool}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="off/on pairs per question")
    parser.add_argument("--json", help="write the runs and medians here")
    args = parser.parse_args()
    llm = LLM(str(MODEL), device="cpu", progress=False)
    one(llm, QUESTIONS[0], False)  # warm the engine (not the tools: each run has its own pool)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for question in QUESTIONS:
            for mode in ("off", "on"):
                runs[mode].append({"question": question, **one(llm, question, mode == "on")})
    print(f"first isolated tool call, cold pool ({platform.machine()}, {args.repeats} x "
          f"{len(QUESTIONS)} questions per mode)")
    print(f"{'intent sidecar':<16}{'call ms (median)':>18}{'answer ms (median)':>20}  tools")
    medians = {}
    for mode, rows in runs.items():
        calls = [r["call_ms"] for r in rows if r["call_ms"] is not None]
        medians[mode] = {"call_ms": statistics.median(calls),
                         "answer_ms": statistics.median(r["answer_ms"] for r in rows)}
        tools = sorted({r["tool"] for r in rows if r["tool"]})
        print(f"{mode:<16}{medians[mode]['call_ms']:>18.1f}{medians[mode]['answer_ms']:>20.1f}  "
              f"{', '.join(tools)} ({len(calls)}/{len(rows)} called)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
