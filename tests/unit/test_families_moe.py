"""Routed-expert and Gemma families against transformers on tiny random checkpoints (fp32, CPU).

Qwen3-MoE, Mixtral and gpt-oss (bf16 layout and MXFP4 experts), Gemma 2 and Gemma 3: 32 greedy
tokens identical and logprobs within 1e-4 of transformers' cached generate, for a prompt past
the 8-token sliding window alone, then with one inside it and a third that shares the long one's
prefix, batched through the paged engine with prefix caching and chunked prefill. The pieces
under them are checked on their own: the routers against transformers' own, the three expert
paths against each other, the MXFP4 dequantizer against transformers' helper. Gemma 2's
soft-caps bite (10 and 5), and the reference is checked to apply them (transformers' SDPA path
drops the attention cap: the 0.027 of the GPU run). `noesis info`'s expert lines at the end.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import hf_generate, load_reference, noesis_greedy
from safetensors.torch import load_file, save_file

from noesis import LLM, SamplingParams
from noesis.kernels import moe
from noesis.weights.mxfp4 import dequantize_mxfp4

FAMILIES = ["qwen3-moe", "mixtral", "gpt-oss", "gemma2", "gemma3"]
PROMPTS = {"short": [0, 5, 9, 77, 100, 21], "long": list(range(30, 50))}
NEW_TOKENS = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' greedy tokens and logprob rows per (checkpoint, prompt), computed once."""
    cache = {}

    def get(name: str, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_generate(checkpoints.reference(name), prompt, NEW_TOKENS)
        return cache[key]

    return get


def assert_matches(tokens, logprobs, reference):
    ref_tokens, ref_rows = reference
    assert tokens == ref_tokens, f"noesis {tokens}\ntransformers {ref_tokens}"
    worst = max(
        abs(lp - ref_rows[i, t].item())
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))
    )
    assert worst <= TOL, f"max |logprob difference| {worst:.3g}"


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_parity(checkpoints, references, name):
    """The long prompt alone (the batched test below runs both with others)."""
    prompt = PROMPTS["long"]
    tokens, logprobs = noesis_greedy(checkpoints.llm(name), prompt, NEW_TOKENS)
    assert_matches(tokens, logprobs, references(name, prompt))


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_with_prefix_cache_and_chunked_prefill(checkpoints, references, name):
    """Mixed lengths in one batch, prefills cut into 8-token chunks, 4-token pages; run twice so
    that the second run takes its prefixes from the cache."""
    prompts = [PROMPTS["short"], PROMPTS["long"], PROMPTS["long"][:13] + [3, 4, 5]]
    llm = checkpoints.new_llm(
        name, enable_prefix_caching=True, page_size=4, max_num_batched_tokens=8
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for _ in range(2):
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            logprobs = [row[t] for row, t in zip(out.logprobs, out.token_ids, strict=True)]
            assert_matches(out.token_ids, logprobs, references(name, prompt))
    assert llm.engine.prefix_cache.hit_tokens > 0
    assert not llm.engine.has_unfinished()


def test_configs_are_what_the_names_say(checkpoints):
    """Guards the matrix against overrides transformers silently drops."""
    cfg = {name: checkpoints.llm(name).model_config for name in FAMILIES}
    qwen, mixtral, oss = cfg["qwen3-moe"].moe, cfg["mixtral"].moe, cfg["gpt-oss"].moe
    assert (qwen.num_experts, qwen.top_k, qwen.renormalize, qwen.dense_layers) == (8, 2, True, (1,))
    assert (mixtral.num_experts, mixtral.top_k, mixtral.renormalize) == (4, 2, True)
    assert (oss.routing, oss.top_k, oss.swiglu_limit, oss.mxfp4) == ("topk_softmax", 4, 7.0, False)
    assert cfg["gpt-oss"].attention_sinks and cfg["gpt-oss"].o_bias
    assert cfg["gpt-oss"].rope.rope_type == "yarn" and not cfg["gpt-oss"].rope.truncate
    for name in ("gpt-oss", "gemma2", "gemma3"):
        assert [cfg[name].window(i) for i in range(2)] == [8, None]
    assert cfg["gemma2"].attn_softcap == 10.0 and cfg["gemma2"].final_softcap == 5.0
    assert cfg["gemma3"].qk_norm and cfg["gemma3"].rope.factor == 8.0
    assert cfg["gemma3"].rope.local.theta == 10000.0
    sinks = checkpoints.llm("gpt-oss").engine.loaded.model.model.layers[0].self_attn.sinks
    assert sinks.abs().max() > 0.05  # random, so that they matter


# ---- routers and expert paths ------------------------------------------------------------------


def test_routers_match_transformers():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(11, 16)
    cases = [
        (
            Qwen3MoeTopKRouter,
            transformers.Qwen3MoeConfig,
            "num_experts",
            {"norm_topk_prob": False},
            ("softmax_topk", False),
        ),
        (
            Qwen3MoeTopKRouter,
            transformers.Qwen3MoeConfig,
            "num_experts",
            {"norm_topk_prob": True},
            ("softmax_topk", True),
        ),
        (
            MixtralTopKRouter,
            transformers.MixtralConfig,
            "num_local_experts",
            {},
            ("softmax_topk", True),
        ),
        (
            GptOssTopKRouter,
            transformers.GptOssConfig,
            "num_local_experts",
            {},
            ("topk_softmax", True),
        ),
    ]
    for router_class, config_class, key, extra, (routing, renormalize) in cases:
        config = config_class(hidden_size=16, num_experts_per_tok=3, **{key: 6}, **extra)
        router = router_class(config)
        torch.nn.init.normal_(router.weight)
        if getattr(router, "bias", None) is not None:
            torch.nn.init.normal_(router.bias)
        _, ref_weights, ref_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
        weights, ids = moe.route(logits, 3, routing, renormalize)
        assert torch.equal(ids, ref_ids)
        assert torch.allclose(weights.float(), ref_weights.float(), atol=1e-6)


@pytest.mark.parametrize("limit", [None, 7.0])
def test_expert_paths_agree(limit):
    """Grouped (eager), gathered and masked (graph capture) compute the same sums."""
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inner, experts, top_k = 9, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen)
    down = torch.randn(experts, hidden, inner, generator=gen)
    biases = (
        torch.randn(experts, 2 * inner, generator=gen),
        torch.randn(experts, hidden, generator=gen),
    )
    weights, ids = moe.route(
        torch.randn(tokens, experts, generator=gen), top_k, "softmax_topk", True
    )
    ids[0] = torch.tensor([4, 1])  # expert 3 unused by some, 4 by one token
    args = (x, ids, weights, gate_up, down, moe.Activation(limit), *biases)
    grouped = moe.grouped(*args)
    expected = sum(  # one token at a time, straight from the definition
        weights[:, k, None]
        * torch.stack(
            [
                torch.nn.functional.linear(
                    moe.Activation(limit)(
                        torch.nn.functional.linear(x[t], gate_up[e], biases[0][e])
                    ),
                    down[e],
                    biases[1][e],
                )
                for t, e in enumerate(ids[:, k].tolist())
            ]
        )
        for k in range(top_k)
    )
    assert torch.allclose(grouped, expected, atol=1e-4)
    assert torch.allclose(moe.gathered(*args), grouped, atol=1e-4)
    assert torch.allclose(moe.masked(*args), grouped, atol=1e-4)


