"""Grammar compilation on worker threads: futures shared per spec, compile errors and limits as
GrammarError / GrammarTooComplex, the deadline, a main thread that keeps ticking, the byte-budget
LRU, and the matcher's error state."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import llguidance
import pytest

from noesis.structured import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    GrammarTooComplex,
    LLGuidanceMatcher,
)
from noesis.structured.grammar_pool import CompilePool, GrammarCache, spec_key
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
VOCAB = 8192


def object_schema(num_properties: int, required: bool, prop=None) -> dict:
    names = [f"field_{i}" for i in range(num_properties)]
    return {
        "type": "object",
        "properties": {name: prop or {"type": "string"} for name in names},
        "required": names if required else [],
    }


def numbered(index: int) -> GrammarSpec:
    """A distinct small grammar per index."""
    return GrammarSpec.json_schema(object_schema(3 + index % 5, True, {"const": index}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture
def make_compiler(tokenizer):
    made = []

    def make(**limits) -> GrammarCompiler:
        compiler = GrammarCompiler.from_tokenizer(tokenizer, VOCAB, limits=GrammarLimits(**limits))
        made.append(compiler)
        return compiler

    yield make
    for compiler in made:
        compiler.close()


# ---- submit, cached, shared futures -------------------------------------------------------------


def test_submit_compiles_once_and_caches_by_content(make_compiler):
    compiler = make_compiler()
    spec = GrammarSpec.json_schema(object_schema(4, True))
    assert compiler.cached(spec) is None
    future = compiler.submit(spec)
    grammar = future.result(timeout=30)
    assert isinstance(grammar, CompiledGrammar) and grammar.nbytes > 0
    same_content = GrammarSpec.json_schema(object_schema(4, True))  # another object, same text
    assert compiler.cached(same_content) is grammar
    again = compiler.submit(same_content)
    assert again.done() and again.result() is grammar
    assert compiler.compile(spec) is grammar
    stats = compiler.stats()
    assert (stats["compiles"], stats["hits"], stats["misses"]) == (1, 2, 1)
    assert (stats["entries"], stats["bytes"]) == (1, grammar.nbytes)
    assert stats["failures"] == stats["timeouts"] == stats["compiling"] == 0


def test_concurrent_submits_share_one_compile(make_compiler):
    compiler = make_compiler()
    spec = GrammarSpec.json_schema(object_schema(3000, True))  # ~0.1 s to compile
    first = compiler.submit(spec)
    second = compiler.submit(GrammarSpec.json_schema(object_schema(3000, True)))
    assert second is first and not first.done()
    assert not first.cancel()  # shared: nobody may cancel it for the others
    assert first.result(timeout=60) is compiler.cached(spec)
    assert compiler.stats()["compiles"] == 1


def test_spec_key_covers_kind_source_and_compact_flag():
    schema = object_schema(2, True)
    keys = {
        spec_key(GrammarSpec.json_schema(schema)),
        spec_key(GrammarSpec.json_schema(schema, compact=True)),
        spec_key(GrammarSpec.lark(GrammarSpec.json_schema(schema).source)),
    }
    assert len(keys) == 3
    assert spec_key(GrammarSpec.json_schema(dict(schema))) in keys


# ---- errors and limits --------------------------------------------------------------------------


def test_a_bad_grammar_fails_its_future_with_llguidance_message(make_compiler):
    compiler = make_compiler()
    source = "start: foo("
    direct = llguidance.LLMatcher(
        compiler.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(source), log_level=0
    )
    message = direct.get_error().strip().splitlines()[0]
    future = compiler.submit(GrammarSpec.lark(source))
    with pytest.raises(GrammarError) as caught:
        future.result(timeout=30)
    assert message in str(caught.value) and not isinstance(caught.value, GrammarTooComplex)
    # The failure is remembered: the same spec is refused at once, without a second compile.
    again = compiler.submit(GrammarSpec.lark(source))
    assert again.done() and isinstance(again.exception(), GrammarError)
    assert compiler.stats()["compiles"] == 1 and compiler.stats()["failures"] == 1


PATTERNED = object_schema(20, True, {"type": "string", "pattern": "[a-z]{3,9}x"})


@pytest.mark.parametrize(
    ("limits", "schema", "limit", "said"),
    [
        ({"max_grammar_size": 100}, PATTERNED, "max_grammar_size", "grammar size"),
        ({"initial_lexer_fuel": 1000}, PATTERNED, "initial_lexer_fuel", "lexer configuration"),
        ({"max_lexer_states": 20}, PATTERNED, "max_lexer_states", "too many states"),
        # The issue's ~9,000-property object in small: it compiles, but its first token opens
        # ~4 parser items per optional property, over the 2,000 of a row (the default).
        ({}, object_schema(600, False), "max_items_in_row", "max is 2000"),
    ],
)
def test_a_grammar_over_a_limit_is_too_complex_naming_it(make_compiler, limits, schema, limit,
                                                           said):
    compiler = make_compiler(**limits)
    with pytest.raises(GrammarTooComplex) as caught:
        compiler.submit(GrammarSpec.json_schema(schema)).result(timeout=60)
    assert caught.value.limit == limit
    assert limit in str(caught.value) and said in str(caught.value)
    assert compiler.stats()["entries"] == 0


def test_the_same_grammars_compile_under_default_limits(make_compiler):
    compiler = make_compiler()
    compiler.compile(GrammarSpec.json_schema(object_schema(490, False)))  # just under the row
    compiler.compile(GrammarSpec.json_schema(PATTERNED))


def test_a_compile_past_its_deadline_fails_and_is_remembered(make_compiler):
    compiler = make_compiler(compile_timeout_s=0.01)
    spec = GrammarSpec.json_schema(object_schema(3000, True))  # ~0.1 s or more
    started = time.perf_counter()
    with pytest.raises(GrammarTooComplex, match="compile_timeout_s") as caught:
        compiler.submit(spec).result(timeout=60)
    assert caught.value.limit == "compile_timeout_s"
    assert time.perf_counter() - started < 1.0  # failed at the deadline, not at the end
    assert compiler.stats()["timeouts"] == 1
    assert compiler.submit(spec).done()  # refused at once, no second compile
    assert compiler.stats()["compiles"] == 1


def test_a_late_result_is_dropped():
    """The compile that outlives its deadline finishes on its worker; its grammar is not kept."""
    release = threading.Event()

    def slow_build(spec):
        release.wait(10)
        return Sized(10)

    pool = CompilePool(slow_build, GrammarCache(1000), workers=1, timeout_s=0.05)
    late = pool.submit(GrammarSpec.regex("a"))
    with pytest.raises(GrammarTooComplex):
        late.result(timeout=5)
    release.set()
    after = pool.submit(GrammarSpec.regex("b"))  # one worker: runs after the late build ended
    assert after.result(timeout=5).nbytes == 10
    assert pool.cached(GrammarSpec.regex("a")) is None and len(pool.cache) == 1
    pool.close()


def test_close_fails_compiles_not_finished():
    release = threading.Event()

    def slow_build(spec):
        release.wait(10)
        return Sized(1)

    pool = CompilePool(slow_build, GrammarCache(1000), workers=1, timeout_s=30)
    running, queued = pool.submit(GrammarSpec.regex("a")), pool.submit(GrammarSpec.regex("b"))
    pool.close()
    release.set()
    for future in (running, queued):
        with pytest.raises(GrammarError, match="closed"):
            future.result(timeout=5)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_lexer_states"):
        GrammarLimits(max_lexer_states=0)
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarLimits(compile_timeout_s=-1.0)
    with pytest.raises(ValueError, match="max_items_in_row must be a positive int"):
        GrammarLimits(max_items_in_row=2.5)
    assert GrammarLimits(compile_timeout_s=1).compile_timeout_s == 1


# ---- off the engine loop ------------------------------------------------------------------------


def test_the_main_thread_keeps_ticking_while_a_big_schema_compiles(make_compiler):
    compiler = make_compiler(compile_timeout_s=120)
    spec = GrammarSpec.json_schema(object_schema(5500, True))  # ~0.5 s on one core
    future = compiler.submit(spec)
    started = last = time.perf_counter()
    max_gap = 0.0
    while not future.done():
        time.sleep(0.002)
        now = time.perf_counter()
        max_gap, last = max(max_gap, now - last), now
    assert isinstance(future.result(), CompiledGrammar)
    assert last - started > 0.1  # long enough for the ticks to mean something
    assert max_gap < 0.05, f"the main thread stalled {max_gap * 1000:.0f} ms"


# ---- the byte budget ----------------------------------------------------------------------------


@dataclass
class Sized:
    nbytes: int


def test_cache_evicts_least_recently_used_within_its_budget():
    cache = GrammarCache(100)
    for key in "abc":
        assert cache.put(key, Sized(30))
    assert cache.get("a") is not None  # a is now the most recent; b the least
    assert cache.put("d", Sized(30))
    assert cache.get("b") is None and [cache.get(k) is not None for k in "acd"] == [True] * 3
    assert cache.nbytes == 90
    assert cache.put("e", Sized(70))  # evicts c, then a (d stays: most recent after e)
    assert cache.nbytes == 100 and cache.get("d") is not None and cache.get("a") is None
    assert not cache.put("huge", Sized(101)) and cache.nbytes == 100  # alone over the budget
    cache.put("d", Sized(10))  # replacing an entry recounts it
    assert cache.nbytes == 80


def test_many_distinct_schemas_never_grow_the_cache_past_its_budget(make_compiler):
    budget = 2 << 20
    compiler = make_compiler(cache_bytes=budget)
    specs = [numbered(i) for i in range(24)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.stats()["bytes"] <= budget
    stats = compiler.stats()
    assert 0 < stats["entries"] < len(specs) and stats["compiles"] == len(specs)
    assert compiler.cached(specs[0]) is None and compiler.cached(specs[-1]) is not None


def test_refreshed_grammars_survive_eviction(make_compiler):
    compiler = make_compiler(cache_bytes=2 << 20)
    keep = numbered(100)
    compiler.compile(keep)
    for i in range(24):
        compiler.compile(numbered(i))
        assert compiler.cached(keep) is not None  # refreshed each time: never the oldest


def _heap_bytes():
    """Bytes glibc's malloc has handed out (all threads), or None off glibc."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema(object_schema(1500, True)),
        GrammarSpec.json_schema(object_schema(400, False)),
        GrammarSpec.json_schema(object_schema(300, True, {"type": "string", "pattern": "[a-z]+"})),
        GrammarSpec.json_schema({"enum": [f"value {i}" for i in range(1000)]}),
        GrammarSpec.regex(r"\d{4}-\d{2}-\d{2}"),
        GrammarSpec.lark('start: "yes" | "no"'),
    ],
    ids=["required", "optional", "patterns", "enum", "regex", "lark"],
)
def test_the_size_estimate_covers_the_measured_heap_growth(make_compiler, spec):
    if _heap_bytes() is None:
        pytest.skip("needs glibc's mallinfo2 to measure")
    compiler = make_compiler()
    compiler.compile(GrammarSpec.regex("warm-up"))  # the worker thread and its arena exist
    gc.collect()  # earlier tests' grammars are freed now, not while this one is measured
    before = _heap_bytes()
    grammar = compiler.compile(spec)
    grown = _heap_bytes() - before
    assert 0 < grown <= grammar.nbytes, (grown, grammar.nbytes)


