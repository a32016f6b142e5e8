"""Token bitmasks: bit order as llguidance's, batched application, the background MaskFiller, and
sampling through noesis.sampling that never leaves the allowed set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from noesis.sampling.sampler import SamplingTensors, sample
from noesis.structured import (
    GrammarCompiler,
    GrammarSpec,
    MaskFiller,
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_width,
)
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
VOCAB = 8192 + 40  # padded model vocabulary
SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["km", "mile"]}, "value": {"type": "number"}},
    "required": ["unit", "value"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer, VOCAB)


def matchers_at_various_states(compiler, tokenizer):
    """Four matchers of different grammars, some advanced a few tokens."""
    prefixes = [("", SCHEMA), ('{"unit": "', SCHEMA), ('{"unit": "km", "value": 1', SCHEMA)]
    out = []
    for prefix, schema in prefixes:
        matcher = compiler.matcher(GrammarSpec.json_schema(schema))
        assert all(matcher.accept_token(t) for t in tokenizer.encode(prefix, False))
        out.append(matcher)
    out.append(compiler.matcher(GrammarSpec.regex(r"[0-9]{3}-[a-z]+")))
    return out


def test_bit_order_matches_llguidance_torch_helper(monkeypatch):
    llguidance_torch = pytest.importorskip("llguidance.torch")
    # llguidance's own kernel as written, not torch.compile'd: an Inductor build of it took
    # seconds of the CPU tier for the same arithmetic.
    kernel = llguidance_torch.apply_token_bitmask_inplace_kernel
    monkeypatch.setattr(
        llguidance_torch,
        "apply_token_bitmask_inplace_kernel",
        getattr(kernel, "_torchdynamo_orig_callable", kernel),
    )
    generator = torch.Generator().manual_seed(0)
    for vocab in (31, 32, 33, 1000):
        words = bitmask_width(vocab)
        bitmask = torch.randint(
            -(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=generator
        )
        bitmask[0, 0] = -(2**31)  # only bit 31 set: the sign bit must count as token 31
        logits = torch.randn(3, vocab, generator=generator)
        expected = logits.clone()
        llguidance_torch.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(apply_token_bitmask_(logits, bitmask), expected)


def test_filled_mask_agrees_with_llguidance_per_token_bias(compiler, tokenizer):
    """The packed bitmask and llguidance's one-byte-per-token bias allow the same tokens."""
    for matcher in matchers_at_various_states(compiler, tokenizer):
        bitmask = allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.zeros(1, VOCAB)
        allowed = torch.isfinite(apply_token_bitmask_(logits, bitmask))[0]
        bias = matcher.ll_matcher.compute_logit_bias()
        expected = torch.frombuffer(bytearray(bias), dtype=torch.uint8) > 0
        assert allowed[: len(expected)].tolist() == expected.tolist()
        assert not allowed[len(expected) :].any()
        assert 0 < int(allowed.sum()) < VOCAB


def test_apply_is_batched_and_rows_of_ones_allow_everything():
    logits = torch.randn(3, 70)
    bitmask = allocate_token_bitmask(3, 70)
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 3  # token 67 only
    out = apply_token_bitmask_(logits.clone(), bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [67]


def test_apply_rejects_a_mismatched_bitmask():
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_(torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))


def test_mask_filler_matches_per_matcher_fill(compiler, tokenizer):
    matchers = matchers_at_various_states(compiler, tokenizer)
    rows = [matchers[0], None, matchers[1], matchers[2], None, matchers[3]]
    expected = allocate_token_bitmask(len(rows), VOCAB)
    for i, matcher in enumerate(rows):
        if matcher is not None:
            matcher.fill_next_token_bitmask(expected, i)
    filler = MaskFiller(VOCAB, max_batch_size=8)
    try:
        for _ in range(3):  # buffers alternate between steps
            filler.start(rows)
            assert torch.equal(filler.result("cpu"), expected)
        filler.start([None, None])
        assert filler.result("cpu") is None  # no grammar in the batch: nothing to apply
        with pytest.raises(RuntimeError, match="without start"):
            filler.result("cpu")
        filler.start(rows)
        with pytest.raises(RuntimeError, match="twice"):
            filler.start(rows)
        filler.result("cpu")
        with pytest.raises(ValueError, match="exceeds"):
            filler.start([None] * 9)
    finally:
        filler.close()


