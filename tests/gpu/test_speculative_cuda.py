"""Speculative decoding on CUDA (the lent GPU): with graphs captured and steps overlapped (the CUDA
defaults), greedy output with the draft or prompt lookup speculating equals plain greedy in
float32, and in bfloat16 the share of identical requests is reported (a near-tie may flip where
the verify and decode kernels round differently). Every verify step replays the target's decode
graphs and the draft's proposal steps replay its own (counted).
`pytest -m gpu tests/gpu/test_speculative_cuda.py -s`
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODELS = Path(__file__).resolve().parents[2] / "models"
TEXTS = [
    "Once upon a time, the little robot",
    "A week has seven days. A year",
    "The ocean is salty, but most rivers",
    "The capital of France is",
] * 2


def run(dtype: str, speculative, temperature: float = 0.0, **options):
    from noesis import LLM, SamplingParams

    if speculative is not None:
        options["speculative"] = speculative
    llm = LLM(
        str(MODELS / "noesis-tiny"),
        device="cuda",
        dtype=dtype,
        progress=False,
        max_model_len=512,
        max_num_seqs=8,
        **options,
    )
    prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
    engine = llm.engine
    counts = dict(engine.spec_counts)
    assert engine.allocator.num_used == 0
    runner = engine.runner
    counts["verify_graph"] = runner.verify_counts["graph"]
    counts["verify_eager"] = runner.verify_counts["eager"]
    if runner.graphs is not None:  # every graph step is one replay
        assert runner.graphs.replays == runner.step_counts["graph"]
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    graphs = getattr(proposer, "graphs", None)
    counts["draft_replays"] = graphs.replays if graphs is not None else 0
    return [o.token_ids for o in outs], counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["draft", "draft-cut", "ngram"])
def test_greedy_speculation_matches_plain_on_cuda(dtype, method):
    """draft-cut: the draft's LM head cut to 2,048 of its 8,192 rows (draft_vocab)."""
    from noesis import SpeculativeConfig

    vocab = 2048 if method == "draft-cut" else None
    method = method.removesuffix("-cut")
    draft = str(MODELS / "noesis-tiny-draft") if method == "draft" else None
    config = SpeculativeConfig(method=method, draft=draft, k=4, draft_vocab=vocab)
    plain, _ = run(dtype, None)
    speculated, counts = run(dtype, config)
    identical = sum(a == b for a, b in zip(plain, speculated, strict=True))
    print(f"{method} {dtype}: {identical}/{len(plain)} identical, {counts}")
    assert counts["verify_rows"] > 0
    # Graph rows fit 8 sequences with 4 proposals each: no verify step runs eagerly.
    assert counts["verify_graph"] > 0 and counts["verify_eager"] == 0
    if method == "draft":  # a prompt's first feed runs eagerly, later proposal steps replay
        assert counts["draft_replays"] > counts["verify_graph"]
    if dtype == "float32":
        assert identical == len(plain)


def test_verify_graph_replay_equals_eager_verify():
    """Greedy float32 with the draft: graphs on (verify and draft replays) gives what the same
    engine gives with every step eager."""
    from noesis import SpeculativeConfig

    config = SpeculativeConfig(method="draft", draft=str(MODELS / "noesis-tiny-draft"), k=4)
    replayed, counts = run("float32", config)
    eager, eager_counts = run("float32", config, cuda_graphs=False)
    assert counts["verify_graph"] > 0 and eager_counts["verify_graph"] == 0
    assert replayed == eager


def test_sampled_speculation_runs_and_is_reproducible_on_cuda():
    from noesis import SpeculativeConfig

    config = SpeculativeConfig(method="draft", draft=str(MODELS / "noesis-tiny-draft"), k=4)
    first, counts = run("bfloat16", config, temperature=0.8)
    again, _ = run("bfloat16", config, temperature=0.8)
    assert first == again and counts["accepted"] > 0