def test_a_remembered_failure_does_not_keep_its_grammar(make_compiler):
    if _heap_bytes() is None:
        pytest.skip("needs glibc's mallinfo2 to measure")
    compiler = make_compiler()
    compiler.compile(GrammarSpec.regex("warm-up"))
    gc.collect()
    before = _heap_bytes()
    with pytest.raises(GrammarTooComplex):  # built (~2 MB), then refused by the probe
        compiler.compile(GrammarSpec.json_schema(object_schema(600, False)))
    gc.collect()
    assert _heap_bytes() - before < 256 << 10


# ---- the matcher's error state ------------------------------------------------------------------


def test_matcher_error_is_none_until_the_matcher_breaks(make_compiler, tokenizer):
    compiler = make_compiler()
    matcher = compiler.matcher(GrammarSpec.json_schema(object_schema(2, True)))
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)  # merely forbidden: no error
    assert matcher.error() is None
    assert not matcher.ll_matcher.consume_token(letter)  # forced past accept_token's check
    assert "doesn't satisfy the grammar" in matcher.error()
    assert "\n" not in matcher.error()


def test_a_step_limit_hit_while_decoding_is_reported_by_error(make_compiler):
    """What the probe refuses at compile time, met by a matcher made without the probe: the
    first token fails, and error() says why instead of a silent abort."""
    compiler = make_compiler()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(object_schema(600, False))
    ll_matcher = llguidance.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
    matcher = LLGuidanceMatcher(ll_matcher, VOCAB, frozenset(compiler.ll_tokenizer.eos_tokens))
    first = compiler.ll_tokenizer.tokenize_str("{")[0]
    assert not matcher.accept_token(first)
    assert "max is 2000" in matcher.error()


def test_futures_are_plain_concurrent_futures(make_compiler):
    compiler = make_compiler()
    assert isinstance(compiler.submit(GrammarSpec.regex("x")), Future)