def test_mask_filler_fills_on_the_calling_thread_too(compiler, tokenizer):
    """fill() (the path once the previous step is read back) gives start() + result()'s mask,
    alternates the same buffers, and refuses to run between a start and its result."""
    matchers = matchers_at_various_states(compiler, tokenizer)
    rows = [None, matchers[2], matchers[0], None, matchers[3]]
    filler = MaskFiller(VOCAB, max_batch_size=8)
    try:
        filler.start(rows)
        expected = filler.result("cpu").clone()
        first, second = filler.fill(rows, "cpu"), filler.fill(rows, "cpu")
        assert torch.equal(first, expected) and torch.equal(second, expected)
        assert first.data_ptr() != second.data_ptr()  # the other buffer: a copy may be in flight
        assert filler.fill([None, None], "cpu") is None
        filler.start(rows)
        with pytest.raises(RuntimeError, match="between start"):
            filler.fill(rows, "cpu")
        filler.result("cpu")
        with pytest.raises(ValueError, match="exceeds"):
            filler.fill([None] * 9, "cpu")
    finally:
        filler.close()


class OnlyToken:
    """A GrammarMatcher that is not llguidance's: allows one token id, forever."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def accept_token(self, token_id: int) -> bool:
        return token_id == self.token_id

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        word, bit = divmod(self.token_id, 32)
        bitmask[row, word] = torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def is_accepting(self) -> bool:
        return True

    def reset(self) -> None:
        pass


def test_mask_filler_serves_any_grammar_matcher(compiler, tokenizer):
    llguidance_row = matchers_at_various_states(compiler, tokenizer)[1]
    rows = [OnlyToken(63), llguidance_row, OnlyToken(VOCAB - 1)]
    filler = MaskFiller(VOCAB, max_batch_size=4)
    filler.start(rows)
    bitmask = filler.result("cpu")
    filler.close()
    allowed = torch.isfinite(apply_token_bitmask_(torch.zeros(3, VOCAB), bitmask))
    assert allowed[0].nonzero().flatten().tolist() == [63]  # bit 31 of word 1
    assert allowed[2].nonzero().flatten().tolist() == [VOCAB - 1]
    expected = allocate_token_bitmask(1, VOCAB)
    llguidance_row.fill_next_token_bitmask(expected, 0)
    assert torch.equal(bitmask[1], expected[0])


def sampling_tensors(batch: int, seed: int, temperature: float) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((batch,), temperature),
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=torch.arange(seed, seed + batch, dtype=torch.int64),
        steps=torch.zeros(batch, dtype=torch.int64),
        all_greedy=temperature == 0,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_masked_rows_sample_only_allowed_tokens(compiler, tokenizer, temperature):
    matchers = matchers_at_various_states(compiler, tokenizer)
    rows = [matchers[0], None, matchers[1], matchers[2], matchers[3]]
    filler = MaskFiller(VOCAB, max_batch_size=len(rows))
    filler.start(rows)
    bitmask = filler.result("cpu")
    filler.close()
    allowed = torch.isfinite(apply_token_bitmask_(torch.zeros(len(rows), VOCAB), bitmask))
    # Random logits that favour disallowed tokens: the mask alone must keep them out.
    for seed in range(40):
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
        logits = logits + 30.0 * (~allowed).float()
        token_ids = sample(
            apply_token_bitmask_(logits, bitmask),
            sampling_tensors(len(rows), seed * 100, temperature),
        ).token_ids
        for row, token in enumerate(token_ids.tolist()):
            assert allowed[row, token], (row, token)
            if rows[row] is not None:
                assert rows[row].accept_token(token)
                rows[row].rollback(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_copies_applies_and_samples_without_host_sync(compiler, tokenizer):
    matchers = matchers_at_various_states(compiler, tokenizer)
    rows = [matchers[0], None, matchers[1], matchers[2], matchers[3]]
    filler = MaskFiller(VOCAB, max_batch_size=8)
    logits = torch.randn(len(rows), VOCAB, device="cuda")
    t = sampling_tensors(len(rows), 7, 1.0)
    t = SamplingTensors(
        t.temperature.cuda(), None, None, None, t.seeds.cuda(), t.steps.cuda(), all_greedy=False
    )
    outputs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            filler.start(rows)
            bitmask = filler.result("cuda")
            masked = apply_token_bitmask_(logits.clone(), bitmask)
            outputs.append((bitmask, masked, sample(masked, t).token_ids))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        filler.close()
    expected_mask = allocate_token_bitmask(len(rows), VOCAB)
    for i, matcher in enumerate(rows):
        if matcher is not None:
            matcher.fill_next_token_bitmask(expected_mask, i)
    expected = apply_token_bitmask_(logits.cpu(), expected_mask)
    for bitmask, masked, token_ids in outputs:
        assert torch.equal(bitmask.cpu(), expected_mask)
        assert torch.equal(masked.cpu(), expected)
        assert torch.isfinite(expected.gather(1, token_ids.cpu()[:, None])).all()
