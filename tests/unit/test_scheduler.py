"""Scheduler and page allocator: admission, chunked prefill, preemption, abort, finish reasons."""

from __future__ import annotations

import subprocess
import sys

import pytest

from noesis.errors import OutOfKVCache
from noesis.kv.allocator import PageAllocator
from noesis.planner.scheduler import Scheduler, SchedulerConfig
from noesis.planner.sequence import FinishReason, Sequence, SequenceStatus
from noesis.sampling.params import SamplingParams

EOS = 1


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        token_ids=list(range(10, 10 + prompt_len)),
        prompt_len=prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        max_len=prompt_len + max_tokens,
        seed=seq_id,
        stop_ids=frozenset({EOS}),
    )


def make_scheduler(num_pages=64, page_size=4, max_seqs=8, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), PageAllocator(num_pages, page_size))


def run_step(sched: Scheduler, token: int = 7):
    plan = sched.schedule()
    sampled = {item.seq.seq_id: token for item in plan.scheduled if item.samples}
    return plan, sched.update(plan, sampled)


def test_planner_imports_no_torch():
    code = (
        "import sys; import noesis.planner.scheduler, noesis.kv.allocator; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocator_counts_and_refuses_overdraw():
    alloc = PageAllocator(4, page_size=16)
    pages = alloc.allocate(3)
    assert len(set(pages)) == 3 and alloc.num_free == 1
    with pytest.raises(MemoryError):
        alloc.allocate(2)
    alloc.free(pages)
    assert alloc.num_free == 4
    assert alloc.pages_for(0) == 0 and alloc.pages_for(16) == 1 and alloc.pages_for(17) == 2


def test_allocator_double_free_is_caught():
    alloc = PageAllocator(2, page_size=4)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError):
        alloc.free(pages)


def test_admission_fifo_and_prefill_then_decode():
    sched = make_scheduler()
    a, b = make_seq(0, 5), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    plan, _ = run_step(sched)
    assert [(i.seq.seq_id, i.num_tokens, i.samples) for i in plan.scheduled] == [
        (0, 5, True),
        (1, 3, True),
    ]
    assert a.num_computed == 5 and a.num_output == 1
    plan, _ = run_step(sched)
    assert [(i.seq.seq_id, i.num_tokens) for i in plan.scheduled] == [(0, 1), (1, 1)]
    assert len(a.pages) == 2  # 6 tokens computed, page size 4


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(budget=4)
    seq = make_seq(0, 10)
    sched.add(seq)
    chunks = []
    while seq.num_output == 0:
        plan, _ = run_step(sched)
        chunks.append([(i.num_tokens, i.samples) for i in plan.scheduled])
    assert chunks == [[(4, False)], [(4, False)], [(2, True)]]


def test_budget_shared_decode_first_then_new_prefill():
    sched = make_scheduler(budget=6)
    first = make_seq(0, 4)
    sched.add(first)
    run_step(sched)
    sched.add(make_seq(1, 20))
    plan, _ = run_step(sched)
    assert [(i.seq.seq_id, i.num_tokens) for i in plan.scheduled] == [(0, 1), (1, 5)]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, 2))
    plan, _ = run_step(sched)
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1


def test_waits_when_pages_run_out_then_admits():
    sched = make_scheduler(num_pages=3, page_size=4, max_seqs=8)
    a, b = make_seq(0, 8, max_tokens=2), make_seq(1, 8, max_tokens=2)
    sched.add(a)
    sched.add(b)
    plan, _ = run_step(sched)
    assert [i.seq.seq_id for i in plan.scheduled] == [0]  # b needs 2 pages, 1 free
    while not a.finished:
        run_step(sched)
    plan, _ = run_step(sched)
    assert [i.seq.seq_id for i in plan.scheduled] == [1]


