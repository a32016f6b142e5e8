"""Turning a model argument into a loaded model, tokenizer, and resolved device/dtype."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from noesis.errors import ConfigError
from noesis.models.capabilities import RUNNABLE, check_load
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM
from noesis.models.registry import model_class
from noesis.quant import linear as quant_linear
from noesis.tokenizer import Tokenizer
from noesis.weights import mxfp4
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file
from noesis.weights.gguf import (
    gguf_config,
    is_gguf,
    keeps_packed,
    load_gguf_weights,
    open_gguf,
    pack_gguf_projections,
)
from noesis.weights.gguf_tokenizer import gguf_tokenizer
from noesis.weights.hub import resolve_model_dir
from noesis.weights.loader import load_weights
from noesis.weights.memory import check_fits, weight_needs
from noesis.weights.paging import ReadClock

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model_dir: Path
    config: ModelConfig
    model: DecoderLM
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    # The cold load in two buckets that sum to load_seconds. read_s: the model's files into
    # memory (config, tokenizer, the checkpoint's tensors from disk or the page cache; the
    # skeleton built on the meta device, a few ms, counts here too); place_s: device memory
    # allocated, the tensors converted to the dtype and copied into it.
    load_phases: dict[str, float] = field(default_factory=dict)
    bytes_read: int = 0  # of checkpoint tensors: a multimodal checkpoint's text model only


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(
            f"unknown device {device!r} (use cpu, cuda, cuda:N, mps or auto)"
        ) from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but PyTorch sees no CUDA device")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' requested but MPS is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device):
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(config.torch_dtype), torch.bfloat16)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_model_config(model_dir: Path) -> ModelConfig:
    """config.json, refused unless it is a regular file of a sane size holding a valid config."""
    return ModelConfig.from_hf(read_json_file(model_dir / "config.json", CONFIG_MAX_BYTES))


def load_model(
    model: str | Path,
    device="auto",
    dtype="auto",
    revision: str | None = None,
    progress: bool = True,
    gguf_weights: str = "auto",
    capabilities: tuple[str, ...] = ("text",),
) -> LoadedModel:
    """`gguf_weights` (GGUF files): "packed", "dequantized", or "auto" (EngineConfig's);
    `capabilities`: those to load, checked against the checkpoint's before any weight is read
    (noesis.models.capabilities)."""
    start = time.perf_counter()
    gguf = open_gguf(model) if is_gguf(model) else None
    if gguf is not None:  # one file: metadata, vocabulary and (quantized) tensors
        model_dir, config = gguf.path, gguf_config(gguf)
        tokenizer = gguf_tokenizer(gguf, config)
    else:
        model_dir = resolve_model_dir(model, revision)
        config = read_model_config(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir, config.eos_token_ids)
    check_load(capabilities, config.capabilities, config.architecture)
    if config.family == "gpt_oss":
        _render_harmony(tokenizer)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        module = model_class(config)(config)
    if gguf is not None and keeps_packed(gguf_weights, device):
        pack_gguf_projections(module, config, gguf)
    if config.moe is not None and config.moe.mxfp4 and mxfp4.keeps_packed(device):
        mxfp4.pack_experts(module)  # the fused experts kernel reads them packed
    check_fits(
        weight_needs(module, config, dtype), device, f"the model's weights in {_dtype_name(dtype)}",
        "Use a smaller model, a narrower dtype or a device with more memory.",
    )
    placing = time.perf_counter()
    try:
        module = module.to(dtype=dtype).to_empty(device=device)
    except torch.OutOfMemoryError as exc:
        size = sum(p.numel() for p in module.parameters()) * dtype.itemsize
        raise ConfigError(
            f"the model's weights ({size / 2**30:.2f} GiB in {dtype}) do not fit on {device}"
        ) from exc
    clock = ReadClock()
    if gguf is not None:
        bytes_read = load_gguf_weights(module, config, gguf, progress=progress, clock=clock)
    else:
        bytes_read = load_weights(module, config, model_dir, progress=progress, clock=clock)
    if config.moe is not None and config.moe.mxfp4 and mxfp4.keeps_packed(device):
        mxfp4.fragment_experts(module)  # the layout the experts kernels read
    if quant_linear.INT4_FRAGMENTS and device.type == "cuda":
        from noesis.kernels.asm import bf16x2_asm  # (its Triton functions: imported late)

        if bf16x2_asm(device):
            quant_linear.fragment_projections(module)  # the layout the int4 kernels read fastest
    module.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies are done: place_s is the whole placement
        # The repacking's freed layouts and temporaries go back to the driver: the KV budget
        # is what the device has free after this.
        torch.cuda.empty_cache()
    end = time.perf_counter()
    read_s = placing - start + clock.seconds
    phases = {"read_s": read_s, "place_s": end - start - read_s}
    return LoadedModel(model_dir, config, module, tokenizer, device, dtype, end - start, phases,
                       bytes_read)


def _render_harmony(tokenizer: Tokenizer) -> None:
    """gpt-oss speaks Harmony: its conversations render through noesis.harmony (openai-harmony's
    ids), when its vocabulary has Harmony's tokens; over tiktoken's o200k_harmony when the
    vocabulary is that one (built in a second, where a byte-level copy of a 200k-token
    tokenizer.json takes several)."""
    from noesis.harmony import HarmonyEncoding, UnsupportedTokenizer, VocabularyMissing
    from noesis.harmony.tokenizer_file import is_o200k_harmony

    try:
        if is_o200k_harmony(tokenizer.backend):
            encoding = HarmonyEncoding.o200k_harmony()
        else:
            encoding = HarmonyEncoding.from_tokenizer(tokenizer)
    except (UnsupportedTokenizer, VocabularyMissing) as exc:
        logger.warning("gpt-oss checkpoint without a Harmony vocabulary noesis can read (%s): "
                       "its chat template renders conversations", exc)
        return
    tokenizer.render_with_harmony(encoding)


def describe_checkpoint(model: str | Path, dtype="auto", device="cpu",
                        revision: str | None = None) -> dict[str, str]:
    """What `noesis info` prints, read from config.json and safetensors headers (no weights)."""
    from noesis.kv.cache import page_bytes
    from noesis.kv.fp8 import FP8
    from noesis.quant.info import packed_weight_lines
    from noesis.weights.gguf import describe_gguf
    from noesis.weights.safetensors_io import checkpoint_files, tensor_index

    gguf = open_gguf(model) if is_gguf(model) else None
    if gguf is not None:
        model_dir, config, files = gguf.path, gguf_config(gguf), [gguf.path]
        index = {name: (gguf.path, gguf.shape(name)) for name in gguf.tensors}
    else:
        model_dir = resolve_model_dir(model, revision)
        config = read_model_config(model_dir)
        files = checkpoint_files(model_dir)
        index = tensor_index(files)
    params = _parameter_counts(index, config)  # capability -> count, "experts"
    num_params = sum(count for name, count in params.items() if name != "experts")
    target = resolve_dtype(dtype, config, resolve_device(device))
    elem = torch.empty((), dtype=target).element_size()
    kv_per_token = page_bytes(config, 1, target)
    info = {
        "path": str(model_dir),
        "architecture": f"{config.architecture} (family {config.family})",
        "parameters": f"{num_params:,} ({num_params / 1e6:.1f}M)",
        "checkpoint dtype": str(config.torch_dtype),
        "checkpoint files": f"{len(files)} ({_gib(sum(f.stat().st_size for f in files))})",
        "load dtype": _dtype_name(target),
        "weights in memory": _gib(params["text"] * elem),
        "capabilities": _capabilities_line(params, elem),
        "layers": str(config.num_layers),
        "hidden / intermediate": f"{config.hidden_size} / {config.intermediate_size}",
        "heads (q / kv) x dim": f"{config.num_heads} / {config.num_kv_heads} x {config.head_dim}",
        "vocab": str(config.vocab_size),
        "context": str(config.max_position_embeddings),
        "rope": f"{config.rope.rope_type}, theta {config.rope.theta:g}",
        "tied embeddings": str(config.tie_word_embeddings),
        "KV cache per token": f"{kv_per_token:,} bytes ({page_bytes(config, 1, FP8):,} with "
                              "--kv-cache-dtype fp8)",
    }
    if gguf is not None:
        info |= describe_gguf(gguf) | _gguf_weight_lines(gguf, config, target, device)
    info |= packed_weight_lines(index, config, target)  # AWQ / GPTQ: bytes packed vs float
    if config.moe is not None and config.moe.mxfp4:
        info |= mxfp4.packed_memory_lines(index, params["text"] * elem, target,
                                          resolve_device(device))  # fmt: skip
    return info | _routed_and_conv(config, params["text"], params["experts"], elem)


def _gguf_weight_lines(gguf, config: ModelConfig, dtype: torch.dtype,
                       device: str) -> dict[str, str]:
    """`noesis info`'s GGUF memory lines: the weights with the block-quantized projections
    packed, against all of them dequantized, and which of the two a load on `device` keeps."""
    with torch.device("meta"):
        module = model_class(config)(config)
    floats = sum(need.num_bytes for need in weight_needs(module, config, dtype))
    pack_gguf_projections(module, config, gguf)
    packed = sum(need.num_bytes for need in weight_needs(module, config, dtype))
    on = resolve_device(device)
    kept = (f"{_gib(packed)} (projections packed, the rest in {_dtype_name(dtype)})"
            if keeps_packed("auto", on) else
            f"{_gib(floats)} (dequantized to {_dtype_name(dtype)} at load)")
    return {
        "weights in memory": kept,
        "gguf packed weights": f"{_gib(packed)}, {packed / floats:.0%} of {_gib(floats)} "
                               f"dequantized (default on CUDA; --gguf-weights chooses)",
    }


def _parameter_counts(index: dict, config: ModelConfig) -> dict[str, int]:
    """Parameters per capability ("text", "vision", ...) and, under "experts", those of routed
    experts, from tensor shapes: an MXFP4 block byte holds two values and its scales none."""
    from noesis.quant.info import values_held
    from noesis.quant.scheme import weight_quant
    from noesis.weights.mapping import capability_of

    quant = weight_quant(config)
    counts = dict.fromkeys((*config.capabilities, "experts"), 0)
    for key, (_, shape) in index.items():
        count = _numel(shape) * (2 if key.endswith("_blocks") else 1)
        count = 0 if key.endswith("_scales") else count
        count = values_held(key, count, quant)  # AWQ / GPTQ words hold several values
        counts[capability_of(key, config)] += count
        counts["experts"] += count if ".experts." in key else 0
    return counts


def _capabilities_line(params: dict[str, int], elem: int) -> str:
    """What each capability's weights cost in memory; only text is loaded (the others would be
    with an encoder noesis lacks: noesis.models.capabilities.RUNNABLE)."""
    return "; ".join(
        f"{name} {_gib(count * elem)}" + (" (loaded)" if name in RUNNABLE else " (not loaded)")
        for name, count in params.items()
        if name != "experts"
    )


def _routed_and_conv(config: ModelConfig, num_params: int, expert_params: int, elem: int):
    """`noesis info`'s lines for routed experts (how many, the parameters one token uses) and
    short-convolution layers (their fixed state per sequence)."""
    lines = {}
    moe = config.moe
    if moe is not None:
        sparse = config.num_layers - len(moe.dense_layers)
        active = num_params - expert_params + expert_params * moe.top_k // moe.num_experts
        lines["experts"] = (f"{moe.num_experts} per layer, {moe.top_k} routed per token "
                            f"({sparse} of {config.num_layers} layers)")
        lines["active parameters"] = f"{active:,} ({active / 1e6:.1f}M) per token"
    if config.conv_layers:
        state = len(config.conv_layers) * (config.conv_kernel - 1) * config.hidden_size * elem
        lines["conv layers"] = (f"{len(config.conv_layers)} of {config.num_layers}, kernel "
                                f"{config.conv_kernel}; state {state:,} bytes per sequence")
    return lines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _gib(num_bytes: int) -> str:
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / (1 << 30):.2f} GiB"
