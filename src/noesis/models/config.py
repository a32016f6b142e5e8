"""ModelConfig: the only reader of a checkpoint's config.json; inward code trusts its fields.

`from_hf` checks every value it reads before anything is sized from it: its JSON type, its range
and its consistency with the others. A bad one is `InvalidModelConfig` naming the field, the value
and the limit; a well-formed feature noesis lacks is `UnsupportedModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from noesis.errors import InvalidModelConfig, UnsupportedModel

# Hugging Face architecture name -> our family name. models/registry.py maps families to classes.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Lfm2ForCausalLM": "lfm2",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model; see CAPABILITIES
    "Qwen2VLForConditionalGeneration": "qwen2",  # the same
    "Qwen2_5_VLForConditionalGeneration": "qwen2",  # the same
}
# Checkpoints that hold more than a text model: their capabilities beyond text, each with the
# tensor-name prefixes of its weights. noesis loads the text model only (under TEXT_PREFIX, or
# under the plain names) and never reads the others' tensors (noesis.models.capabilities).
CAPABILITIES = {
    "Gemma3ForConditionalGeneration": {"vision": ("vision_tower.", "multi_modal_projector.")},
    # The Hub's layout, which transformers also writes: the text model under model.* and
    # lm_head, the vision tower and its merger under visual.*.
    "Qwen2VLForConditionalGeneration": {"vision": ("visual.",)},
    "Qwen2_5_VLForConditionalGeneration": {"vision": ("visual.",)},
}
TEXT_PREFIX = {"Gemma3ForConditionalGeneration": "language_model."}
# config.json's model_type -> the architecture transformers' AutoModelForCausalLM picks for it,
# for checkpoints whose config.json names no `architectures`.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
GEMMA_FAMILIES = ("gemma2", "gemma3")
# Families whose layers alternate sliding-window and full attention (config.json's layer_types).
LAYER_TYPE_FAMILIES = ("gpt_oss", "gemma2", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
CONV_LAYER = "conv"  # LFM2: a gated short convolution in place of attention

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

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
    "num_experts": 1 << 12,
    "num_experts_per_tok": 1 << 6,
    "moe_intermediate_size": 1 << 19,
    "conv_L_cache": 1 << 6,
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
    # Gemma 3: the sliding layers' own rotary (a static kind); the tables then hold both, this
    # one's channels after the global ones.
    local: RopeConfig | None = None

    @property
    def length_dependent(self) -> bool:
        """Frequencies depend on the sequence length reached (dynamic NTK, longrope)."""
        return self.rope_type in ("dynamic", "longrope")

    def table_bytes(self, num_positions: int) -> int:
        """Bytes of the float32 cos/sin tables RotaryEmbedding builds for `num_positions`
        (longrope keeps a second pair for its long factors)."""
        tables = 4 if self.rope_type == "longrope" else 2
        local = self.local.table_bytes(num_positions) if self.local is not None else 0
        return tables * num_positions * self.rotary_dim * 4 + local


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts: how many, how wide, how tokens pick them, which layers have them."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # "softmax_topk": softmax over all experts, then the top k (Qwen3-MoE, Mixtral), renormalized
    # to sum 1 when `renormalize`; "topk_softmax": the top k logits, then a softmax over them
    # (gpt-oss).
    routing: str = "softmax_topk"
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    # gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    # g = clamp(gate, max=limit); None: the plain silu(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead (Qwen3-MoE)
    mxfp4: bool = False  # expert weights stored as MXFP4 blocks + scales (gpt-oss releases)


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
    # Per layer "sliding_attention" or "full_attention" where the family alternates them; empty:
    # `sliding_window` (if any) applies to every layer.
    layer_types: tuple[str, ...] = ()
    moe: MoeConfig | None = None
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    # LFM2: the short convolutions' kernel size (their state keeps kernel - 1 inputs per
    # sequence; the layers are those whose layer_types entry is "conv"); 0: none.
    conv_kernel: int = 0
    conv_bias: bool = False
    # What the checkpoint can do ("text", and e.g. "vision"); noesis loads "text".
    capabilities: tuple[str, ...] = ("text",)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == CONV_LAYER)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache: all but the short-convolution ones."""
        return tuple(i for i in range(self.num_layers) if i not in self.conv_layers)

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return scalar**-0.5

    def window(self, layer_index: int) -> int | None:
        """The sliding window of one layer (None: full attention)."""
        if self.layer_types and self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Validate a parsed config.json (types, ranges, consistency), then normalize it."""
        if not isinstance(cfg, dict):
            raise InvalidModelConfig("top level", f"expected a JSON object, got {_show(cfg)}")
        architecture = _architecture(cfg)
        family = ARCHITECTURES[architecture]
        cfg = {**cfg, **_object(cfg, "text_config")}
        if family == "lfm2":
            cfg = _lfm2_fields(cfg)
        shape = _shape(cfg)
        params = _rope_params(cfg, family)
        rope = _rope(cfg, params, shape["head_dim"], shape["max_position_embeddings"])
        if family == "gemma3":
            rope = replace(rope, local=_gemma3_local_rope(cfg, shape))
        _check_context(shape["max_position_embeddings"], rope)
        act = _str(cfg, "hidden_act", _str(cfg, "hidden_activation", "silu"))
        if act not in ACTIVATIONS:
            raise UnsupportedModel(
                f"hidden_act {act!r} is not supported (supported: {ACTIVATIONS})"
            )
        _object(cfg, "quantization_config")  # read by models/decoder.py as a dict
        attention_bias = _bool(cfg, "attention_bias", family == "gpt_oss")
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
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "lfm2"),
            sliding_window=_sliding_window(cfg, family, shape["num_layers"]),
            hidden_act=act,
            torch_dtype=_str(cfg, "torch_dtype", None) or _str(cfg, "dtype", None),
            bos_token_id=_int(cfg, "bos_token_id", None, low=0),
            eos_token_ids=_eos_ids(cfg),
            layer_types=_layer_types(cfg, family, shape["num_layers"]),
            moe=_moe(cfg, family, shape["num_layers"]),
            attention_sinks=family == "gpt_oss",
            **_gemma(cfg, family, params, shape),
            **_conv(cfg, family),
            capabilities=("text", *CAPABILITIES.get(architecture, {})),
            raw=cfg,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(arch, str) for arch in archs):
        raise InvalidModelConfig("architectures", f"expected a list of names, got {_show(archs)}")
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    model_type = cfg.get("model_type")
    if not archs and isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
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


def _layer_types(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    """Which layers slide, for the families that alternate: config.json's layer_types, or the
    pattern transformers 4 derived (Gemma 2 and gpt-oss: every other layer from the first;
    Gemma 3: all but every sliding_window_pattern-th)."""
    if family == "lfm2":
        return _lfm2_layer_types(cfg, num_layers)
    if family not in LAYER_TYPE_FAMILIES:
        return ()
    types = cfg.get("layer_types")
    if types is None:
        pattern = 2 if family != "gemma3" else _int(
            cfg, "sliding_window_pattern", _int(cfg, "_sliding_window_pattern", 6), high=None
        )
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(kind not in LAYER_TYPES for kind in types)):
        raise InvalidModelConfig(
            "layer_types", f"expected {num_layers} of {LAYER_TYPES}, got {_show(types)}"
        )
    if "sliding_attention" in types and cfg.get("sliding_window") in (None, 0):
        raise InvalidModelConfig("sliding_window", "layer_types has sliding layers but no window")
    return tuple(types)


def _moe(cfg: dict[str, Any], family: str, num_layers: int) -> MoeConfig | None:
    if family not in MOE_FAMILIES:
        return None
    # Qwen3-MoE's own configs say num_experts; transformers 5 writes num_local_experts for all
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    num_experts = _int(cfg, key, high=LIMITS["num_experts"])
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise InvalidModelConfig(
            "num_experts_per_tok", f"{top_k} is above the number of experts {num_experts}"
        )
    if family == "qwen3_moe":
        return MoeConfig(
            num_experts, top_k, _int(cfg, "moe_intermediate_size"),
            renormalize=_bool(cfg, "norm_topk_prob", False),
            dense_layers=_qwen3_dense_layers(cfg, num_layers),
        )
    if family == "mixtral":
        return MoeConfig(num_experts, top_k, _int(cfg, "intermediate_size"))
    quant = _object(cfg, "quantization_config")
    method = quant.get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedModel(f"gpt-oss with quant_method {method!r} (supported: mxfp4, none)")
    return MoeConfig(
        num_experts, top_k, _int(cfg, "intermediate_size"), routing="topk_softmax",
        router_bias=True, expert_bias=True,
        swiglu_limit=_number(cfg, "swiglu_limit", 7.0),
        swiglu_alpha=_number(cfg, "swiglu_alpha", 1.702),
        mxfp4=method == "mxfp4",
    )


def _qwen3_dense_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers with a dense MLP: those listed in mlp_only_layers, and all but every
    decoder_sparse_step-th."""
    step = _int(cfg, "decoder_sparse_step", 1, high=None)
    listed = cfg.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in listed
    ):
        raise InvalidModelConfig("mlp_only_layers", f"expected layer numbers, got {_show(listed)}")
    return tuple(i for i in range(num_layers) if i in listed or (i + 1) % step)


