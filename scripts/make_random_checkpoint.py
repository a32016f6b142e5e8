"""Write a random-weight Llama-shaped checkpoint in Hugging Face format (demos, benchmarks).

Tensors are generated one at a time and written straight to safetensors shards, so even the
8B shape never needs the whole model in memory. The tokenizer is a small byte-level BPE trained
on a built-in paragraph; its ids cover only the start of the (larger) model vocabulary.

    python scripts/make_random_checkpoint.py --shape 100m --out /tmp/llama-100m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "tiny": dict(hidden=64, intermediate=172, layers=2, heads=4, kv_heads=2, vocab=512),
    "100m": dict(hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=32000),
    "llama-1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256),
    "llama-8b": dict(
        hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256
    ),
}
TEXT = (
    "The engine reads the weights once and keeps them resident. Each step schedules a batch, "
    "runs the model and samples on the device. Hello world! 0123456789 café naïve 日本語 🙂"
)
SHARD_BYTES = 2 << 30


def tensor_shapes(s: dict, tie: bool = False) -> dict[str, tuple[int, ...]]:
    head_dim = s["hidden"] // s["heads"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (s["heads"] * head_dim, s["hidden"]),
            p + "self_attn.k_proj.weight": (s["kv_heads"] * head_dim, s["hidden"]),
            p + "self_attn.v_proj.weight": (s["kv_heads"] * head_dim, s["hidden"]),
            p + "self_attn.o_proj.weight": (s["hidden"], s["heads"] * head_dim),
            p + "mlp.gate_proj.weight": (s["intermediate"], s["hidden"]),
            p + "mlp.up_proj.weight": (s["intermediate"], s["hidden"]),
            p + "mlp.down_proj.weight": (s["hidden"], s["intermediate"]),
            p + "input_layernorm.weight": (s["hidden"],),
            p + "post_attention_layernorm.weight": (s["hidden"],),
        }
    shapes["model.norm.weight"] = (s["hidden"],)
    if not tie:
        shapes["lm_head.weight"] = (s["vocab"], s["hidden"])
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    device = gen.device
    if len(shape) == 1:  # norms: near one
        return (1.0 + 0.02 * torch.randn(shape, generator=gen, device=device)).to(dtype).cpu()
    std = 1.0 / shape[1] ** 0.5 if "embed" not in name else 0.02
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()


def write_weights(out: Path, shapes: dict, dtype: torch.dtype, seed: int,
                  device: str = "cpu", draw=random_tensor) -> None:
    """Tensors `draw(name, shape, dtype, generator)` (on the CPU) in shards of SHARD_BYTES."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        tensor = draw(name, shape, dtype, gen)
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / filename, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, filename)
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_config(out: Path, s: dict, dtype: str, max_len: int, tie: bool = False) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": s["hidden"], "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "vocab_size": s["vocab"],
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": tie, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 512), special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--max-position-embeddings", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-embeddings", action="store_true", help="share embed and LM head")
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers")
    args = parser.parse_args()
    make_checkpoint(args.out, args.shape, args.dtype, args.max_position_embeddings, args.seed,
                    args.tie_embeddings, args.device)
    print(f"wrote a random {args.shape} checkpoint to {args.out}")


def make_checkpoint(out: Path, shape_name: str, dtype: str = "bfloat16", max_len: int = 8192,
                    seed: int = 0, tie: bool = False, device: str = "cpu") -> Path:
    shape = SHAPES[shape_name]
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, shape, dtype, max_len, tie)
    write_tokenizer(out, shape["vocab"])
    write_weights(out, tensor_shapes(shape, tie), getattr(torch, dtype), seed, device)
    return out


if __name__ == "__main__":
    main()
