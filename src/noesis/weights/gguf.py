"""GGUF files (llama.cpp's format) read directly: metadata -> ModelConfig, tensors -> parameters.

A .gguf file holds everything a checkpoint directory does. Its metadata becomes a config.json-style
dict that `ModelConfig.from_hf` validates as it would any other; its vocabulary becomes a
`tokenizers` tokenizer (gguf_tokenizer.py); its tensors are memory-mapped by the `gguf` package's
reader; the decoder projections' block-quantized tensors stay packed (noesis.quant.gguf_packed)
and the rest is dequantized at load (gguf_quants.py) into the model's dtype. llama.cpp renames every
tensor and, for the llama architecture, permutes the rows of the query and key projections so that
rotary pairs sit side by side; both are undone here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from noesis.errors import (
    CheckpointError,
    CheckpointMismatch,
    ConfigError,
    ModelNotFound,
    UnsupportedModel,
)
from noesis.models.config import ModelConfig
from noesis.quant.gguf_packed import GGUFLinear, packable
from noesis.weights.files import regular_file_size
from noesis.weights.gguf_quants import BLOCKS, dequantize, split_codes
from noesis.weights.loader import check_tensor_names, name_list
from noesis.weights.mapping import Source, sources_for
from noesis.weights.paging import ReadClock

SUFFIX = ".gguf"
# general.architecture -> Hugging Face architecture; Mistral's files say "llama" (_hf_architecture)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
QWEN2 = ARCHITECTURES["qwen2"]
PERMUTED_QK = frozenset({"llama"})  # architectures whose q/k rows llama.cpp permuted
# Hugging Face module -> GGUF tensor prefix
GLOBAL_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3, stored fused
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up stacked in one tensor
    "mlp.down_proj": "ffn_down",
}
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Tensors that carry rotary parameters, read into the config rather than into parameters.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LLAMA3_FACTORS = "rope_freqs.weight"
# Llama 3's rope is a function of factor and of the wavelength band that (original context,
# low_freq_factor, high_freq_factor) bound; the band, not the three, is what rope_freqs fixes.
LLAMA3_ORIGINAL_CONTEXT = 8192
# decoder projections whose block-quantized tensors stay packed (noesis.quant.gguf_packed)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata values and its (memory-mapped) tensors by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(dim) for dim in reversed(self.tensors[name].shape.tolist()))

    def read(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor dequantized to float32 on `device` (its packed bytes travel), torch order."""
        tensor = self.tensors[name]
        raw = torch.from_numpy(tensor.data).to(device)  # from the copy-on-write map: no writes
        shape = self.shape(name)
        return dequantize(raw, tensor.tensor_type.name, int(tensor.n_elements)).view(shape)


def is_gguf(model: str | os.PathLike) -> bool:
    """Whether a model argument names a GGUF file (by its suffix)."""
    return str(model).lower().endswith(SUFFIX)