def _gemma(cfg: dict[str, Any], family: str, params: dict[str, Any], shape: dict[str, int]):
    """Gemma's extra switches: soft-capping and the query scale."""
    if family not in GEMMA_FAMILIES:
        return {}
    return {
        "attn_softcap": _number(cfg, "attn_logit_softcapping", None),
        "final_softcap": _number(cfg, "final_logit_softcapping", None),
        "query_pre_attn_scalar": _number(cfg, "query_pre_attn_scalar", None),
    }


def _lfm2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's own spellings (block_ff_dim, norm_eps, tie_embedding) under the shared names, its
    defaults (tied embeddings, rope theta 1e6), and its MLP width as transformers derives it:
    2/3 of the configured one, times block_ffn_dim_multiplier, rounded up to block_multiple_of."""
    inner = _int(cfg, "intermediate_size", None) or _int(cfg, "block_ff_dim")
    if _bool(cfg, "block_auto_adjust_ff_dim", True):
        inner = int(2 * inner / 3)
        unset = "block_ffn_dim_multiplier" in cfg and cfg["block_ffn_dim_multiplier"] is None
        if not unset:
            inner = int(_number(cfg, "block_ffn_dim_multiplier", 1.0) * inner)
            multiple = _int(cfg, "block_multiple_of", 256, high=None)
            inner = multiple * -(-inner // multiple)
    fields = {
        "intermediate_size": inner,
        "rms_norm_eps": _number(cfg, "norm_eps", 1e-5),
        "tie_word_embeddings": _bool(cfg, "tie_word_embeddings", _bool(cfg, "tie_embedding", True)),
    }
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        fields["rope_theta"] = _number(cfg, "rope_theta", 1e6, low=1.0)
    return {**cfg, **fields}


def _lfm2_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """"conv" or "full_attention" per layer: layer_types, or full_attn_idxs (default: all
    attention, as transformers does)."""
    kinds = (CONV_LAYER, "full_attention")
    types = cfg.get("layer_types")
    if types is None:
        attention = cfg.get("full_attn_idxs")
        if attention is None:
            attention = list(range(num_layers))
        if not isinstance(attention, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in attention
        ):
            raise InvalidModelConfig(
                "full_attn_idxs", f"expected layer numbers, got {_show(attention)}"
            )
        types = ["full_attention" if i in attention else CONV_LAYER for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(kind not in kinds for kind in types)):
        raise InvalidModelConfig(
            "layer_types", f"expected {num_layers} of {kinds}, got {_show(types)}"
        )
    return tuple(types)


def _conv(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """LFM2's short convolutions: kernel size and bias."""
    if family != "lfm2":
        return {}
    kernel = _int(cfg, "conv_L_cache", 3, low=2)
    return {"conv_kernel": kernel, "conv_bias": _bool(cfg, "conv_bias", False)}


