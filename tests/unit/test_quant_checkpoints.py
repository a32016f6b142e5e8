"""AWQ and GPTQ checkpoints through the engine: noesis.LLM on the packed tensors against
transformers running the same model with the dequantized weights (dequantize, then matmul).

The checkpoints are written here from tiny random models, packed by this file's own code after
the formats' documentation (AutoAWQ's gemm packer, AutoGPTQ's v1 packer), so that a misreading
of a layout on the library side cannot cancel out. float32: greedy tokens must be identical and
per-token logprobs within 1e-4.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from checkpoints import hf_generate, load_reference, noesis_greedy
from safetensors.torch import load_file, save_file

from noesis import LLM, CheckpointMismatch, UnsupportedModel

PROJECTION = re.compile(r"(.*\.layers\.(\d+)\.(self_attn|mlp))\.(\w+)_proj\.weight")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ gemm: nibble i <- column AWQ_PACK_ORDER[i]
PROMPT = [0, 5, 9, 77, 100, 21, 3, 8]
NEW_TOKENS = 16
LOGPROB_TOL = 1e-4
# name -> (tiny checkpoint, quantization_config)
VARIANTS = {
    "awq-int4": ("llama", {"quant_method": "awq", "bits": 4, "group_size": 32,
                           "version": "gemm", "zero_point": True}),
    "gptq-int4-act-order": ("llama", {"quant_method": "gptq", "bits": 4, "group_size": 16,
                                      "desc_act": True, "sym": False}),
    "gptq-int8": ("llama", {"quant_method": "gptq", "bits": 8, "group_size": -1,
                            "desc_act": False, "sym": True}),
    "gptq-int4-qkv-bias": ("qwen2-tied", {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                          "desc_act": False, "sym": True}),
    "gptq-int4-phi3-fused": ("phi3", {"quant_method": "gptq", "bits": 4, "group_size": 16,
                                      "desc_act": True, "sym": False}),
}


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_columns(values: torch.Tensor, bits: int, order) -> torch.Tensor:
    """[rows, C] -> int32 [rows, C / pack]: word j's field i holds column j * pack + order[i]."""
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, len(order))
    words = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for field, column in enumerate(order):
        words |= grouped[..., column] << (bits * field)
    return to_int32(words)


def quantize(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool):
    """Round-to-nearest per group of columns (g_idx [K]): codes [N, K], zeros and scales [N, G]."""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    codes = torch.empty(weight.shape, dtype=torch.int64)
    zeros = torch.empty(weight.shape[0], groups, dtype=torch.int64)
    scales = torch.empty(weight.shape[0], groups, dtype=torch.float16)
    for g in range(groups):
        cols = weight[:, g_idx == g].double()
        if sym:
            scale = (cols.abs().amax(1) * 2 / top).clamp_min(1e-6).half()
            zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int64)
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale = ((high - low) / top).clamp_min(1e-6).half()
            zero = (-low / scale.double()).round().clamp(0, top).long()
        zero[::5] = 0 if not sym else zero[::5]  # zero point 0: GPTQ v1 stores it as 2^bits - 1
        q = (cols / scale.double()[:, None]).round() + zero[:, None]
        codes[:, g_idx == g] = q.clamp(0, top).long()
        zeros[:, g], scales[:, g] = zero, scale
    return codes, zeros, scales


def awq_tensors(codes, zeros, scales):
    return {"qweight": pack_columns(codes.t(), 4, AWQ_PACK_ORDER),
            "qzeros": pack_columns(zeros.t(), 4, AWQ_PACK_ORDER),
            "scales": scales.t().contiguous()}


def gptq_tensors(codes, zeros, scales, bits, g_idx):
    plain = tuple(range(32 // bits))
    stored_zeros = (zeros - 1) & ((1 << bits) - 1)  # v1: zero point minus one
    return {"qweight": pack_columns(codes, bits, plain).t().contiguous(),  # packed along K
            "qzeros": pack_columns(stored_zeros.t(), bits, plain),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def write_quantized(float_dir, out, scheme: dict, seed: int = 0):
    """The quantized checkpoint at out / "packed", and the same model with the dequantized
    weights in float32 at out / "dequantized"."""
    packed_dir, float_copy = out / "packed", out / "dequantized"
    for directory in (packed_dir, float_copy):
        shutil.copytree(float_dir, directory)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}  # projections that share an input share their g_idx
    packed, dequantized = {}, {}
    bits, method = scheme["bits"], scheme["quant_method"]
    for key, weight in load_file(float_dir / "model.safetensors").items():
        match = PROJECTION.fullmatch(key)
        if match is None:
            packed[key] = dequantized[key] = weight
            continue
        k = weight.shape[1]
        group = k if scheme["group_size"] == -1 else scheme["group_size"]
        shared_input = match[1] + ("" if match[4] in ("o", "down") else ".in")
        if shared_input not in orders:
            act_order = scheme.get("desc_act", False)
            orders[shared_input] = torch.randperm(k, generator=gen) if act_order else None
        order = orders[shared_input]
        rank = torch.arange(k) if order is None else torch.argsort(order)
        g_idx = rank // group
        codes, zeros, scales = quantize(weight, bits, g_idx, scheme.get("sym", False))
        dequantized[key] = (codes - zeros[:, g_idx]).float() * scales[:, g_idx].float()
        parts = (awq_tensors(codes, zeros, scales) if method == "awq"
                 else gptq_tensors(codes, zeros, scales, bits, g_idx))
        base = key.removesuffix(".weight")
        packed |= {f"{base}.{leaf}": tensor for leaf, tensor in parts.items()}
    save_file(packed, packed_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, float_copy / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = scheme
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, float_copy


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {name: write_quantized(checkpoints.path(spec), root / name, scheme)
            for name, (spec, scheme) in VARIANTS.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_checkpoint_matches_dequantized_reference(quantized, name):
    packed_dir, float_dir = quantized[name]
    ref_tokens, ref_rows = hf_generate(load_reference(float_dir), PROMPT, NEW_TOKENS)
    llm = LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)
    tokens, logprobs = noesis_greedy(llm, PROMPT, NEW_TOKENS)
    assert tokens == ref_tokens
    ref = [float(row[token]) for row, token in zip(ref_rows, ref_tokens, strict=True)]
    worst = max(abs(a - b) for a, b in zip(logprobs, ref, strict=True))
    assert worst <= LOGPROB_TOL, f"max |logprob difference| {worst:.3g}"
    model = llm.engine.loaded.model
    proj = model.model.layers[0].self_attn.qkv_proj
    assert type(proj).__name__ == "PackedLinear" and proj.qweight.dtype == torch.int32
    assert proj.act_order == VARIANTS[name][1].get("desc_act", False)


def test_unsupported_awq_version_is_named(quantized, tmp_path):
    packed_dir = shutil.copytree(quantized["awq-int4"][0], tmp_path / "gemv")
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (packed_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="awq version 'gemv'"):
        LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)


def test_fused_parts_with_different_g_idx_are_refused(quantized, tmp_path):
    packed_dir = shutil.copytree(quantized["gptq-int4-act-order"][0], tmp_path / "mixed")
    tensors = load_file(packed_dir / "model.safetensors")
    key = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[key] = torch.roll(tensors[key], 1)
    save_file(tensors, packed_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="qkv_proj.g_idx: the fused projections"):
        LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)


def test_wrong_packed_shape_names_the_tensor(quantized, tmp_path):
    packed_dir = shutil.copytree(quantized["awq-int4"][0], tmp_path / "short")
    tensors = load_file(packed_dir / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.qweight"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, packed_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match=re.escape(key)):
        LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)
