"""Sidecars: a sidecar that blocks or raises never holds up a step (checked by counters), its
windows come at its cadence, a full queue drops and counts, results arrive at a later step; the
memory sidecar keeps finished turns for Session.recall."""

from __future__ import annotations

import threading

import pytest
from checkpoints import build_checkpoint, build_sentence_bert

from noesis import LLM, SamplingParams
from noesis.session import Session
from noesis.sidecars.embedder import SentenceEmbedder
from noesis.sidecars.memory import Memory, MemorySidecar
from noesis.sidecars.runtime import Cadence, Placement, SidecarRuntime, Window, _window_end

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [0, 9, 8, 7]
EVERY_TOKEN = Cadence("tokens", every=1)


class Probe:
    """A sidecar that counts its calls, blocks on `release` and may raise."""

    def __init__(self, name="probe", cadence=EVERY_TOKEN, queue_size=2,
                 policy="open", fail=False) -> None:
        self.name, self.cadence, self.policy, self.fail = name, cadence, policy, fail
        self.placement = Placement(queue_size=queue_size)
        self.release = threading.Event()
        self.started = threading.Event()
        self.windows: list = []

    def run(self, window):
        self.started.set()
        self.release.wait(10)
        self.windows.append(window)
        if self.fail:
            raise RuntimeError("probe failed")
        return len(window.text)

    def decide(self, value):
        return "seen"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp("sidecars") / "llama", "llama")
    return LLM(str(path), device="cpu", dtype="float32", progress=False)


def run_streaming(llm, runtime, after_step=None):
    """One streamed greedy request stepped to its end with `runtime` attached: (token ids,
    steps taken, every step's sidecar results); `after_step()` runs after each step."""
    engine = llm.engine
    engine.sidecars = runtime
    try:
        request_id = engine.add_request(PROMPT, PARAMS, delta=True)
        steps, tokens, results = 0, [], []
        while engine.has_unfinished():
            outputs = engine.step()
            steps += 1
            if after_step is not None:
                after_step()
            results += engine.sidecar_results
            tokens += [t for out in outputs if out.request_id == request_id for t in out.token_ids]
        return tokens, steps, results
    finally:
        engine.sidecars = None


def test_blocked_sidecar_never_delays_a_step(llm):
    alone = llm.generate([PROMPT], PARAMS)[0].token_ids
    probe = Probe(queue_size=2)
    runtime = SidecarRuntime([probe])

    def worker_took_the_first():  # else, on a loaded machine, the first two windows fill the
        if runtime.stats()["probe"]["windows"]:  # queue and the kept ones are not consecutive
            assert probe.started.wait(10)

    tokens, steps, results = run_streaming(llm, runtime, worker_took_the_first)
    # Every step ran while the sidecar sat blocked in its first call.
    assert probe.started.is_set() and not probe.windows and not results
    assert tokens == alone and steps >= len(alone)
    stats = runtime.stats()["probe"]
    # A window per step whose tokens added text: the worker took one, two queued, the rest
    # were dropped.
    assert 4 <= stats["windows"] <= len(alone) and stats["drops"] == stats["windows"] - 3
    probe.release.set()
    runtime.close()
    for thread in runtime.lanes["probe"].threads:
        thread.join(10)
    llm.engine.sidecars = runtime
    try:
        assert llm.engine.step() == []  # an idle step collects what arrived meanwhile
    finally:
        llm.engine.sidecars = None
    assert len(llm.engine.sidecar_results) == 3
    assert {r.decision for r in llm.engine.sidecar_results} == {"seen"}
    assert "".join(w.text for w in probe.windows) == probe.windows[-1].context[: sum(
        len(w.text) for w in probe.windows)]


@pytest.mark.parametrize(("policy", "decision"), [("open", None), ("closed", "block")])
def test_failing_sidecar_is_counted_by_policy(llm, policy, decision):
    probe = Probe(cadence=Cadence("request"), policy=policy, fail=True)
    probe.release.set()
    runtime = SidecarRuntime([probe])
    tokens, _, _ = run_streaming(llm, runtime)
    assert tokens == llm.generate([PROMPT], PARAMS)[0].token_ids
    runtime.close()
    runtime.lanes["probe"].threads[0].join(10)
    (result,) = runtime.after_step([])
    assert result.decision == decision and "probe failed" in result.error
    stats = runtime.stats()["probe"]
    assert stats["errors"] == 1 and stats["windows"] == 1 and stats["drops"] == 0
    assert probe.windows[0].final and probe.windows[0].text == probe.windows[0].context