def _gemma3_local_rope(cfg: dict[str, Any], shape: dict[str, int]) -> RopeConfig:
    """The sliding layers' rotary: rope_parameters["sliding_attention"], or in transformers 4
    configs plain rope at rope_local_base_freq."""
    params = _object(_object(cfg, "rope_parameters"), "sliding_attention") or {
        "rope_type": "default",
        "rope_theta": _number(cfg, "rope_local_base_freq", 10000.0, low=1.0),
    }
    local = _rope({}, params, shape["head_dim"], shape["max_position_embeddings"])
    if local.length_dependent or local.rotary_dim != shape["head_dim"]:
        raise UnsupportedModel("Gemma 3 with a length-dependent or partial local rotary")
    return local


def _rope(cfg: dict[str, Any], params: dict[str, Any], head_dim: int, max_pos: int) -> RopeConfig:
    rope_type = _str(params, "rope_type", _str(params, "type", "default"))
    if rope_type == "su":
        rope_type = "longrope"
    if rope_type == "mrope":  # Qwen2-VL's M-RoPE: time, height and width positions, each on
        rope_type = "default"  # its share of the dims; for text all three are the position
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


def _rope_params(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = _object(cfg, key)
    if family == "gemma3" and "full_attention" in params:  # per layer type: the global one here
        params = _object(params, "full_attention")
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