# ---- MXFP4 -------------------------------------------------------------------------------------


def test_mxfp4_dequantizer_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 136, (3, 10, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [3, 10, 128]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 128, 10]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # by hand: byte 0x9A is codes 0xA (low nibble: -1.0) then 0x9 (-0.5); scale 2^(128-127)
    one = dequantize_mxfp4(
        torch.tensor([[0x9A] + [0x70] * 15], dtype=torch.uint8),
        torch.tensor([128], dtype=torch.uint8),
    )
    assert one[:4].tolist() == [-2.0, -1.0, 0.0, 12.0]


def _mxfp4_checkpoints(checkpoints, tmp_path):
    """The gpt-oss checkpoint with random MXFP4 experts (as the released checkpoints store them),
    and beside it the same model in bf16 layout, dequantized by transformers' own helper."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = checkpoints.path("gpt-oss")
    packed, plain = tmp_path / "mxfp4", tmp_path / "dequantized"
    shutil.copytree(source, packed)
    shutil.copytree(source, plain)
    tensors = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    quantized, dequantized = dict(tensors), dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors[key].shape  # stored [E, in, out]
        blocks = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen
        )
        scales = torch.randint(
            121, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen
        )
        del quantized[key]
        quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = blocks, scales
        dequantized[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(quantized, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    return packed, plain


def test_gpt_oss_mxfp4_experts(checkpoints, tmp_path):
    packed, plain = _mxfp4_checkpoints(checkpoints, tmp_path)
    llm = LLM(str(packed), device="cpu", dtype="float32", progress=False)
    assert llm.model_config.moe.mxfp4
    ref = load_reference(plain)
    for prompt in PROMPTS.values():
        tokens, logprobs = noesis_greedy(llm, prompt, NEW_TOKENS)
        assert_matches(tokens, logprobs, hf_generate(ref, prompt, NEW_TOKENS))


def test_released_config_spellings():
    """config.json as the Hub checkpoints spell it (transformers 4): Gemma's layer pattern and
    local rope base, Qwen3-MoE's num_experts, gpt-oss's MXFP4 quantization_config."""
    from noesis.models.config import ModelConfig

    base = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    gemma3 = ModelConfig.from_hf(
        {
            **base,
            "architectures": ["Gemma3ForCausalLM"],
            "sliding_window": 512,
            "sliding_window_pattern": 3,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 16,
        }
    )
    assert [gemma3.window(i) for i in range(6)] == [512, 512, None, 512, 512, None]
    assert (gemma3.rope.theta, gemma3.rope.factor, gemma3.rope.local.theta) == (1e6, 8.0, 1e4)
    gemma2 = ModelConfig.from_hf(
        {
            **base,
            "architectures": ["Gemma2ForCausalLM"],
            "sliding_window": 4096,
            "hidden_act": "gelu_pytorch_tanh",
        }
    )
    assert [gemma2.window(i) for i in range(2)] == [4096, None] and gemma2.rope.local is None
    qwen = ModelConfig.from_hf(
        {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
        }
    )
    assert qwen.moe.num_experts == 16 and qwen.moe.dense_layers == (0, 2, 4)
    oss = ModelConfig.from_hf(
        {
            **base,
            "architectures": ["GptOssForCausalLM"],
            "num_local_experts": 8,
            "sliding_window": 128,
            "num_experts_per_tok": 4,
            "quantization_config": {"quant_method": "mxfp4"},
        }
    )
    assert (
        oss.moe.mxfp4
        and oss.attention_bias
        and oss.layer_types[:2] == ("sliding_attention", "full_attention")
    )


@pytest.mark.parametrize("cap", ["attention", "final"])
def test_the_gemma2_reference_soft_caps(checkpoints, references, cap):
    """Both soft-caps are in transformers' reference: noesis with one switched off misses it by
    far more than the parity tolerance. Under SDPA transformers drops the attention cap without
    a word (5.17 defaulted Gemma 2 to it: noesis, right, then missed its reference by 0.027 on
    the GPU run), so `load_reference` asks for eager attention."""
    llm = checkpoints.llm("gemma2")
    model = llm.engine.loaded.model
    attentions = [layer.self_attn for layer in model.model.layers]
    try:
        if cap == "attention":
            for attention in attentions:
                attention.softcap = None
        else:
            model.final_softcap = None
        tokens, logprobs = noesis_greedy(llm, PROMPTS["long"], 4)
    finally:
        for attention in attentions:
            attention.softcap = llm.model_config.attn_softcap
        model.final_softcap = llm.model_config.final_softcap
    ref_tokens, ref_rows = references("gemma2", PROMPTS["long"])
    assert abs(logprobs[0] - ref_rows[0, tokens[0]].item()) > 100 * TOL


def test_info_counts_experts_and_active_parameters(checkpoints, tmp_path):
    """`noesis info`: the parameters one token uses (top-k of each sparse layer's experts), and
    an MXFP4 checkpoint counted in values, not bytes (the same as its dequantized twin)."""
    from noesis.engine.loading import describe_checkpoint

    info = describe_checkpoint(checkpoints.path("qwen3-moe"))
    model = checkpoints.reference("qwen3-moe")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts and info["parameters"].startswith(f"{total:,} ")
    assert info["active parameters"].startswith(f"{total - experts + experts * 2 // 8:,} ")
    assert info["experts"] == "8 per layer, 2 routed per token (1 of 2 layers)"
    packed, plain = _mxfp4_checkpoints(checkpoints, tmp_path)
    assert describe_checkpoint(packed)["parameters"] == describe_checkpoint(plain)["parameters"]


def test_a_vision_language_checkpoint_loads_its_text_model_alone(tmp_path):
    """Gemma 3 with its vision tower (Gemma3ForConditionalGeneration, the Hub's layout): noesis
    loads the text model under its prefix, never reads the vision tensors (counted by the bytes
    read), matches transformers' multimodal model on text, and `noesis info` prices each
    capability."""
    import transformers
    from checkpoints import SPECS, build_tokenizer
    from safetensors import safe_open

    from noesis.engine.loading import describe_checkpoint

    text = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, initializer_range=0.3, head_dim=16, pad_token_id=0,
        **SPECS["gemma3"].config,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5
    )
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        sizes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118
    vision_keys = [k for k in sizes if k.startswith(("vision_tower.", "multi_modal_projector."))]
    text_bytes = 4 * sum(torch.Size(s).numel() for k, s in sizes.items() if k not in vision_keys)
    assert vision_keys and text_bytes
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert llm.model_config.capabilities == ("text", "vision")
    assert llm.engine.loaded.bytes_read == text_bytes  # not one vision tensor read
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    for prompt in PROMPTS.values():
        tokens, logprobs = noesis_greedy(llm, prompt, NEW_TOKENS)
        assert_matches(tokens, logprobs, hf_generate(ref.eval(), prompt, NEW_TOKENS))
    line = describe_checkpoint(tmp_path)["capabilities"]
    assert (
        line.startswith("text ") and "(loaded); vision " in line and line.endswith("(not loaded)")
    )
