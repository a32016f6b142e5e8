"""Prefix cache: chained page hashes, shared refcounted pages, LRU eviction, scheduler use."""

from __future__ import annotations

from noesis import SamplingParams
from noesis.kv.allocator import PageAllocator
from noesis.kv.prefix_cache import PrefixCache, chain_hashes
from noesis.planner.scheduler import Scheduler, SchedulerConfig
from noesis.planner.sequence import FinishReason, Sequence

PAGE = 4


def make_seq(seq_id: int, token_ids: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(
        seq_id,
        f"r{seq_id}",
        list(token_ids),
        len(token_ids),
        SamplingParams(max_tokens=max_tokens),
        len(token_ids) + max_tokens,
        seed=seq_id,
        stop_ids=frozenset({1}),
    )


def make_scheduler(num_pages: int = 32, budget: int = 64) -> Scheduler:
    allocator = PageAllocator(num_pages, PAGE)
    return Scheduler(SchedulerConfig(8, budget), allocator, PrefixCache(allocator))


def run_to_end(sched: Scheduler, token: int = 7) -> None:
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, {item.seq.seq_id: token for item in plan.scheduled if item.samples})


def test_hash_of_a_page_covers_its_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE, [], 2)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], PAGE, [], 2)
    assert a == chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 99], PAGE, [], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different prefix


def test_allocator_parks_kept_pages_and_evicts_them_last():
    alloc = PageAllocator(3, PAGE)
    evicted = []
    alloc.on_evict = evicted.append
    kept, plain = alloc.allocate(2)
    alloc.keep(kept)
    alloc.free([kept, plain])
    assert alloc.num_free == 3 and alloc.num_parked == 1 and alloc.num_used == 0
    alloc.share(kept)  # reused from the cache: no longer evictable
    assert alloc.num_parked == 0 and alloc.num_used == 1
    alloc.free([kept])
    assert sorted(alloc.allocate(2)) != [kept, kept] and evicted == []  # free list first
    assert alloc.allocate(1) == [kept] and evicted == [kept]  # then the parked page


def test_second_request_starts_on_the_cached_prefix():
    sched = make_scheduler()
    prompt = list(range(10, 20))  # 10 tokens: 2 full pages
    first = make_seq(0, prompt)
    sched.add(first)
    sched.schedule()
    first_pages = first.pages[:2]
    run_to_end(sched)
    cache = sched.prefix_cache
    assert cache.hit_tokens == 0 and cache.num_pages >= 2
    second = make_seq(1, prompt + [30, 31])
    sched.add(second)
    plan = sched.schedule()
    assert second.num_computed == 8 and second.pages[:2] == first_pages
    assert plan.scheduled[0].num_tokens == 4 and cache.hit_tokens == 8
    run_to_end(sched)
    assert sched.allocator.num_used == 0


def test_identical_prompt_recomputes_only_its_last_token():
    sched = make_scheduler()
    prompt = list(range(10, 18))  # exactly 2 pages
    sched.add(make_seq(0, prompt))
    run_to_end(sched)
    again = make_seq(1, prompt)
    sched.add(again)
    plan = sched.schedule()
    assert again.num_computed == 4 and plan.scheduled[0].num_tokens == 4  # last page recomputed
    run_to_end(sched)


def test_shared_pages_are_refcounted_across_running_sequences():
    sched = make_scheduler()
    prompt = list(range(10, 19))
    sched.add(make_seq(0, prompt, max_tokens=1))
    run_to_end(sched)
    a, b = make_seq(1, prompt + [1, 2]), make_seq(2, prompt + [3, 4])
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.pages[:2] == b.pages[:2]
    sched.finish(a, FinishReason.ABORT)
    assert sched.allocator.num_parked == 0  # b still holds the shared pages
    sched.finish(b, FinishReason.ABORT)
    assert sched.allocator.num_used == 0 and sched.allocator.num_parked >= 2


def test_eviction_forgets_the_hash():
    sched = make_scheduler(num_pages=4)
    sched.add(make_seq(0, list(range(10, 19)), max_tokens=1))
    run_to_end(sched)
    assert sched.prefix_cache.num_pages == 2
    sched.add(make_seq(1, list(range(50, 64)), max_tokens=2))  # needs all 4 pages
    run_to_end(sched)
    assert sched.prefix_cache.num_pages <= 4
    again = make_seq(2, list(range(10, 19)))
    sched.add(again)
    sched.schedule()
    assert again.num_computed == 0  # its pages were reused for the other prompt


def test_failed_admission_gives_matched_pages_back():
    sched = make_scheduler(num_pages=6)
    prompt = list(range(10, 19))
    sched.add(make_seq(0, prompt, max_tokens=1))
    run_to_end(sched)  # 2 pages cached (parked), 4 on the free list
    blocker = make_seq(1, list(range(60, 69)), max_tokens=1)
    sched.add(blocker)
    sched.schedule()  # takes 3 free pages: 1 free + 2 parked left
    waiting = make_seq(2, prompt + list(range(70, 76)), max_tokens=1)  # 2 cached + 2 new: no
    sched.add(waiting)
    plan = sched.schedule()
    assert waiting not in [item.seq for item in plan.scheduled]
    assert waiting.pages == [] and waiting.num_computed == 0
    assert sched.allocator.num_parked == 2


def test_engine_reuses_prefix_with_identical_greedy_tokens(checkpoints):
    llm = checkpoints.new_llm("llama", enable_prefix_caching=True, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompt = list(range(20, 47))
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    cache = llm.engine.prefix_cache
    assert cache.hit_tokens == 24
    assert second.token_ids == first.token_ids
    for a, b in zip(first.logprobs, second.logprobs, strict=True):
        assert all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    longer = llm.generate([prompt + first.token_ids], params)[0]  # a second chat turn
    assert cache.hit_tokens == 24 + 36
    plain = checkpoints.llm("llama").generate([prompt + first.token_ids], params)[0]
    assert longer.token_ids == plain.token_ids
    assert llm.engine.allocator.num_used == 0
