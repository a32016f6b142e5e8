"""SentenceEmbedder: a BERT-family sentence-transformers checkpoint, loaded strictly and pooled as
its own `modules.json` and `1_Pooling/config.json` say (mean pooling when they are absent)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from noesis.errors import (
    CheckpointError,
    CheckpointMismatch,
    InvalidRequest,
    PromptTooLong,
    UnsupportedModel,
)
from noesis.models.bert import BertConfig, BertModel
from noesis.tokenizer import Tokenizer
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file, read_text_file
from noesis.weights.safetensors_io import checkpoint_files, iter_tensors, tensor_index

# sentence-transformers' pooling flags -> the one mode each names
POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
MODULE_TYPES = ("Transformer", "Pooling", "Normalize")  # sentence_transformers.models.*
# BERT's own pooler, its pre-training heads and a classifier's head (encoder_classifier.py)
IGNORED_PREFIXES = ("pooler.", "cls.", "classifier.")
MAX_NAMES = 10
# A matrix may be stored as int8 codes with one float scale a row beside it, "<name>.row_scale"
# [rows]: the bundled safety classifier's storage (half of float16's bytes), made float on load.
ROW_SCALE = ".row_scale"


@dataclass(frozen=True)
class Pooling:
    mode: str  # mean | cls | max | last
    normalize: bool  # a Normalize module follows the pooling
    max_tokens: int  # sentence_bert_config.json's max_seq_length, within the positions


def read_pooling(model_dir: Path, max_positions: int) -> Pooling:
    """The checkpoint's pooling: modules.json's pipeline (Transformer -> Pooling [-> Normalize])
    and the Pooling module's flags; mean pooling without normalization when absent."""
    mode, normalize = "mean", False
    modules_file = model_dir / "modules.json"
    if modules_file.exists():
        modules = _read_modules(modules_file)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        unknown = [k for k in kinds if k not in MODULE_TYPES]
        if unknown:
            raise UnsupportedModel(f"{modules_file}: modules {unknown} are not supported "
                                   f"(supported: {', '.join(MODULE_TYPES)})")
        normalize = "Normalize" in kinds
        pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pooling is not None:
            mode = _pooling_mode(model_dir / str(pooling.get("path", "1_Pooling")))
    bert_config = model_dir / "sentence_bert_config.json"
    settings = read_json_file(bert_config, CONFIG_MAX_BYTES) if bert_config.exists() else {}
    max_tokens = settings.get("max_seq_length") or max_positions
    return Pooling(mode, normalize, min(int(max_tokens), max_positions))


def _read_modules(path: Path) -> list[dict]:
    """modules.json: a JSON list of {"type", "path", ...} objects."""
    try:
        modules = json.loads(read_text_file(path, CONFIG_MAX_BYTES))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{path} must hold a JSON list of module objects")
    return modules


