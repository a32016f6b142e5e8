"""ModelConfig: the only reader of a checkpoint's config.json; inward code trusts its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noesis.errors import UnsupportedModel

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
        architecture = _architecture(cfg)
        family = ARCHITECTURES[architecture]
        if "text_config" in cfg:
            cfg = {**cfg, **cfg["text_config"]}
        hidden = _req(cfg, "hidden_size", int)
        num_heads = _req(cfg, "num_attention_heads", int)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_kv = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv:
            raise UnsupportedModel(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
            )
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in ACTIVATIONS:
            raise UnsupportedModel(
                f"hidden_act {act!r} is not supported (supported: {ACTIVATIONS})"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = family == "qwen2" or attention_bias
        return cls(
            architecture=architecture,
            family=family,
            vocab_size=_req(cfg, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_req(cfg, "intermediate_size", int),
            num_layers=_req(cfg, "num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope(cfg, head_dim),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qkv_bias=qkv_bias,
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(cfg, family),
            hidden_act=act,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            raw=cfg,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    named = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise UnsupportedModel(
        f"unsupported architecture {named}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def _req(cfg: dict[str, Any], key: str, kind: type) -> Any:
    if key not in cfg or cfg[key] is None:
        raise UnsupportedModel(f"config.json lacks required field {key!r}")
    return kind(cfg[key])


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(cfg: dict[str, Any], family: str) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if family not in ("qwen2", "qwen3"):
        return int(window)
    if not cfg.get("use_sliding_window", False):
        return None
    # Qwen2/3 slide only in layers >= max_window_layers (28 when unset, as in transformers);
    # newer configs spell the result out as layer_types.
    first = cfg.get("max_window_layers", 28)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    if all(kind == "full_attention" for kind in types):
        return None
    if all(kind == "sliding_attention" for kind in types):
        return int(window)
    raise UnsupportedModel(
        "models mixing full and sliding-window attention layers (max_window_layers / "
        "layer_types) are not supported"
    )


def _rope(cfg: dict[str, Any], head_dim: int) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = cfg.get("original_max_position_embeddings") if rope_type == "longrope" else None
    original = original or params.get("original_max_position_embeddings") or max_pos
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        rotary_dim=int(head_dim * partial),
        factor=float(params.get("factor") or _default_factor(rope_type, max_pos, int(original))),
        original_max_position_embeddings=int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(params.get("short_factor") or ()),
        long_factor=tuple(params.get("long_factor") or ()),
    )


def _default_factor(rope_type: str, max_pos: int, original: int) -> float:
    return max_pos / original if rope_type in ("yarn", "longrope") else 1.0
