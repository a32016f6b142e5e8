"""Per-token metrics (noesis.sampling.metrics): exact against a float64 reference on masked rows,
the sampled tokens unchanged by asking for them, and RequestOutput.token_metrics end to end
against the transformers model's own logits."""

import math

import pytest
import torch

from noesis import SamplingParams  # noqa: E402
from noesis.errors import InvalidSamplingParams
from noesis.sampling.metrics import METRICS_TOP_K, TokenMetrics, reference_metrics, token_metrics
from noesis.sampling.sampler import SamplingTensors, sample


def reference(row: torch.Tensor) -> list[float]:
    """The four metrics of one row, in float64, over its allowed (finite) tokens only."""
    allowed = row[torch.isfinite(row)].double()
    logp = allowed - torch.logsumexp(allowed, dim=0)
    p = logp.exp()
    entropy = float(-(p * logp).sum())
    varentropy = float((p * (logp + entropy) ** 2).sum())
    top = p.sort(descending=True).values
    second = float(top[1]) if len(top) > 1 else 0.0
    return [entropy, varentropy, float(top[:METRICS_TOP_K].sum()), float(top[0]) - second]


def test_metrics_match_a_float64_reference_on_masked_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    logits[1, 7:] = float("-inf")  # a grammar mask leaving 7 tokens
    logits[2, 1:] = float("-inf")  # one token: no uncertainty at all
    logits[3] = 0.0  # uniform
    got = token_metrics(logits)
    for row in range(4):
        assert got[row].tolist() == pytest.approx(reference(logits[row]), abs=1e-5)
    assert got[2].tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0], abs=1e-6)
    assert got[3, 0].item() == pytest.approx(math.log(300), abs=1e-5)


def test_rows_that_cannot_sample_give_nan():
    logits = torch.zeros(2, 16)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    assert torch.isnan(token_metrics(logits)).all()
    assert TokenMetrics.from_row([float("nan")] * 4) is None


@pytest.mark.parametrize("greedy", [True, False])
def test_asking_for_metrics_leaves_the_tokens_alone(greedy):
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    if greedy:
        knobs = [SamplingTensors.greedy(metrics=m) for m in (False, True)]
    else:
        args = (torch.full((3,), 0.8), None, None, None, torch.arange(3), torch.zeros(3, dtype=int))
        knobs = [SamplingTensors(*args, all_greedy=False, metrics=m) for m in (False, True)]
    plain, measured = (sample(logits.clone(), k) for k in knobs)
    assert plain.metrics is None
    assert torch.equal(plain.token_ids, measured.token_ids)
    assert torch.equal(measured.metrics, token_metrics(logits))


def test_metrics_param_is_a_bool():
    with pytest.raises(InvalidSamplingParams, match="metrics"):
        SamplingParams(metrics=1)


def test_request_output_carries_one_metric_row_per_token(checkpoints):
    llm = checkpoints.llm("llama")
    prompt = [1, 5, 9, 42, 7]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (plain,) = llm.generate([prompt], params)
    (measured,) = llm.generate([prompt], SamplingParams(**{**_fields(params), "metrics": True}))
    assert plain.token_metrics is None
    assert measured.token_ids == plain.token_ids
    assert len(measured.token_metrics) == len(measured.token_ids)
    model = checkpoints.reference("llama")
    with torch.no_grad():  # the first token's distribution, from transformers
        logits = model(torch.tensor([prompt])).logits[0, -1]
    first = measured.token_metrics[0]
    expected = reference(logits)
    got = [first.entropy, first.varentropy, first.top_k_mass, first.margin]
    assert got == pytest.approx(expected, rel=1e-3, abs=1e-4)


def test_streamed_deltas_carry_their_own_metrics(checkpoints):
    llm = checkpoints.llm("llama")
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True, metrics=True)
    engine = llm.engine
    request_id = engine.add_request([1, 2, 3], params, delta=True)
    tokens, metrics = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.token_ids
                metrics += out.token_metrics
    assert len(tokens) == len(metrics) == 5
    assert all(isinstance(m, TokenMetrics) and m.entropy >= 0 for m in metrics)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # -inf - -inf in the masked rows
def test_the_triton_kernel_matches_the_reference():
    """sampling.metrics_kernel (CUDA's path) under Triton's interpreter on the CPU."""
    pytest.importorskip("triton")
    from noesis.sampling import metrics_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(2)
    logits = torch.randn(6, 4200) * 4
    logits[1, 3:] = float("-inf")  # three tokens left
    logits[2, 1:] = float("-inf")
    logits[3] = float("-inf")  # nothing allowed
    logits[4, 17] = float("nan")
    logits[5, :2500] = float("-inf")  # a whole chunk masked before the allowed ones
    got = metrics_kernel.token_metrics(logits.to(device), METRICS_TOP_K).cpu()
    expected = reference_metrics(logits)
    assert torch.isnan(got[3:5]).all()
    keep = [0, 1, 2, 5]
    assert torch.allclose(got[keep], expected[keep], rtol=1e-4, atol=1e-5)


def test_speculated_tokens_keep_the_metrics_aligned(checkpoints):
    """A self-draft: every proposal accepted; accepted tokens have no metrics of their own."""
    from noesis import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", draft=str(checkpoints.path("llama")), k=3,
                             adaptive=False, entropy_cutoff=math.inf)  # fmt: skip
    llm = checkpoints.new_llm("llama", speculative=spec)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, metrics=True)
    (out,) = llm.generate([[1, 5, 9, 42, 7]], params)
    assert out.spec_accepted > 0
    assert len(out.token_metrics) == len(out.token_ids) == 9
    assert out.token_metrics[0] is not None and out.token_metrics.count(None) >= out.spec_accepted


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_triton_kernel_counts_repeated_top_logits_across_blocks():
    """The top-k mass counts a repeated value each time it occurs (as torch.topk does), whether
    the repeats share a block or not; a row shorter than k, and a row of 40 blocks."""
    pytest.importorskip("triton")
    from noesis.sampling import metrics_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    logits = torch.randn(3, 5000)
    logits[0, [10, 11, 2000, 4999]] = 9.0  # two in block 0, one in block 1, one in the tail
    logits[0, 3000] = 8.5
    logits[1] = 0.0  # every block ties everywhere
    logits[2, :4100] = float("-inf")  # only the tail block allowed
    logits[2, 4200] = logits[2, 4300] = 5.0
    short = torch.tensor([[1.0, 1.0, -2.0], [0.5, float("-inf"), 0.5]])  # vocab 3 < top-k 5
    wide = torch.randn(1, 40000) * 3
    wide[0, [5, 39000]] = 20.0
    assert metrics_kernel.block_size(128256) == 1024 and metrics_kernel.block_size(3) == 16
    for rows in (logits, short, wide):
        got = metrics_kernel.token_metrics(rows.to(device), METRICS_TOP_K).cpu()
        assert torch.allclose(got, reference_metrics(rows), rtol=1e-4, atol=1e-5)
    got = metrics_kernel.token_metrics(logits.to(device), METRICS_TOP_K).cpu()
    top = torch.tensor([9.0] * 4 + [8.5])
    assert got[0, 2].item() == pytest.approx(float((top - logits[0].logsumexp(0)).exp().sum()))
    assert got[0, 3].item() == pytest.approx(0.0, abs=1e-7)  # the best two tie: no margin
