"""The intent sidecar: the bundled router's guess on a few questions, the prediction back before
the model writes its call, hit/miss counted against
the call the turn made, a predicted isolated tool warmed while the turn decodes, a failing or
stalled intent sidecar never delaying a step, and the `[sidecars.intent]` table."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from noesis import LLM, SamplingParams
from noesis.errors import ConfigError
from noesis.session import Session
from noesis.sidecars.config import load_sidecars
from noesis.sidecars.intent import IntentSidecar
from noesis.sidecars.runtime import Cadence, SidecarRuntime, Window
from noesis.tiny import corpus
from noesis.tiny.tools import schemas
from noesis.tools import ToolExecutor
from noesis.tools.builtin import builtin_tools
from noesis.tools.isolation import WorkerPool
from noesis.weights.hub import bundled_models

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
TOOLS = schemas(["calculator", "convert_units", "lookup_country", "string_tool"])
PARAMS = SamplingParams(max_tokens=96)
QUESTION = "What is 17 * 23?"


class Watched(IntentSidecar):
    """The intent sidecar, signalling each finished call; it may stall on `release` or raise."""

    def __init__(self, router, stall: bool = False, fail: bool = False, **options) -> None:
        super().__init__(router, **options)
        self.ran, self.release = threading.Semaphore(0), threading.Event()
        self.stall, self.fail = stall, fail
        if not stall:
            self.release.set()

    def run(self, window):
        self.release.wait(10)
        try:
            if self.fail:
                raise RuntimeError("intent failed")
            return super().run(window)
        finally:
            self.ran.release()


@pytest.fixture(scope="module")
def router():
    return IntentSidecar.load(bundled_models()["noesis-router"]).router


@pytest.fixture(scope="module")
def llm():
    return LLM(str(MODEL_DIR), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def alone(llm):
    """The turn with no sidecar attached."""
    return llm.generate_turn([corpus.user(QUESTION)], TOOLS, deterministic=True, params=PARAMS)


def turn_window(request_id: str, text: str, tools=TOOLS) -> Window:
    return Window(request_id, text, text, False, tools=tuple(tools))


def test_predictions_on_a_few_questions(router):
    sidecar = IntentSidecar(router, threshold=0.5)
    asked = {"What is 17 * 23?": "calculator", "How many km is 12 miles?": "convert_units",
             "What is the capital of Norway?": "lookup_country",
             "Reverse the word 'lantern'.": "string_tool"}
    for question, tool in asked.items():
        intent = sidecar.predict(turn_window(question, question))
        assert intent.tool == tool and intent.p >= 0.5 and intent.confident
        assert sidecar.decide(intent) == f"predict:{tool}"
    # A guess that is not declared, or below the threshold, is not acted on.
    undeclared = sidecar.predict(turn_window("u", "What is 17 * 23?", TOOLS[1:]))
    assert undeclared.tool == "calculator" and not undeclared.confident
    assert sidecar.decide(undeclared) is None
    unsure = IntentSidecar(router, threshold=1.0).predict(turn_window("s", "Hello there!"))
    assert not unsure.confident


def test_outcomes_are_hit_miss_or_unpredicted(router):
    sidecar = IntentSidecar(router)
    harmony = "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{}"
    hermes = '<tool_call>\n{"name": "lookup_country", "arguments": {}}\n</tool_call>'
    cases = [("What is 17 * 23?", harmony, "hit"), ("What is 17 * 23?", hermes, "miss"),
             ("Hello there!", hermes, "unpredicted"), ("Hello there!", "Hi!", None)]
    for index, (question, output, decision) in enumerate(cases):
        rid = f"r{index}"
        sidecar.predict(turn_window(rid, question))
        outcome = sidecar.run(Window(rid, output, output, True))
        assert sidecar.decide(outcome) == decision, (question, output)
        assert sidecar.run(Window(rid, output, output, True)) is None  # remembered once


def drive(llm, runtime, sidecar, tools=TOOLS, wait_first=True):
    """A streamed turn with `runtime` attached, waiting for the sidecar's guess after the first
    output: (the turn, per output (grammar compiles, text so far, the sidecar decisions that
    step collected), every step's sidecar results)."""
    engine = llm.engine
    engine.sidecars = runtime
    turn_stream = llm.stream_turn([corpus.user(QUESTION)], tools, deterministic=True,
                                  params=PARAMS)
    steps, results, token_ids = [], [], []
    try:
        while True:
            try:
                item = next(turn_stream)
            except StopIteration as stop:
                return stop.value, steps, results
            if not hasattr(item, "token_ids"):
                continue  # a parser event
            if wait_first and not steps:
                assert sidecar.ran.acquire(timeout=10)
            token_ids += item.token_ids
            text = llm.tokenizer.decode(token_ids, skip_special_tokens=False)
            decisions = [r.decision for r in engine.sidecar_results]
            steps.append((engine.grammar_stats().get("compiles", 0), text, decisions))
            results += engine.sidecar_results
    finally:
        engine.sidecars = None


def test_the_prediction_comes_before_the_call_and_is_scored_at_the_end(llm, router):
    sidecar = Watched(router)
    runtime = SidecarRuntime([sidecar])
    turn, steps, results = drive(llm, runtime, sidecar)
    (call,) = turn.tool_calls
    assert call.name == "calculator"
    # The prediction is back at a step before the one that wrote "to=functions.".
    predicted = next(i for i, s in enumerate(steps) if "predict:calculator" in s[2])
    called = next(i for i, s in enumerate(steps) if "to=functions." in s[1])
    assert predicted < called
    assert [r.decision for r in results][:1] == ["predict:calculator"]
    # The turn's end is scored: the finished text's call against the prediction.
    assert sidecar.ran.acquire(timeout=10)
    runtime.close()
    (outcome,) = runtime.after_step([])
    assert outcome.decision == "hit" and outcome.value.called == call.name
    stats = runtime.stats()["intent"]
    assert stats["decisions"] == {"predict:calculator": 1, "hit": 1}
    assert stats["completed"] == 2 and stats["drops"] == 0 and stats["errors"] == 0


def test_a_confident_guess_is_told_to_the_turn_hook(router):
    sidecar, told = IntentSidecar(router), []
    window = Window("h", QUESTION, QUESTION, False, tools=tuple(TOOLS), on_intent=told.append)
    assert sidecar.predict(window).confident and told == ["calculator"]
    unsure = Window("u", "Hello there!", "Hello there!", False, tools=tuple(TOOLS),
                    on_intent=told.append)
    assert not IntentSidecar(router, threshold=1.0).predict(unsure).confident
    assert told == ["calculator"]

    def broken(tool):
        raise RuntimeError("hook failed")

    failing = Window("f", QUESTION, QUESTION, False, tools=tuple(TOOLS), on_intent=broken)
    assert sidecar.predict(failing).confident  # the hook's failure is not the prediction's


class RecordingPool(WorkerPool):
    """A worker pool that records warm-ups and calls, in order."""

    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.events: list[tuple[str, object]] = []

    def warm(self, functions):
        functions = list(functions)
        self.events.append(("warm", functions[0]))
        super().warm(functions)

    def job(self, function, kwargs):
        self.events.append(("job", function))
        return super().job(function, kwargs)


def test_a_predicted_isolated_tool_is_warmed_while_the_turn_decodes(llm, router):
    registry = builtin_tools(["calculator", "convert_units"])
    calculator = registry.get("calculator")
    assert calculator.isolated and not llm.predicts_tools
    pool, runtime = RecordingPool(), SidecarRuntime([IntentSidecar(router)])
    llm.engine.sidecars = runtime
    try:
        assert llm.predicts_tools
        session = Session(llm, executor=ToolExecutor(workers=pool))
        reply = session.generate([corpus.user(QUESTION)], tools=registry, deterministic=True,
                                 params=PARAMS)
    finally:
        llm.engine.sidecars = None
        runtime.close()
        pool.close()
    assert [c.name for c in reply.tool_calls] == ["calculator"]
    assert "391" in reply.final
    # The warm-up (asked for as the sidecar predicted the tool) came before the call.
    warmed = pool.events.index(("warm", calculator.function))
    assert warmed < pool.events.index(("job", calculator.function))
    # Both rounds (the call, then the answer) were shown the same user message.
    assert runtime.stats()["intent"]["decisions"]["predict:calculator"] == 2


def test_stalled_then_failing_intent_never_delays_a_step(llm, router, alone):
    sidecar = Watched(router, stall=True, fail=True)  # stuck for the whole turn, then raises
    runtime = SidecarRuntime([sidecar])
    turn, steps, results = drive(llm, runtime, sidecar, wait_first=False)
    assert turn.token_ids == alone.token_ids and len(steps) >= 2
    assert results == []  # every step ran while the sidecar sat in its first call
    sidecar.release.set()
    runtime.close()
    runtime.lanes["intent"].threads[0].join(10)
    failed = runtime.after_step([])
    assert [(r.decision, r.error) for r in failed] == [(None, "RuntimeError: intent failed")] * 2
    stats = runtime.stats()["intent"]
    assert stats["windows"] == 2 and stats["errors"] == 2 and stats["decisions"] == {}


def test_intent_config(tmp_path):
    file = tmp_path / "sidecars.toml"
    file.write_text("[sidecars.intent]\nthreshold = 0.7\n")
    (spec,) = load_sidecars(file).sidecars
    assert (spec.kind, spec.cadence.kind, spec.threshold) == ("intent", "turn", 0.7)
    assert spec.model == str(bundled_models()["noesis-router"])
    assert spec.describe().startswith("intent: intent, model ")
    runtime = load_sidecars(file).build()
    try:
        assert isinstance(runtime.lanes["intent"].sidecar, IntentSidecar)
    finally:
        runtime.close()
    file.write_text('[sidecars.intent]\ncadence = "clause"\n')
    with pytest.raises(ConfigError, match="cadence must be 'turn'"):
        load_sidecars(file).build()
    with pytest.raises(ConfigError, match="cadence"):
        IntentSidecar(None, cadence=Cadence("request"))


def test_the_server_shows_the_intent_sidecar_its_chat_turns(tmp_path):
    import time

    import openai
    from starlette.testclient import TestClient

    from noesis.engine.config import EngineConfig
    from noesis.engine.transport import EngineThread
    from noesis.server.app import create_app
    from noesis.server.config import ServeConfig

    path = tmp_path / "sidecars.toml"
    path.write_text("[sidecars.intent]\n")
    sidecars = load_sidecars(path)
    assert sidecars.reads_turns and not load_sidecars(None, safety=True).reads_turns
    served = LLM(str(MODEL_DIR), device="cpu", dtype="float32", progress=False)
    runtime = served.engine.sidecars = sidecars.build()
    config = ServeConfig("m", engine=EngineConfig(sidecars=sidecars), engine_process=False)
    with TestClient(create_app(config, EngineThread(served.engine))) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        question = [{"role": "user", "content": QUESTION}]
        reply = client.chat.completions.create(model="m", messages=question, tools=TOOLS,
                                               temperature=0, max_tokens=96)
        # Without tools there is nothing to predict: no turn window.
        client.chat.completions.create(model="m", messages=question, temperature=0,
                                       max_tokens=8)
        deadline = time.monotonic() + 10
        while runtime.stats()["intent"]["completed"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "calculator"
    stats = runtime.stats()["intent"]
    assert stats["windows"] == 2  # the turn as admitted, then its whole text
    assert stats["decisions"] == {"predict:calculator": 1, "hit": 1}