def open_gguf(model: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and metadata and map its tensors (nothing is read yet)."""
    from gguf import GGUFReader

    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"GGUF file {str(model)!r} does not exist")
    regular_file_size(path)
    try:
        reader = GGUFReader(path, "c")  # copy-on-write: torch may view it without a copy
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, OSError, UnicodeDecodeError, IndexError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt?): {exc}") from exc
    return GGUFFile(path, metadata, {tensor.name: tensor for tensor in reader.tensors})


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The model's config from the metadata, validated as config.json is; an unsupported
    architecture or tensor type is UnsupportedModel naming it and what is supported."""
    _check_tensor_types(gguf)
    return ModelConfig.from_hf(_hf_config(gguf))


def _hf_architecture(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"{gguf.path.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))} (Mistral files are 'llama'); supported tensor "
            f"types: {', '.join(BLOCKS)}"
        )
    name = str(gguf.metadata.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        return "MistralForCausalLM"
    return ARCHITECTURES[arch]


def _check_tensor_types(gguf: GGUFFile) -> None:
    unsupported = sorted({gguf.type_name(name) for name in gguf.tensors} - set(BLOCKS))
    if unsupported:
        arch = gguf.architecture
        raise UnsupportedModel(
            f"{gguf.path.name} ({arch}) holds tensors of type {', '.join(unsupported)}, which "
            f"noesis cannot dequantize; supported tensor types: {', '.join(BLOCKS)}; supported "
            f"architectures: {', '.join(sorted(ARCHITECTURES))}"
        )


def _hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json's fields from llama.cpp's metadata keys and the tensors present."""
    architecture = _hf_architecture(gguf)
    if "token_embd.weight" not in gguf.tensors:
        raise CheckpointMismatch(f"{gguf.path.name} has no token_embd.weight tensor")
    heads = gguf.arch_value("attention.head_count")
    head_dim = gguf.arch_value("attention.key_length")
    hidden = gguf.arch_value("embedding_length")
    rotary = gguf.arch_value("rope.dimension_count")
    cfg = {
        "architectures": [architecture],
        "vocab_size": gguf.shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "intermediate_size": _per_layer_constant(gguf, "feed_forward_length"),
        "num_hidden_layers": gguf.arch_value("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _per_layer_constant(gguf, "attention.head_count_kv"),
        "head_dim": head_dim,
        "max_position_embeddings": gguf.arch_value("context_length"),
        "rms_norm_eps": gguf.arch_value("attention.layer_norm_rms_epsilon"),
        "rope_theta": gguf.arch_value("rope.freq_base"),
        "rope_scaling": _rope_scaling(gguf),
        "sliding_window": gguf.arch_value("attention.sliding_window"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        # Qwen2's q/k/v biases are implied by its family; elsewhere they mean attention_bias
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors and architecture != QWEN2,
        "mlp_bias": "blk.0.ffn_down.bias" in gguf.tensors,
        **_token_ids(gguf),
    }
    full_dim = head_dim or (hidden // heads if isinstance(hidden, int) and heads else None)
    if isinstance(rotary, int) and full_dim and rotary != full_dim:
        cfg["partial_rotary_factor"] = rotary / full_dim
    return {key: value for key, value in cfg.items() if value is not None}


def _per_layer_constant(gguf: GGUFFile, key: str) -> Any:
    """A hyper-parameter that GGUF may list per layer: one value, or UnsupportedModel."""
    value = gguf.arch_value(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModel(
                f"{gguf.path.name}: {gguf.architecture}.{key} differs between layers ({value[:8]})"
            )
        return value[0]
    return value


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    """rope_scaling from rope.scaling.*, or Phi-3's longrope factors stored as tensors."""
    original = gguf.arch_value("rope.scaling.original_context_length")
    if all(name in gguf.tensors for name in ROPE_FACTOR_TENSORS):
        long, short = (gguf.read(name).tolist() for name in ROPE_FACTOR_TENSORS)
        return {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": original,
            "attention_factor": gguf.arch_value("rope.scaling.attn_factor"),
        }
    if LLAMA3_FACTORS in gguf.tensors:
        return _llama3_scaling(gguf)
    kind = gguf.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModel(f"{gguf.path.name}: rope scaling {kind!r} (supported: linear, yarn)")
    scaling = {"rope_type": kind, "factor": gguf.arch_value("rope.scaling.factor")}
    if kind == "yarn" and original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _llama3_scaling(gguf: GGUFFile) -> dict[str, Any]:
    """Llama 3.x rope scaling from llama.cpp's per-frequency wavelength factors: 1 for short
    wavelengths, `factor` for long ones, and 1 / ((1 - s) / factor + s) in between, where s is
    linear in 1 / wavelength; two in-between frequencies fix that line."""
    factors = gguf.read(LLAMA3_FACTORS).double()
    head_dim = gguf.arch_value("rope.dimension_count") or factors.numel() * 2
    theta = gguf.arch_value("rope.freq_base", 10000.0)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64)[: factors.numel()] / head_dim
    inverse_wavelength = 1.0 / (theta**exponents) / (2 * torch.pi)
    factor = float(factors.max())
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    if factor <= 1.0 or int(band.sum()) < 2:
        raise UnsupportedModel(
            f"{gguf.path.name}: its rope_freqs ({factors.numel()} factors, largest {factor:g}) "
            "are not Llama 3-style rope scaling with at least two in-between frequencies"
        )
    x, y = inverse_wavelength[band], smooth[band]
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    intercept = float(y.mean() - slope * x.mean())
    original = LLAMA3_ORIGINAL_CONTEXT  # s = (original / wavelength - low) / (high - low)
    width = original / slope
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": -intercept * width,
        "high_freq_factor": (1.0 - intercept) * width,
        "original_max_position_embeddings": original,
    }


