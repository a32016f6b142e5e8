"""Batch-invariant mode on the CPU: one request's tokens and logits are bitwise the same alone
(one-shot prefill) and inside batches of 3 and 8 with other traffic (chunked prefill,
preemption); a trace recorded in a busy batch replays one request alone. The Triton kernels
of the CUDA path keep a row's result whatever shares the call, under Triton's interpreter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before Triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

from noesis import SamplingParams
from noesis.engine.engine import Engine, EngineConfig
from noesis.errors import ConfigError
from noesis.kv.cache import page_bytes
from noesis.models.config import ModelConfig
from noesis.telemetry import TraceError
from noesis.telemetry.replay import replay, replay_alone
from noesis.telemetry.trace import load_trace

TARGET_PROMPT = list(range(40, 80))  # 40 tokens: several 16-token chunks when busy
TARGETS = {
    "greedy": SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
}
OTHER_PROMPTS = [[3, 14, 15, 92, 65], list(range(100, 131)), [7] * 11, [0, 5, 9, 77, 100, 21],
                 list(range(200, 223)), [1, 2, 3] * 6, list(range(300, 309))]  # fmt: skip


def other_params(index: int) -> SamplingParams:
    if index % 2:
        return SamplingParams(temperature=0, max_tokens=6 + index, ignore_eos=True)
    return SamplingParams(temperature=1.0, top_k=20, seed=index, max_tokens=5 + 2 * index,
                          ignore_eos=True)


class TargetLogits:
    """A signal hook keeping the targets' logit rows: (request id, output index) -> [V]."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, logits, seqs) -> dict:
        for row, seq in enumerate(seqs):
            if seq.request_id in TARGETS:
                self.rows[(seq.request_id, seq.num_output)] = logits[row].clone()
        return {}


def make_engine(model: Path, invariant: bool, busy: bool, **options) -> Engine:
    """busy: 16-token steps (prompts prefill in chunks) and a 7-page pool (preemption)."""
    if busy:
        pool = 7 * page_bytes(ModelConfig.from_hf(json.loads((model / "config.json").read_text())),
                              16, torch.float32)
        options.update(max_num_batched_tokens=16, kv_cache_memory=pool)
    return Engine(str(model), EngineConfig(device="cpu", dtype="float32", progress=False,
                                           batch_invariant=invariant, **options))