class Batcher(Probe):
    """A Probe that takes windows in batches (run_batch), recording each call's windows."""

    def __init__(self, batch: int, **options) -> None:
        super().__init__(**options)
        self.placement = Placement(queue_size=8, batch=batch)
        self.batches: list[list] = []

    def run_batch(self, windows):
        self.started.set()
        self.release.wait(10)
        self.batches.append(list(windows))
        if self.fail:
            raise RuntimeError("probe failed")
        return [len(w.text) for w in windows]


def _batched_run(probe: Batcher, count: int):
    """`count` windows offered while the worker holds the first: the results and stats."""
    runtime = SidecarRuntime([probe])
    lane = runtime.lanes["probe"]
    texts = ["x" * n for n in range(1, count + 1)]
    lane.offer(Window("r", texts[0], texts[0], False))
    assert probe.started.wait(10)  # the worker took the first window alone
    for text in texts[1:]:
        lane.offer(Window("r", text, text, False))
    probe.release.set()
    runtime.close()
    lane.threads[0].join(10)
    return runtime.after_step([]), runtime.stats()["probe"]


def test_batched_sidecar_takes_the_queued_windows_in_one_call():
    probe = Batcher(batch=3)
    results, stats = _batched_run(probe, 5)
    assert [len(b) for b in probe.batches] == [1, 3, 1]  # the rest queued: up to 3 a call
    assert [r.value for r in results] == [1, 2, 3, 4, 5]  # in order, one value each
    assert stats["calls"] == 3 and stats["completed"] == 5 and stats["windows"] == 5
    failing = Batcher(batch=8, fail=True)
    results, stats = _batched_run(failing, 4)
    assert [len(b) for b in failing.batches] == [1, 3]
    assert all("probe failed" in r.error and r.decision is None for r in results)
    assert stats["errors"] == 4 and stats["calls"] == 2


def test_cadence_windows():
    clause = Cadence("clause")
    assert _window_end(clause, "Hello there. How a", 0, 5, False) == len("Hello there.")
    assert _window_end(clause, "Hello there. How a", 12, 5, False) == 12  # nothing new closed
    assert _window_end(clause, "Hello there. How a", 12, 5, True) == 18  # the end flushes
    tokens = Cadence("tokens", every=4)
    assert _window_end(tokens, "abcdef", 2, 3, False) == 2
    assert _window_end(tokens, "abcdef", 2, 4, False) == 6
    assert _window_end(Cadence("request"), "abc", 0, 9, False) == 0


def test_memory_sidecar_feeds_session_recall(llm, tmp_path):
    memory = Memory(SentenceEmbedder(build_sentence_bert(tmp_path / "bert")))
    runtime = SidecarRuntime([MemorySidecar(memory)])
    llm.engine.sidecars = runtime
    try:
        outputs = llm.generate(["Hello world", "The quick brown fox"], PARAMS)
    finally:
        llm.engine.sidecars = None
    runtime.close()
    runtime.lanes["memory"].threads[0].join(10)
    assert len(memory) == 2
    session = Session(llm, memory=memory)
    for out in outputs:
        (text, score), *_ = session.recall(out.text, k=2)
        assert text == out.text and score == pytest.approx(1.0, abs=1e-5)
    assert runtime.stats()["memory"]["decisions"] == {"stored": 2}
    assert Session(llm).recall("anything") == []


def test_memory_sidecar_embeds_a_batch_as_one_by_one(tmp_path):
    embedder = SentenceEmbedder(build_sentence_bert(tmp_path / "bert"))
    texts = ["Hello world", "   ", "The quick brown fox jumps over the lazy dog"]
    windows = [Window("r", t, t, True) for t in texts]
    batched, alone = Memory(embedder), Memory(embedder)
    assert MemorySidecar(batched).run_batch(windows) == [True, False, True]  # blank: not kept
    for window in windows:
        MemorySidecar(alone).run(window)
    assert len(batched) == len(alone) == 2
    for text in (texts[0], texts[2]):  # padded beside the longer text: the same vectors
        (best, score), _ = batched.recall(text, k=2)
        assert best == text and score == pytest.approx(1.0, abs=1e-5)
        assert alone.recall(text, k=2)[1][1] == pytest.approx(batched.recall(text, k=2)[1][1],
                                                              abs=1e-5)