def _pooling_mode(pooling_dir: Path) -> str:
    flags = read_json_file(pooling_dir / "config.json", CONFIG_MAX_BYTES)
    on = [key for key, value in flags.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in POOLING_FLAGS:
        raise UnsupportedModel(f"{pooling_dir}/config.json: pooling {on or 'none'} is not "
                               f"supported; one of {', '.join(POOLING_FLAGS)}")
    return POOLING_FLAGS[on[0]]


class SentenceEmbedder:
    """Texts (or token-id lists) -> sentence embeddings [N, D], float32 on the host."""

    truncatable = False  # `dimensions` would cut a vector its training never shortened

    def __init__(self, path: str | Path, name: str | None = None, device: str = "cpu") -> None:
        self.model_dir = Path(path)
        self.name = name or self.model_dir.name
        self.device = torch.device(device)
        self.config = BertConfig.from_hf(read_json_file(self.model_dir / "config.json",
                                                        CONFIG_MAX_BYTES))
        self.pooling = read_pooling(self.model_dir, self.config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.model = load_bert(self.model_dir, self.config, self.device)
        self._lock = threading.Lock()  # one forward at a time: torch's threads are shared

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    def tokenize(self, text: str, truncate: bool = False) -> list[int]:
        """Ids with [CLS]/[SEP]; past max_tokens: truncated (keeping the last, [SEP]) or
        PromptTooLong."""
        ids = self.tokenizer.encode(text)
        if len(ids) > self.pooling.max_tokens and truncate:
            return ids[: self.pooling.max_tokens - 1] + ids[-1:]
        return self.check_ids(ids)

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequest("an input to embed is empty")
        if len(ids) > self.pooling.max_tokens:
            raise PromptTooLong(len(ids), self.pooling.max_tokens)
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of range [0, {vocab}): {bad[:10]}")
        return ids

    def embed(self, inputs: list[str | list[int]]) -> torch.Tensor:
        """One padded batch through the encoder, pooled over the real tokens."""
        ids = [self.tokenize(x) if isinstance(x, str) else self.check_ids(x) for x in inputs]
        batch, mask = padded(ids)
        with self._lock, torch.inference_mode():
            hidden = self.model(batch.to(self.device), mask.to(self.device)).float()
            pooled = pool(hidden, mask.to(self.device), self.pooling.mode)
        return (F.normalize(pooled, dim=-1) if self.pooling.normalize else pooled).cpu()


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [B, L, D] over the tokens `mask` [B, L] keeps -> [B, D]."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    if mode == "max":
        return hidden.masked_fill(~mask[..., None], float("-inf")).amax(1)
    weights = mask[..., None].float()
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def load_bert(model_dir: Path, config: BertConfig, device: torch.device) -> BertModel:
    """The encoder with every parameter filled exactly once from the checkpoint (a `bert.`
    prefix is dropped; the pooler and pre-training heads are skipped), or CheckpointMismatch
    naming the missing, unexpected or mis-shaped tensors."""
    model = BertModel(config)
    params = dict(model.named_parameters())
    index = tensor_index(checkpoint_files(model_dir))
    keys = {key.removeprefix("bert."): key for key in index
            if not key.removeprefix("bert.").startswith(IGNORED_PREFIXES)
            and not key.endswith(("position_ids", ROW_SCALE))}
    _check_names(params, keys)
    stray = [k for k in index if k.endswith(ROW_SCALE) and k.removesuffix(ROW_SCALE) not in index]
    if stray:
        raise CheckpointMismatch(f"row scales of no encoder tensor: {stray[:MAX_NAMES]}")
    wrong = [f"{keys[n]}: checkpoint {list(index[keys[n]][1])}, model {list(p.shape)}"
             for n, p in params.items() if tuple(index[keys[n]][1]) != tuple(p.shape)]
    if wrong:
        raise CheckpointMismatch(f"shape mismatch in {len(wrong)} tensor(s): "
                                 f"{'; '.join(wrong[:MAX_NAMES])}")
    with torch.no_grad():
        for name, param in params.items():
            path = index[keys[name]][0]
            for _, tensor in iter_tensors(path, [keys[name]]):
                param.copy_(_dequantized(index, keys[name], tensor))
    return model.to(device).eval()


def _dequantized(index: dict, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as stored, or an int8 matrix times its ROW_SCALE companion's rows."""
    if tensor.dtype != torch.int8:
        return tensor
    scale_key = key + ROW_SCALE
    if tensor.dim() != 2 or scale_key not in index:
        raise CheckpointMismatch(f"{key}: int8 {list(tensor.shape)} needs a 2-D tensor and "
                                 f"its row scales {scale_key!r}")
    _, scale = next(iter_tensors(index[scale_key][0], [scale_key]))
    if tuple(scale.shape) != (tensor.shape[0],):
        raise CheckpointMismatch(f"{scale_key}: shape {list(scale.shape)}, the rows of {key} "
                                 f"need [{tensor.shape[0]}]")
    return tensor.float() * scale.float()[:, None]


def _check_names(params: dict, keys: dict[str, str]) -> None:
    missing = [name for name in params if name not in keys]
    unexpected = [keys[name] for name in keys if name not in params]
    if missing or unexpected:
        raise CheckpointMismatch(
            f"checkpoint does not match BertModel: missing {len(missing)} tensor(s) "
            f"{missing[:MAX_NAMES]}; unexpected {len(unexpected)} {unexpected[:MAX_NAMES]}"
        )


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows -> (ids [B, L] zero-padded to the longest, mask [B, L] of the real ones)."""
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.int64)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return ids, mask