def run(engine: Engine, others: int) -> tuple[dict, dict, int]:
    """The targets among `others` other requests arriving over several steps: (tokens per
    target, their logit rows, preemptions)."""
    hook = TargetLogits()
    engine.runner.signal_hooks.append(hook)
    arrivals = {0: list(range(others // 2)), 2: ["greedy", "seeded"],
                4: list(range(others // 2, others))}
    outputs, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for item in arrivals.get(step, []):
            if isinstance(item, str):
                engine.add_request(TARGET_PROMPT, TARGETS[item], item)
            else:
                engine.add_request(OTHER_PROMPTS[item], other_params(item), f"o{item}")
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    engine.runner.signal_hooks.remove(hook)
    tokens = {name: outputs[name].token_ids for name in TARGETS}
    preemptions = sum(out.num_preemptions for out in outputs.values())
    return tokens, hook.rows, preemptions


@pytest.fixture(scope="module")
def model(checkpoints) -> Path:
    return checkpoints.path("llama")


def test_tokens_and_logits_do_not_depend_on_the_batch(model, capsys):
    alone = run(make_engine(model, True, busy=False), others=0)
    busy = make_engine(model, True, busy=True)
    for others in (2, 7):  # batches of 3 and 8 with the targets
        tokens, logits, preemptions = run(busy, others)
        assert tokens == alone[0], f"batch of {others + 1}"
        assert logits.keys() == alone[1].keys()
        for key, row in logits.items():
            assert torch.equal(row, alone[1][key]), f"batch of {others + 1}: {key}"
        if others == 7:
            assert preemptions > 0  # the 7-page pool preempted someone
    # The default mode, shown and not asserted: whether the same runs differ there.
    default_alone = run(make_engine(model, False, busy=False), others=0)
    default_busy = run(make_engine(model, False, busy=True), others=7)
    gap = max((default_busy[1][k] - default_alone[1][k]).abs().max().item()
              for k in default_alone[1])
    with capsys.disabled():
        print(f"\ndefault mode, alone vs batch of 8: tokens "
              f"{'equal' if default_busy[0] == default_alone[0] else 'differ'}, "
              f"largest logit difference {gap:.3g}")


def test_busy_trace_replays_one_request_alone(model, tmp_path):
    trace = tmp_path / "busy.trace"
    engine = make_engine(model, True, busy=True, deterministic=True, trace=str(trace))
    tokens, _, _ = run(engine, others=7)
    engine.close()
    for request_id in TARGETS:
        report = replay(trace, request_id=request_id)
        assert report.ok, report.divergence.describe()
        assert report.tokens == len(tokens[request_id]) and report.requests == 1
    with pytest.raises(TraceError, match="no request 'nobody'"):
        replay(trace, request_id="nobody")


def test_without_the_mode_a_request_replays_in_its_recorded_batches(model, tmp_path):
    """A default-mode trace: the request cannot replay alone, so `--request` replays the
    traffic it shared batches with, up to its end, and finds an edited token of it."""
    trace = tmp_path / "default.trace"
    engine = make_engine(model, False, busy=False, deterministic=True, trace=str(trace))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3), "a")
    engine.add_request([4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=12), "b")
    while engine.has_unfinished():
        engine.step()
    engine.close()
    recorded = load_trace(trace)
    with pytest.raises(TraceError, match="batch_invariant"):
        replay_alone(recorded, "a")
    report = replay(trace, request_id="a")
    assert report.ok, report.divergence.describe()
    assert report.requests == 2 and report.steps == 3 < len(recorded.of_kind("step"))
    lines = trace.read_text().splitlines()
    edited = next(i for i, line in enumerate(lines) if '"kind":"tokens"' in line)
    record = json.loads(lines[edited])
    record["out"] = [[rid, [ids[0] + 1] if rid == "a" else ids] for rid, ids in record["out"]]
    lines[edited] = json.dumps(record)
    trace.write_text("\n".join(lines) + "\n")
    divergence = replay(trace, request_id="a").divergence
    assert (divergence.what, divergence.request_id, divergence.index) == ("token", "a", 0)


def test_short_convolution_models_are_refused(checkpoints):
    with pytest.raises(ConfigError, match="short-convolution"):
        Engine(str(checkpoints.path("lfm2")), EngineConfig(device="cpu", progress=False,
                                                           batch_invariant=True))




# ---- the CUDA path's kernels, under Triton's interpreter on the CPU -----------------------------


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    from noesis.kernels import batch_invariant

    return batch_invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 dot
def test_matmul_row_does_not_depend_on_m(kernels, dtype):  # is broken: float16 stands in
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(70, 80, generator=gen)
    weight, bias, x = weight.to(dtype), bias.to(dtype), x.to(dtype)
    full = kernels.linear(x, weight, bias)  # two row tiles of 64
    # Each slice keeps its rows' places in their tiles: the interpreter's tl.dot is numpy's
    # matmul, which rounds a row by its place in the tile (the GPU's MMA does not).
    for rows in (slice(0, 1), slice(0, 9), slice(0, 64), slice(64, 70)):
        part = kernels.linear(x[rows], weight, bias)
        assert torch.equal(part, full[rows]), rows
    reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert (full.float() - reference).abs().max() <= (1e-4 if dtype == torch.float32 else 0.05)


def test_split_k_matmul_sums_fixed_ranges_in_order_whatever_m(kernels):
    """A weight whose K splits in 2 (one 64-wide BLOCK_K step each here, the second short): a
    row's output is the same alone and in batches of 6 and 70, and it is exactly
    (range 0 + range 1) + bias, each range reduced on its own as an unsplit call does."""
    split, whole = kernels.MatmulConfig(64, 2, 4, 4, 64), kernels.MatmulConfig(64, 1, 4, 4, 64)
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 100, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(70, 100, generator=gen)
    full = kernels.linear(x, weight, bias, config=split)
    for rows in (slice(0, 1), slice(64, 70)):  # alone, 6 rows: places in their tiles kept
        assert torch.equal(kernels.linear(x[rows], weight, bias, config=split), full[rows]), rows
    ranges = [kernels.linear(x[:, :64], weight[:, :64], config=whole),
              kernels.linear(x[:, 64:], weight[:, 64:], config=whole)]
    assert torch.equal(full, (ranges[0] + ranges[1]) + bias)
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert (full - reference).abs().max() <= 1e-4


def test_matmul_config_depends_on_the_weight_and_fills_the_sms(kernels, monkeypatch):
    """On a 132-SM device with no measured tiling: the widest column tile that gives most SMs
    a program (the 8B shape's projections then never split K, as measured best on an H100),
    K split only where 32-column tiles leave SMs idle, and never below 4 BLOCK_K steps; a
    measured tiling for the device wins."""
    monkeypatch.setattr(kernels, "_num_programs", lambda device: 132)
    monkeypatch.setattr(kernels, "_tuned_configs", lambda gpu: {"4096,4096": [64, 2, 4, 4, 64]})
    cpu = torch.device("cpu")
    tilings = {(n, k): (kernels.matmul_config(n, k, cpu).block_n,
                        kernels.matmul_config(n, k, cpu).splits)
               for n, k in [(6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                            (2048, 8192), (1024, 4096), (1024, 1024), (4096, 4096)]}
    assert tilings == {(6144, 4096): (64, 1), (28672, 4096): (128, 1), (4096, 14336): (32, 1),
                       (128256, 4096): (128, 1), (2048, 8192): (32, 2), (1024, 4096): (32, 4),
                       (1024, 1024): (32, 2), (4096, 4096): (64, 2)}


def test_attention_row_is_the_same_in_a_chunk_a_prefill_and_a_decode(kernels, monkeypatch):
    """Token 37 of a sequence: in a 6-token chunk, as a lone decode, beside another sequence;
    and each of window, sinks and soft-capping against the plain math."""
    monkeypatch.setattr(kernels, "KV_BLOCK", 16)  # three key blocks for 40 positions
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, page_size, length = 2, 1, 16, 8, 40
    k_cache, v_cache = torch.randn(2, 12, page_size, kv_heads, dim, generator=gen)
    table = torch.randperm(12, generator=gen)[:5]
    tables = torch.stack([torch.randperm(12, generator=gen)[:5], table])
    q = torch.randn(length, heads, dim, generator=gen)

    def attend(rows, seqs, **extras):
        ctx = torch.tensor([r + 1 for r in rows])
        return kernels.paged_attention(q[rows], k_cache, v_cache, torch.tensor(seqs), tables,
                                       ctx, 0.25, **extras)

    chunk = attend(list(range(34, 40)), [1] * 6)
    alone = attend([37], [1])
    mixed = attend([5, 37], [0, 1])
    assert torch.equal(alone[0], chunk[3]) and torch.equal(mixed[1], chunk[3])
    sinks = torch.randn(heads, generator=gen)
    for extras in ({}, {"window": 20}, {"sinks": sinks}, {"softcap": 5.0}):
        got = attend([37, 12], [1, 1], **extras)
        for index, row in enumerate([37, 12]):
            want = reference_attention(q[row], k_cache, v_cache, table, row + 1, 0.25, **extras)
            assert (got[index] - want).abs().max() <= 1e-5, extras


def reference_attention(q, k_cache, v_cache, table, ctx, scale, window=None, sinks=None,
                        softcap=None):
    """One query [H, d] over its first `ctx` keys, in plain float64 math."""
    group = q.shape[0] // k_cache.shape[2]
    keys = k_cache[table].flatten(0, 1)[:ctx].repeat_interleave(group, 1).double()  # [L, H, d]
    values = v_cache[table].flatten(0, 1)[:ctx].repeat_interleave(group, 1).double()
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[:, : max(ctx - window, 0)] = float("-inf")
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    probs = scores.softmax(-1)[:, :ctx]
    return torch.einsum("hl,lhd->hd", probs, values).float()
