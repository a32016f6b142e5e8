"""ModelConfig: the only reader of a checkpoint's config.json; inward code trusts its fields.

`from_hf` checks every value it reads before anything is sized from it: its JSON type, its range
and its consistency with the others. A bad one is `InvalidModelConfig` naming the field, the value
and the limit; a well-formed feature noesis lacks is `UnsupportedModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from noesis.errors import InvalidModelConfig, UnsupportedModel

# Hugging Face architecture name -> our family name. models/registry.py maps families to classes.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = ("silu",)

# Upper bounds far above every released checkpoint (the largest have a 262k vocabulary, hidden
# 16-25k, intermediate ~74k, ~130 layers, 128 heads of 256, 10M positions). A value past one is a
# typo or a hostile file; refusing it here keeps start-up from sizing anything by it.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 24,
    "original_max_position_embeddings": 1 << 24,
    "sliding_window": (1 << 31) - 1,
    "bos_token_id": (1 << 31) - 1,
    "eos_token_id": (1 << 31) - 1,
}
_REQUIRED = object()  # a field read with this default must be present
_LIMIT = object()  # a bound read from LIMITS


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalized from `rope_scaling` / `rope_parameters`."""

    rope_type: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def length_dependent(self) -> bool:
        """Frequencies depend on the sequence length reached (dynamic NTK, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    def table_bytes(self, num_positions: int) -> int:
        """Bytes of the float32 cos/sin tables RotaryEmbedding builds for `num_positions`
        (longrope keeps a second pair for its long factors)."""
        tables = 4 if self.rope_type == "longrope" else 2
        return tables * num_positions * self.rotary_dim * 4


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of a decoder-only transformer."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Validate a parsed config.json (types, ranges, consistency), then normalize it."""
        if not isinstance(cfg, dict):
            raise InvalidModelConfig("top level", f"expected a JSON object, got {_show(cfg)}")
        architecture = _architecture(cfg)
        family = ARCHITECTURES[architecture]
        cfg = {**cfg, **_object(cfg, "text_config")}
        shape = _shape(cfg)
        rope = _rope(cfg, shape["head_dim"], shape["max_position_embeddings"])
        _check_context(shape["max_position_embeddings"], rope)
        act = _str(cfg, "hidden_act", _str(cfg, "hidden_activation", "silu"))
        if act not in ACTIVATIONS:
            raise UnsupportedModel(
                f"hidden_act {act!r} is not supported (supported: {ACTIVATIONS})"
            )
        _object(cfg, "quantization_config")  # read by models/decoder.py as a dict
        attention_bias = _bool(cfg, "attention_bias", False)
        return cls(
            architecture=architecture,
            family=family,
            **shape,
            rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
            rope=rope,
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            attention_bias=attention_bias,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=_bool(cfg, "mlp_bias", False),
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(cfg, family, shape["num_layers"]),
            hidden_act=act,
            torch_dtype=_str(cfg, "torch_dtype", None) or _str(cfg, "dtype", None),
            bos_token_id=_int(cfg, "bos_token_id", None, low=0),
            eos_token_ids=_eos_ids(cfg),
            raw=cfg,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(arch, str) for arch in archs):
        raise InvalidModelConfig("architectures", f"expected a list of names, got {_show(archs)}")
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    named = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise UnsupportedModel(
        f"unsupported architecture {named}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def _shape(cfg: dict[str, Any]) -> dict[str, int]:
    """The integer sizes, each in range, and consistent: heads split hidden_size evenly when
    head_dim is absent, and key/value heads split the query heads."""
    hidden = _int(cfg, "hidden_size")
    num_heads = _int(cfg, "num_attention_heads")
    head_dim = _int(cfg, "head_dim", None)
    if head_dim is None:
        if hidden % num_heads:
            raise InvalidModelConfig(
                "num_attention_heads",
                f"{num_heads} does not divide hidden_size={hidden} (and head_dim is not given)",
            )
        head_dim = hidden // num_heads
    num_kv = _int(cfg, "num_key_value_heads", num_heads)
    if num_heads % num_kv:
        raise InvalidModelConfig(
            "num_key_value_heads",
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}",
        )
    return {
        "vocab_size": _int(cfg, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": _int(cfg, "intermediate_size"),
        "num_layers": _int(cfg, "num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": num_kv,
        "head_dim": head_dim,
        # capped by _check_context, whose message says what the RoPE tables would cost
        "max_position_embeddings": _int(cfg, "max_position_embeddings", 2048, high=None),
    }


def _check_context(max_pos: int, rope: RopeConfig) -> None:
    """The RoPE tables are built for the whole context at load: cap it, and say what it costs."""
    limit = LIMITS["max_position_embeddings"]
    if max_pos > limit:
        gib = rope.table_bytes(max_pos) / (1 << 30)
        raise InvalidModelConfig(
            "max_position_embeddings",
            f"{max_pos:,} is above the limit {limit:,} (its RoPE cos/sin tables alone would "
            f"need {gib:,.1f} GiB)",
        )


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    if isinstance(value, list):
        return tuple(_int({"eos_token_id": v}, "eos_token_id", low=0) for v in value)
    eos = _int(cfg, "eos_token_id", None, low=0)
    return () if eos is None else (eos,)


def _sliding_window(cfg: dict[str, Any], family: str, num_layers: int) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or window == 0:
        return None
    window = _int(cfg, "sliding_window")
    if family not in ("qwen2", "qwen3"):
        return window
    if not _bool(cfg, "use_sliding_window", False):
        return None
    # Qwen2/3 slide only in layers >= max_window_layers (28 when unset, as in transformers);
    # newer configs spell the result out as layer_types.
    first = _int(cfg, "max_window_layers", 28, low=0, high=None)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    if not isinstance(types, list) or not all(isinstance(kind, str) for kind in types):
        raise InvalidModelConfig("layer_types", f"expected a list of names, got {_show(types)}")
    if all(kind == "full_attention" for kind in types):
        return None
    if all(kind == "sliding_attention" for kind in types):
        return window
    raise UnsupportedModel(
        "models mixing full and sliding-window attention layers (max_window_layers / "
        "layer_types) are not supported"
    )


def _rope(cfg: dict[str, Any], head_dim: int, max_pos: int) -> RopeConfig:
    params = _rope_params(cfg)
    rope_type = _str(params, "rope_type", _str(params, "type", "default"))
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})"
        )
    partial = _number(params, "partial_rotary_factor", None) or _number(
        cfg, "partial_rotary_factor", 1.0
    )
    rotary_dim = _rotary_dim(head_dim, partial)
    original = _original_context(cfg, params, rope_type, max_pos)
    factor = _number(params, "factor", None) or _default_factor(rope_type, max_pos, original)
    rope = RopeConfig(
        rope_type=rope_type,
        theta=_number(params, "rope_theta", None, low=1.0)
        or _number(cfg, "rope_theta", 10000.0, low=1.0),
        rotary_dim=rotary_dim,
        factor=factor,
        original_max_position_embeddings=original,
        low_freq_factor=_number(params, "low_freq_factor", 1.0),
        high_freq_factor=_number(params, "high_freq_factor", 4.0),
        beta_fast=_number(params, "beta_fast", None) or 32.0,
        beta_slow=_number(params, "beta_slow", None) or 1.0,
        mscale=_number(params, "mscale", None, low=None),
        mscale_all_dim=_number(params, "mscale_all_dim", None, low=None),
        attention_factor=_number(params, "attention_factor", None),
        truncate=_bool(params, "truncate", True),
        short_factor=_factors(params, "short_factor", rope_type, rotary_dim),
        long_factor=_factors(params, "long_factor", rope_type, rotary_dim),
    )
    if rope.rope_type == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
        raise InvalidModelConfig(
            "high_freq_factor",
            f"{rope.high_freq_factor} must be above low_freq_factor={rope.low_freq_factor}",
        )
    return rope


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = _object(cfg, key)
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported")
    return params