def _token_ids(gguf: GGUFFile) -> dict[str, Any]:
    """bos_token_id, and as eos_token_id every end-of-generation id llama.cpp stops at."""
    meta = gguf.metadata
    ends = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(end for end in ends if end is not None))
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": ends or None}


# ---- weights ------------------------------------------------------------------------------------


def load_gguf_weights(
    model: nn.Module, config: ModelConfig, gguf: GGUFFile, progress: bool = True,
    clock: ReadClock | None = None,
) -> int:
    """Every tensor of the file into `model`'s (already allocated) parameters, strictly:
    missing, unexpected or mis-shaped tensors are CheckpointMismatch naming them. Projections
    that `pack_gguf_projections` made GGUFLinear get their codes and scales; the rest is
    dequantized. Returns the bytes of tensor data read; `clock` books the seconds reading them."""
    clock = clock or ReadClock()
    params = dict(model.named_parameters())
    packed = {f"{name}.weight": module for name, module in model.named_modules()
              if isinstance(module, GGUFLinear)}
    inside_packed = tuple(name.removesuffix("weight") + "blocks." for name in packed)
    shapes = {name: tuple(param.shape) for name, param in params.items()
              if not name.startswith(inside_packed)}
    shapes |= {name: (module.out_features, module.in_features) for name, module in packed.items()}
    targets = _targets(shapes, config)  # GGUF name -> (parameter name, source)
    _check_names(targets, gguf, config)
    _check_shapes(targets, shapes, gguf)
    bytes_read = 0
    with torch.no_grad():
        for name in tqdm(targets, desc="Loading GGUF", unit="tensor", disable=not progress):
            param_name, source = targets[name]
            clock.read(torch.from_numpy(gguf.tensors[name].data))  # the packed bytes, as mapped
            bytes_read += int(gguf.tensors[name].n_bytes)
            if param_name in packed:
                _load_packed(packed[param_name], name, source.offset, config, gguf)
                continue
            dest = params[param_name]
            tensor = _unpermuted(gguf.read(name, dest.device), name, config, gguf.architecture)
            if source.rows is not None:
                dest = dest.narrow(0, source.offset, source.rows)
            dest.copy_(tensor)
    return bytes_read


def keeps_packed(mode: str, device: torch.device) -> bool:
    """Whether a GGUF file's block-quantized projections stay packed: `mode` "packed",
    "dequantized" or "auto", packed on CUDA only, where the Triton kernel dequantizes tiles in
    registers; elsewhere each forward would dequantize every weight, tens of times slower."""
    if mode not in ("auto", "packed", "dequantized"):
        raise ConfigError(f"gguf_weights must be auto, packed or dequantized, not {mode!r}")
    return mode == "packed" or mode == "auto" and device.type == "cuda"


def pack_gguf_projections(model: nn.Module, config: ModelConfig, gguf: GGUFFile) -> None:
    """Before allocation (`model` on the meta device): each decoder projection whose GGUF
    tensors are all block-quantized becomes a GGUFLinear that keeps them packed. Embeddings,
    norms, the LM head and projections stored as floats are dequantized at load."""
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not name.endswith(PROJECTIONS):
            continue
        parts = _packed_parts(f"{name}.weight", module.out_features, config, gguf)
        if parts is not None:
            with torch.device(module.weight.device):
                packed = GGUFLinear(module.in_features, parts, module.bias is not None)
            model.set_submodule(name, packed)


def _packed_parts(param_name: str, rows: int, config: ModelConfig,
                  gguf: GGUFFile) -> list[tuple[str, int]] | None:
    """(GGUF type, rows) of each part of a projection's weight; None unless every part is in
    the file in a block type (a missing one is named by the strict check at load)."""
    parts = []
    for source in sources_for(param_name, config):
        name = gguf_name(source.key)
        if name not in gguf.tensors or not packable(gguf.type_name(name)):
            return None
        parts.append((gguf.type_name(name), source.rows or rows))
    return parts


