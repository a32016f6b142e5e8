"""The API gaps of issue 22 below the server: logit_bias (params, sampler, engine, with a
grammar), prefix-cache hits in RequestOutput, sampling defaults from generation_config.json, a
config.json without `architectures`, and the request fields the wire types refuse or honour."""

from __future__ import annotations

import json

import pytest
import torch

from noesis import LLM, InvalidSamplingParams, SamplingParams
from noesis.models.config import ModelConfig
from noesis.sampling.sampler import LogitBias, SamplingTensors, apply_logit_bias, sample
from noesis.server.errors import APIError
from noesis.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from noesis.structured import GrammarSpec

PROMPT = [5, 17, 3, 9, 11, 2, 8, 4, 6, 1]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return checkpoints.new_llm("llama", enable_prefix_caching=True, page_size=4)


def greedy(max_tokens: int = 6, **options) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


# ---- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_params_are_checked_and_hashable():
    params = SamplingParams(logit_bias={7: 5, 3: -100.0})
    assert params.logit_bias == ((3, -100.0), (7, 5.0)) and hash(params)
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({1: 100.5}, {-1: 1.0}, {"5": 1.0}, {1: float("nan")}, [(1, 1), (1, 2)], 5):
        with pytest.raises(InvalidSamplingParams, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_a_bias_never_unmasks_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0], [3.0, 0.0, 0.0, 0.0]])
    bias = LogitBias(torch.tensor([0, 0, 1]), torch.tensor([2, 0, 0]), torch.tensor([100.0, 5.0,
                                                                                     -100.0]))
    biased = apply_logit_bias(logits, bias)
    assert biased[0, 2] == float("-inf") and biased[0, 0] == 5.0 and biased[1, 0] == -97.0
    t = SamplingTensors.greedy(max_logprobs=0)
    t.logit_bias = bias
    out = sample(logits, t)
    assert out.token_ids.tolist() == [0, 1]  # row 0: 5 > 2, never the masked 2; row 1: not 0
    assert torch.allclose(out.token_logprobs, torch.log_softmax(logits, -1)[[0, 1], [0, 1]])


def test_logit_bias_forces_and_bans_tokens_in_the_engine(llm):
    plain = llm.generate([PROMPT], greedy())[0].token_ids
    forced = llm.generate([PROMPT], greedy(logit_bias={42: 100}))[0].token_ids
    assert forced == [42] * 6
    banned = llm.generate([PROMPT], greedy(logit_bias={plain[0]: -100}))[0].token_ids
    assert banned[0] != plain[0]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                             logit_bias={42: 100})
    assert llm.generate([PROMPT], sampled)[0].token_ids == [42] * 6


def test_logit_bias_ids_past_the_vocabulary_are_refused(llm):
    vocab = llm.model_config.vocab_size
    with pytest.raises(InvalidSamplingParams, match=f"logit_bias.*{vocab}"):
        llm.generate([PROMPT], greedy(logit_bias={vocab: 1.0}))


def test_a_bias_cannot_take_a_constrained_request_out_of_its_grammar(llm):
    token_ids = {llm.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("yes", "no")}
    other = next(t for t in range(100, 200) if t not in token_ids)
    params = greedy(max_tokens=8, grammar=GrammarSpec.regex("(yes|no)"), logit_bias={other: 100})
    out = llm.generate([PROMPT], params)[0]
    assert out.text in ("yes", "no") and other not in out.token_ids


# ---- cached tokens, defaults, architectures --------------------------------------------------


def test_outputs_count_the_prompt_tokens_found_in_the_prefix_cache(llm):
    prompt = [(3 * i + 1) % 97 for i in range(13)]
    first, second = (llm.generate([prompt], greedy(max_tokens=2))[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12  # three full pages of 4; the last token is computed


def test_sampling_defaults_come_from_generation_config(checkpoints, tmp_path):
    from noesis.sampling.defaults import generation_defaults

    path = checkpoints.copy("llama", tmp_path / "llama")
    config = path / "generation_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    data |= {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True,
             "repetition_penalty": 0.0}  # refused by SamplingParams: left out, not fatal
    config.write_text(json.dumps(data))
    assert generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    params = llm.get_default_sampling_params(top_k=5)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 5)
    assert SamplingParams().temperature == 1.0  # existing callers keep today's behaviour


@pytest.mark.parametrize(("model_type", "architecture"), [
    ("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
])  # fmt: skip
def test_a_config_without_architectures_loads_from_model_type(checkpoints, model_type,
                                                              architecture):
    family = {"llama": "llama", "qwen3": "qwen3"}[model_type]
    cfg = json.loads((checkpoints.path(family) / "config.json").read_text())
    del cfg["architectures"]
    assert ModelConfig.from_hf(cfg).architecture == architecture
    with pytest.raises(Exception, match="model_type='gpt2'"):
        ModelConfig.from_hf({**cfg, "model_type": "gpt2"})


# ---- wire fields: honoured, documented no-ops, or refused ----------------------------------------


def refused(model, body: dict) -> APIError:
    request = parse_body(json.dumps(body).encode(), model)
    with pytest.raises(APIError) as info:
        request.refuse_unsupported()
        request.sampling_params(4, None)
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(("extra", "param"), [
    ({"service_tier": "flex"}, "service_tier"),
    ({"store": True}, "store"),
    ({"verbosity": "low"}, "verbosity"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"logit_bias": {"9" * 40: 1}}, f"logit_bias.{'9' * 40}"),
    ({"audio": {"voice": "x"}}, "audio"),
])  # fmt: skip
def test_chat_fields_that_would_be_ignored_are_400s_naming_them(extra, param):
    error = refused(ChatCompletionRequest, {**CHAT, **extra})
    assert error.status == 400 and error.param == param
    assert "later release" not in error.message


def test_no_op_fields_are_taken_and_change_nothing():
    body = {**CHAT, "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "safety_identifier": "s", "prompt_cache_key": "p", "logit_bias": {"5": -2.5}}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    request.refuse_unsupported()
    (params,) = request.sampling_params(4, None)
    assert params == SamplingParams(max_tokens=4, logit_bias={5: -2.5})


def test_unset_sampling_fields_take_the_servers_defaults():
    request = parse_body(json.dumps({**CHAT, "top_p": 0.5}).encode(), ChatCompletionRequest)
    defaults = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    (params,) = request.sampling_params(4, None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.6, 0.5, 20, 1.1)


def test_template_variables_the_template_never_reads_are_400s():
    body = {**CHAT, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.template_kwargs(lambda name: True)["reasoning_effort"] == "low"
    with pytest.raises(APIError) as info:
        request.template_kwargs(lambda name: name != "enable_thinking")
    assert info.value.param == "chat_template_kwargs.enable_thinking"
    with pytest.raises(APIError) as info:
        request.template_kwargs(lambda name: name != "reasoning_effort")
    assert info.value.param == "reasoning_effort"


def test_best_of_runs_more_generations_and_is_checked():
    completion = {"model": "m", "prompt": "Hi"}
    request = parse_body(json.dumps({**completion, "best_of": 3}).encode(), CompletionRequest)
    request.refuse_unsupported()
    assert request.choices == 3 and len(request.sampling_params(4, 0)) == 3
    assert refused(CompletionRequest, {**completion, "best_of": 1, "n": 2}).param == "best_of"
    streamed = {**completion, "best_of": 2, "stream": True}
    assert "stream" in refused(CompletionRequest, streamed).message