def _rotary_dim(head_dim: int, partial: float) -> int:
    if partial > 1.0:
        raise InvalidModelConfig("partial_rotary_factor", f"{partial} is above the limit 1.0")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 4 or rotary_dim % 2:
        raise InvalidModelConfig(
            "partial_rotary_factor",
            f"head_dim={head_dim} x partial_rotary_factor={partial} gives a rotary dimension of "
            f"{rotary_dim}; it must be even and at least 4",
        )
    return rotary_dim


def _original_context(cfg: dict[str, Any], params: dict[str, Any], rope_type: str, max_pos: int):
    """The pre-scaling context: Phi-3's longrope keeps it at the top level."""
    key = "original_max_position_embeddings"
    original = _int(cfg, key, None) if rope_type == "longrope" else None
    return original or _int(params, key, None) or max_pos


def _factors(params: dict[str, Any], key: str, rope_type: str, rotary_dim: int):
    values = params.get(key) or ()
    if not isinstance(values, list | tuple):
        raise InvalidModelConfig(key, f"expected a list of numbers, got {_show(values)}")
    factors = tuple(_number({key: v}, key, _REQUIRED) for v in values)
    if rope_type == "longrope" and len(factors) != rotary_dim // 2:
        raise InvalidModelConfig(
            key, f"has {len(factors)} entries; longrope needs rotary dimension / 2 = "
            f"{rotary_dim // 2}",
        )
    return factors


def _default_factor(rope_type: str, max_pos: int, original: int) -> float:
    return max_pos / original if rope_type in ("yarn", "longrope") else 1.0


# ---- typed reads: each returns the value or raises InvalidModelConfig naming the field -------


def _int(
    cfg: dict[str, Any], key: str, default: Any = _REQUIRED, low: int = 1, high: Any = _LIMIT
) -> Any:
    """An integer field in [low, high] (by default high is LIMITS[key], if any; None: no bound);
    null reads as absent."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise InvalidModelConfig(key, "required field is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidModelConfig(key, f"expected an integer, got {_show(value)}")
    high = LIMITS.get(key) if high is _LIMIT else high
    if value < low:
        raise InvalidModelConfig(key, f"{value:,} is below the minimum {low}")
    if high is not None and value > high:
        raise InvalidModelConfig(key, f"{value:,} is above the limit {high:,}")
    return value


def _number(cfg: dict[str, Any], key: str, default: Any, low: float | None = 0.0) -> Any:
    """A finite number (integer or float) above `low` (None: any); None reads as absent."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise InvalidModelConfig(key, "required field is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidModelConfig(key, f"expected a number, got {_show(value)}")
    if not math.isfinite(value) or (low is not None and value <= low):
        bound = "finite" if low is None else f"a finite number above {low:g}"
        raise InvalidModelConfig(key, f"{value!r} is not {bound}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidModelConfig(key, f"expected true or false, got {_show(value)}")
    return value


def _str(cfg: dict[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidModelConfig(key, f"expected a string, got {_show(value)}")
    return value


def _object(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidModelConfig(key, f"expected a JSON object, got {_show(value)}")
    return dict(value)


def _show(value: Any) -> str:
    """A value as the message shows it: its repr, cut short, and its JSON kind."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({kinds.get(type(value), 'null')})"
