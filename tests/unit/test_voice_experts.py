"""Expert pool: mmap residency (mincore) and chunked prefetch, LRU under a byte budget, and the
spoken answer of a real bundled expert: final-channel text only, tools run, abort on stop."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from noesis.voice.experts import (
    AnswerSettings,
    ExpertPool,
    ExpertSpec,
    ExpertTooLarge,
    MappedFile,
    UnknownExpert,
    llm_bytes,
    llm_loader,
    stream_answer,
)

MODELS = Path(__file__).resolve().parents[2] / "models"


def write_random(path: Path, megabytes: int) -> Path:
    rng = np.random.default_rng(0)
    with open(path, "wb") as handle:
        handle.write(rng.integers(0, 256, megabytes * 2**20, dtype=np.uint8).tobytes())
        handle.flush()
        os.fsync(handle.fileno())  # dirty pages cannot be dropped from the page cache
    return path


def test_chunked_willneed_prefetch_makes_a_cold_file_resident(tmp_path: Path):
    mapped = MappedFile(write_random(tmp_path / "expert.safetensors", 24))
    try:
        mapped.drop_from_page_cache()
        cold = mapped.resident_fraction()
        assert cold < 0.5, f"could not evict the file from the page cache ({cold:.2f} resident)"
        assert mapped.advise(4 * 2**20) == 6  # one madvise per 4 MiB chunk
        waited = 0
        while mapped.resident_fraction() < 1.0 and waited < 400:
            threading.Event().wait(0.005)
            waited += 1
        assert mapped.resident_fraction() == 1.0
    finally:
        mapped.close()


def test_touching_pages_populates_them(tmp_path: Path):
    mapped = MappedFile(write_random(tmp_path / "expert.safetensors", 8))
    try:
        mapped.drop_from_page_cache()
        mapped.touch()
        assert mapped.resident_fraction() == 1.0
    finally:
        mapped.close()


def fake_pool(tmp_path: Path, budget: int, loads: list) -> ExpertPool:
    specs = []
    for name in "abc":
        specs.append(ExpertSpec(name, write_random(tmp_path / f"{name}.safetensors", 1)))

    def load(spec: ExpertSpec, device: str):
        loads.append((spec.name, device))
        return {"name": spec.name, "device": device}

    return ExpertPool(specs, budget, load=load, measure=lambda value: 100)


def test_pool_is_lru_under_its_budget_and_counts_hits(tmp_path: Path):
    loads: list = []
    pool = fake_pool(tmp_path, budget=250, loads=loads)
    try:
        assert pool.acquire("a", "cpu")["name"] == "a"
        pool.acquire("b", "cpu")
        pool.acquire("a", "cpu")  # hit; b is now least recently used
        pool.acquire("c", "cpu")  # 300 > 250: evicts b
        assert pool.loaded_names() == ["a", "c"] and pool.used_bytes == 200
        pool.acquire("b", "cpu")  # miss again, evicts a
        assert loads == [("a", "cpu"), ("b", "cpu"), ("c", "cpu"), ("b", "cpu")]
        assert (pool.stats.hits, pool.stats.misses, pool.stats.evictions) == (1, 4, 2)
        assert pool.stats.hit_rate == pytest.approx(0.2)
        pool.acquire("b", "cuda")  # another device is another load
        assert loads[-1] == ("b", "cuda") and pool.loaded_names() == ["c", "b"]
        seconds = pool.prefetch("c")
        assert pool.residency("c") == 1.0 and seconds >= 0.0
        assert pool.stats.summary()["prefetches"] == 1
        with pytest.raises(UnknownExpert, match="no expert named 'd'"):
            pool.acquire("d", "cpu")
    finally:
        pool.close()


def test_an_expert_over_the_budget_is_refused(tmp_path: Path):
    pool = fake_pool(tmp_path, budget=50, loads=[])
    with pytest.raises(ExpertTooLarge, match="over the pool budget of 50"):
        pool.acquire("a", "cpu")


@pytest.fixture(scope="module")
def tiny_pool():
    specs = [ExpertSpec("noesis-tiny", MODELS / "noesis-tiny"),
             ExpertSpec("noesis-tiny-draft", MODELS / "noesis-tiny-draft")]
    pool = ExpertPool(specs, 2**30, llm_loader("float32", 1024), llm_bytes)
    yield pool
    pool.close()


def test_a_tool_question_is_answered_through_the_tool_and_only_final_text_is_spoken(tiny_pool):
    llm = tiny_pool.acquire("noesis-tiny", "cpu")
    messages = [{"role": "user", "content": "What is 17 times 23?"}]
    firsts = []
    deltas = list(
        stream_answer(llm, messages, ("calculator",), AnswerSettings(), threading.Event(),
                      lambda: firsts.append(1))
    )
    spoken = "".join(deltas)
    assert "391" in spoken  # 17*23, from the calculator's real result
    assert "<|" not in spoken and "calculator" not in spoken.lower()  # no analysis, no call
    assert len(deltas) > 1 and firsts == [1]  # streamed, not one block at the end
    assert not llm.engine.has_unfinished()


def test_setting_stop_aborts_the_request(tiny_pool):
    llm = tiny_pool.acquire("noesis-tiny-draft", "cpu")
    stop = threading.Event()
    messages = [{"role": "user", "content": "Tell me a short story about Mira and a fox."}]
    answer = stream_answer(llm, messages, (), AnswerSettings(max_tokens=400), stop, stop.set)
    spoken = list(answer)  # stop is set at the first generated token
    assert spoken == [] or len("".join(spoken)) < 40
    assert not llm.engine.has_unfinished(), "the request was not aborted"
    assert llm_bytes(llm) > 0 and tiny_pool.stats.misses >= 1


def test_the_spoken_answer_is_decoded_grounded_as_chat_decodes(monkeypatch):
    # Free, the model copied the words a tool works on wrongly ("stawberry"): the voice samples
    # under the grounded turn grammar, arguments copied from the user's words.
    from noesis.session import Session

    seen = {}

    def stream(self, messages, tools=None, *args, **options):
        seen.update(options, tools=[t.name for t in tools], messages=messages)
        return (event for event in ())  # closable, as Session.stream's generator

    monkeypatch.setattr(Session, "stream", stream)
    messages = [{"role": "user", "content": "How many r's are in the word strawberry?"}]
    settings = AnswerSettings(system="Answer briefly.")
    assert list(stream_answer(object(), messages, ("string_tool",), settings,
                              threading.Event())) == []  # fmt: skip
    assert seen["constrained"] is True and seen["grounded"] is True
    assert seen["tools"] == ["string_tool"] and seen["messages"][-1] == messages[-1]


def test_experts_decode_speculatively_with_the_draft_and_say_the_same(tiny_pool, tmp_path):
    load = llm_loader("float32", 1024, draft=MODELS / "noesis-tiny-draft",
                      telemetry=str(tmp_path / "voice.jsonl"))
    drafted = load(ExpertSpec("noesis-tiny", MODELS / "noesis-tiny"), "cpu")
    assert drafted.engine.speculator is not None
    # noesis voice --telemetry: a file per expert beside the path given
    assert drafted.engine.config.telemetry == str(tmp_path / "voice.noesis-tiny.jsonl")
    draft = load(ExpertSpec("noesis-tiny-draft", MODELS / "noesis-tiny-draft"), "cpu")
    assert draft.engine.speculator is None  # the draft does not draft for itself
    plain = tiny_pool.acquire("noesis-tiny", "cpu")
    messages = [{"role": "user", "content": "What is 17 times 23?"}]

    def spoken(llm) -> str:
        return "".join(stream_answer(llm, messages, ("calculator",), AnswerSettings(),
                                     threading.Event()))  # fmt: skip

    assert spoken(drafted) == spoken(plain)  # greedy: the same text, fewer target forwards