def test_preemption_frees_newest_and_recomputes_later():
    sched = make_scheduler(num_pages=4, page_size=4, max_seqs=8)
    a, b = make_seq(0, 7, max_tokens=6), make_seq(1, 7, max_tokens=6)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 pages each, pool full
    plan, _ = run_step(sched)  # a's 8th token fits its page; b's too
    plan, _ = run_step(sched)  # a needs a 3rd page: b is preempted
    assert b in plan.preempted and b.status is SequenceStatus.WAITING
    assert b.num_computed == 0 and b.pages == [] and b.num_preemptions == 1
    assert [i.seq.seq_id for i in plan.scheduled] == [0]
    generated_before = b.num_output
    while not a.finished:
        run_step(sched)
    plan, _ = run_step(sched)
    # b comes back and recomputes prompt + what it had generated, in one prefill
    assert plan.scheduled[0].seq is b
    assert plan.scheduled[0].num_tokens == 7 + generated_before


def test_finish_reasons_stop_length_and_abort():
    sched = make_scheduler()
    stop, length, abort = make_seq(0, 2), make_seq(1, 2, max_tokens=2), make_seq(2, 2)
    for seq in (stop, length, abort):
        sched.add(seq)
    plan = sched.schedule()
    finished = sched.update(plan, {0: EOS, 1: 5, 2: 5})
    assert finished == [stop] and stop.finish_reason is FinishReason.STOP
    sched.finish(abort, FinishReason.ABORT)
    assert abort.finish_reason is FinishReason.ABORT and abort not in sched.running
    _, finished = run_step(sched)
    assert finished == [length] and length.finish_reason is FinishReason.LENGTH
    assert length.num_output == 2
    assert sched.allocator.num_free == sched.allocator.num_pages
    assert not sched.has_unfinished()


def test_abort_waiting_sequence():
    sched = make_scheduler(max_seqs=1)
    a, b = make_seq(0, 2), make_seq(1, 2)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b, FinishReason.ABORT)
    assert b not in sched.waiting and b.finished


def test_request_larger_than_pool_is_refused():
    sched = make_scheduler(num_pages=2, page_size=4)
    with pytest.raises(OutOfKVCache, match="KV pages"):
        sched.add(make_seq(0, 6, max_tokens=8))


# ---- overlapped steps: advance when launched, resolve when read back -----------------------------


def launch(sched: Scheduler):
    """Plan a step and launch it: advanced, not read back."""
    plan = sched.schedule()
    sched.advance(plan)
    return plan


def one_running(prompt_len: int, max_tokens: int = 8) -> tuple[Scheduler, Sequence]:
    sched = make_scheduler()
    seq = make_seq(0, prompt_len, max_tokens)
    sched.add(seq)
    return sched, seq


def test_a_pending_token_is_planned_before_it_is_known():
    sched, seq = one_running(prompt_len=5, max_tokens=3)
    first = launch(sched)
    assert seq.num_pending == 1 and seq.num_tokens == 6 and len(seq.token_ids) == 5
    second = sched.schedule()  # planned on the pending token
    [item] = second.scheduled
    assert item.num_tokens == 1 and item.samples and seq.num_computed == 5
    sched.advance(second)
    assert seq.num_pending == 2 and seq.num_output == 2
    # the third token would reach max_len: nothing more to plan until the reads come back
    third = launch(sched)
    assert seq.num_tokens == seq.max_len and not sched.schedule().scheduled
    for plan, token in ((first, 20), (second, 21), (third, 22)):
        sched.resolve(plan, {seq.seq_id: token})
    assert seq.token_ids[5:] == [20, 21, 22] and seq.finish_reason is FinishReason.LENGTH
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_a_stop_read_back_drops_the_token_planned_after_it():
    sched, seq = one_running(prompt_len=4)
    first, second = launch(sched), launch(sched)
    assert sched.resolve(first, {seq.seq_id: EOS}) == [seq]
    assert seq.finish_reason is FinishReason.STOP and seq.num_pending == 0
    assert sched.resolve(second, {seq.seq_id: 33}) == []  # dropped: the sequence had stopped
    assert seq.token_ids[4:] == [EOS]
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_a_sequence_preempted_with_a_pending_token_waits_for_it():
    sched, seq = one_running(prompt_len=4)
    plan = launch(sched)
    sched._preempt(seq)  # as when another sequence needs its pages
    assert not sched.schedule().scheduled  # not readmitted while its token is unknown
    sched.resolve(plan, {seq.seq_id: 9})
    readmitted = sched.schedule()
    assert [i.num_tokens for i in readmitted.scheduled] == [5]  # recomputed with its token