def _load_packed(module: GGUFLinear, name: str, offset: int, config: ModelConfig,
                 gguf: GGUFFile) -> None:
    """One GGUF tensor's codes, scales and minimums into its rows of a packed projection."""
    tensor = gguf.tensors[name]
    raw = torch.from_numpy(tensor.data).to(module.blocks[0].qweight.device)
    parts = split_codes(raw, tensor.tensor_type.name, gguf.shape(name)[0])
    codes, scales, mins = (
        None if part is None else _unpermuted(part, name, config, gguf.architecture)
        for part in parts
    )
    module.load_part(offset, codes, scales, mins)


def gguf_name(key: str) -> str | None:
    """The GGUF tensor name of a Hugging Face checkpoint key (None: GGUF has no such tensor)."""
    module, _, leaf = key.rpartition(".")
    if module in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[module]}.{leaf}"
    match = _LAYER_KEY.fullmatch(module)
    if match is None or match[2] not in LAYER_TENSORS:
        return None
    return f"blk.{match[1]}.{LAYER_TENSORS[match[2]]}.{leaf}"


def _targets(params: dict[str, Any], config: ModelConfig) -> dict[str, tuple[str, Source]]:
    targets: dict[str, tuple[str, Source]] = {}
    for name in params:
        for source in sources_for(name, config):
            targets[gguf_name(source.key) or source.key] = (name, source)
    return targets


def _check_names(targets: dict, gguf: GGUFFile, config: ModelConfig) -> None:
    missing = [name for name in targets if name not in gguf.tensors]
    ignored = {*ROPE_FACTOR_TENSORS, LLAMA3_FACTORS}
    if config.tie_word_embeddings:
        ignored.add("output.weight")
    unexpected = [name for name in gguf.tensors if name not in targets and name not in ignored]
    check_tensor_names(gguf.path.name, config.architecture, missing, unexpected)


def _check_shapes(targets: dict, shapes: dict[str, tuple[int, ...]], gguf: GGUFFile) -> None:
    wrong = []
    for name, (param_name, source) in targets.items():
        expected = source.shape(shapes[param_name])
        if gguf.shape(name) != expected:
            wrong.append(f"{name}: file {list(gguf.shape(name))}, model expects {list(expected)}")
    if wrong:
        raise CheckpointMismatch(
            f"shape mismatch in {len(wrong)} tensor(s) of {gguf.path.name}: {name_list(wrong)}"
        )


def _unpermuted(tensor: torch.Tensor, name: str, config: ModelConfig, arch: str) -> torch.Tensor:
    """llama.cpp stores a llama query/key head's rows as interleaved rotary pairs (x0, x_{d/2},
    x1, ...); Hugging Face's rotate-half layout keeps the halves apart. Weights and biases alike."""
    if arch not in PERMUTED_QK or not name.endswith(("attn_q.weight", "attn_q.bias",
                                                     "attn_k.weight", "attn_k.bias")):
        return tensor
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    rows = tensor.shape[0]
    pairs = tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
    return pairs.transpose(1, 2).reshape(tensor.shape)


# ---- noesis info --------------------------------------------------------------------------------


def describe_gguf(gguf: GGUFFile) -> dict[str, str]:
    """`noesis info`'s GGUF lines: the architecture as the file names it, and per tensor type how
    many tensors, values and bytes the file holds (its "checkpoint dtype")."""
    by_type: dict[str, list[int]] = {}
    for tensor in gguf.tensors.values():
        count = by_type.setdefault(tensor.tensor_type.name, [0, 0, 0])
        count[0] += 1
        count[1] += int(tensor.n_elements)
        count[2] += int(tensor.n_bytes)
    types = "; ".join(
        f"{name} ({tensors} tensors, {values / 1e6:.1f}M values, {_mib(size)})"
        for name, (tensors, values, size) in sorted(by_type.items(), key=lambda kv: -kv[1][2])
    )
    name = gguf.metadata.get("general.name")
    return {
        "gguf architecture": gguf.architecture + (f" ({name})" if name else ""),
        "checkpoint dtype": f"GGUF {types}",
    }


def _mib(num_bytes: int) -> str:
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / (1 << 30):.2f} GiB"
