"""`noesis quantize`: a float checkpoint rewritten with weight-only int4 or int8 projections, by
round-to-nearest, in layouts other tools read as well.

- int4: asymmetric, per group of `group_size` input columns (a scale and a zero point each),
  written in AWQ's gemm layout (AutoAWQ, vLLM and transformers load it).
- int8: symmetric (zero point 128), per output channel by default, written in GPTQ's v1 layout
  with bits 8 and no act-order (group_size -1; AutoGPTQ, vLLM and transformers load it).

Every attention and MLP projection of the text model is quantized; embeddings, norms and the LM
head are copied as they are, and so are the tokenizer and the other files beside the weights.
Scales are float16, as both formats store them; codes are rounded against the float16 scales.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from noesis.errors import ConfigError, UnsupportedModel
from noesis.models.config import ModelConfig
from noesis.quant.packing import awq_checkpoint, gptq_checkpoint
from noesis.quant.scheme import FAMILIES, awq_config, gptq_config
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file
from noesis.weights.mapping import capability_of
from noesis.weights.safetensors_io import (
    INDEX_NAME,
    checkpoint_files,
    header_shapes,
    iter_tensors,
)

PROJECTION = re.compile(r".*\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
DEFAULT_GROUP = {4: 128, 8: -1}


def quantize_checkpoint(src: Path, dst: Path, bits: int, group_size: int | None = None,
                        progress: bool = True) -> dict[str, int]:
    """Write the quantized copy of checkpoint `src` to the new directory `dst`; returns the
    bytes of weights read and written and the number of projections quantized."""
    group_size = DEFAULT_GROUP[bits] if group_size is None else group_size
    raw = read_json_file(src / "config.json", CONFIG_MAX_BYTES)
    config = ModelConfig.from_hf(raw)
    _check_source(config, bits, group_size)
    if dst.exists() and any(dst.iterdir()):
        raise ConfigError(f"{dst} exists and is not empty; name a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    keys = {path: list(header_shapes(path)) for path in files}
    bar = tqdm(total=sum(map(len, keys.values())), desc="Quantizing", unit="tensor",
               disable=not progress)
    totals = {"bytes_read": 0, "bytes_written": 0, "projections": 0}
    weight_map = {}
    for path, names in keys.items():
        tensors = {}
        for key, tensor in iter_tensors(path, names):
            totals["bytes_read"] += tensor.nbytes
            if PROJECTION.fullmatch(key) and capability_of(key, config) == "text":
                tensors |= _quantized(key, tensor, bits, group_size)
                totals["projections"] += 1
            else:
                tensors[key] = tensor
            bar.update(1)
        save_file(tensors, dst / path.name, metadata={"format": "pt"})
        totals["bytes_written"] += sum(t.nbytes for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, path.name)
    bar.close()
    _copy_the_rest(src, dst, raw, bits, group_size, weight_map)
    return totals


def quantize_int4(weight: torch.Tensor, group_size: int):
    """Asymmetric round-to-nearest int4 per group: (codes [N, K], zero points [N, G], float16
    scales [N, G]) with weight ~= (codes - zero) * scale."""
    groups = weight.float().reshape(weight.shape[0], -1, group_size)  # [N, G, g]
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low).clamp_min(1e-5) / 15).half()
    zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (groups / scales.float()[..., None]).round() + zeros[..., None]
    return codes.clamp(0, 15).flatten(1).int(), zeros.int(), scales


def quantize_int8(weight: torch.Tensor, group_size: int):
    """Symmetric round-to-nearest int8 (zero point 128) per group, or per output row when
    group_size is -1: (codes [N, K], zero points [N, G], float16 scales [N, G])."""
    group = weight.shape[1] if group_size == -1 else group_size
    groups = weight.float().reshape(weight.shape[0], -1, group)  # [N, G, g]
    scales = (groups.abs().amax(-1).clamp_min(1e-8) / 127).half()
    codes = (groups / scales.float()[..., None]).round() + 128
    zeros = torch.full(scales.shape, 128, dtype=torch.int32)
    return codes.clamp(0, 255).flatten(1).int(), zeros, scales


def _quantized(key: str, weight: torch.Tensor, bits: int, group_size: int):
    """One float projection [N, K] as its checkpoint tensors."""
    base = key.removesuffix(".weight")
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    if in_features % group or out_features % (32 // bits) or in_features % (32 // bits):
        raise UnsupportedModel(
            f"{key}: a [{out_features}, {in_features}] weight does not split into groups of "
            f"{group} input columns and {32 // bits}-value words; choose another --group-size"
        )
    if bits == 4:
        qweight, qzeros, scales = awq_checkpoint(*quantize_int4(weight, group))
        return {f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales}
    qweight, qzeros, scales = gptq_checkpoint(*quantize_int8(weight, group_size), bits=8)
    g_idx = (torch.arange(in_features) // group).to(torch.int32)
    return {f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales,
            f"{base}.g_idx": g_idx}


def _check_source(config: ModelConfig, bits: int, group_size: int) -> None:
    if config.family not in FAMILIES:
        raise UnsupportedModel(f"noesis quantize supports the families {sorted(FAMILIES)}, "
                               f"not {config.family!r}")
    if config.raw.get("quantization_config"):
        raise UnsupportedModel("the source checkpoint is already quantized; give a float one")
    if bits not in DEFAULT_GROUP:
        raise ConfigError(f"--bits must be 4 or 8, got {bits}")
    if group_size < 16 and not (bits == 8 and group_size == -1):
        raise ConfigError(f"--group-size must be 16 or more (or -1 for int8), got {group_size}")


def _copy_the_rest(src: Path, dst: Path, raw: dict, bits: int, group_size: int,
                   weight_map: dict[str, str]) -> None:
    """config.json with its quantization_config, a shard index when the source had one, and
    every other regular file (tokenizer, generation config, chat template) as it is."""
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
            "config.json", INDEX_NAME
        ):
            shutil.copy2(path, dst / path.name)
    scheme = awq_config(group_size) if bits == 4 else gptq_config(bits, group_size)
    (dst / "config.json").write_text(json.dumps(raw | {"quantization_config": scheme}, indent=2))
    if (src / INDEX_NAME).exists():
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2))
