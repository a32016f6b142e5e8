"""Turning a model argument into a loaded model, tokenizer, and resolved device/dtype."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from noesis.errors import ConfigError
from noesis.models.config import ModelConfig
from noesis.models.decoder import DecoderLM
from noesis.models.registry import model_class
from noesis.tokenizer import Tokenizer
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file
from noesis.weights.hub import resolve_model_dir
from noesis.weights.loader import load_weights
from noesis.weights.memory import check_fits, weight_needs

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
) -> LoadedModel:
    start = time.perf_counter()
    model_dir = resolve_model_dir(model, revision)
    config = read_model_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, config.eos_token_ids)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        module = model_class(config)(config)
    check_fits(
        weight_needs(module, config, dtype), device, f"the model's weights in {_dtype_name(dtype)}",
        "Use a smaller model, a narrower dtype or a device with more memory.",
    )
    try:
        module = module.to(dtype=dtype).to_empty(device=device)
    except torch.OutOfMemoryError as exc:
        size = sum(p.numel() for p in module.parameters()) * dtype.itemsize
        raise ConfigError(
            f"the model's weights ({size / 2**30:.2f} GiB in {dtype}) do not fit on {device}"
        ) from exc
    load_weights(module, config, model_dir, progress=progress)
    module.eval()
    seconds = time.perf_counter() - start
    return LoadedModel(model_dir, config, module, tokenizer, device, dtype, seconds)


def describe_checkpoint(model: str | Path, dtype="auto", device="cpu") -> dict[str, str]:
    """What `noesis info` prints, read from config.json and safetensors headers (no weights)."""
    from noesis.kv.cache import page_bytes
    from noesis.weights.safetensors_io import checkpoint_files, tensor_index

    model_dir = resolve_model_dir(model)
    config = read_model_config(model_dir)
    files = checkpoint_files(model_dir)
    num_params = sum(_numel(shape) for _, shape in tensor_index(files).values())
    target = resolve_dtype(dtype, config, resolve_device(device))
    elem = torch.empty((), dtype=target).element_size()
    kv_per_token = page_bytes(config, 1, target)
    return {
        "path": str(model_dir),
        "architecture": f"{config.architecture} (family {config.family})",
        "parameters": f"{num_params:,} ({num_params / 1e6:.1f}M)",
        "checkpoint dtype": str(config.torch_dtype),
        "checkpoint files": f"{len(files)} ({_gib(sum(f.stat().st_size for f in files))})",
        "load dtype": _dtype_name(target),
        "weights in memory": _gib(num_params * elem),
        "layers": str(config.num_layers),
        "hidden / intermediate": f"{config.hidden_size} / {config.intermediate_size}",
        "heads (q / kv) x dim": f"{config.num_heads} / {config.num_kv_heads} x {config.head_dim}",
        "vocab": str(config.vocab_size),
        "context": str(config.max_position_embeddings),
        "rope": f"{config.rope.rope_type}, theta {config.rope.theta:g}",
        "tied embeddings": str(config.tie_word_embeddings),
        "KV cache per token": f"{kv_per_token:,} bytes",
    }


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
