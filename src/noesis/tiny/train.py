"""Train a noesis-tiny model (target or draft) and write it in Hugging Face format.

    python -m noesis.tiny.train --out models/noesis-tiny --size target --minutes 6
    python -m noesis.tiny.train --out models/noesis-tiny-draft --size draft --minutes 2.5

Plain PyTorch: seeded, bf16 autocast and fused AdamW on CUDA, optional torch.compile, a cosine
schedule over the run's progress (steps done or minutes used, whichever is further along, so a time
budget still decays to the end), held-out loss at intervals. The data directory is built first if it
does not exist (noesis.tiny.data).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from noesis.ternary.bitlinear import packed_tensors, to_bitlinear
from noesis.ternary.quant import quantization_config
from noesis.tiny import data, tokenizer
from noesis.tiny.harmony import CALL, ENDOFTEXT, RETURN, STARTOFTEXT
from noesis.tiny.model import LlamaConfig, LlamaForCausalLM, count_parameters

SIZES: dict[str, LlamaConfig] = {
    "target": LlamaConfig(
        hidden_size=384,
        intermediate_size=1024,
        num_layers=10,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
    ),
    "draft": LlamaConfig(
        hidden_size=192,
        intermediate_size=512,
        num_layers=4,
        num_heads=3,
        num_kv_heads=1,
        head_dim=64,
    ),
    # For tests: a few thousand parameters apart from the embeddings.
    "test": LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    ),
}


@dataclass(frozen=True)
class TrainConfig:
    size: str = "target"
    seed: int = 0
    steps: int = 0  # 0: no step limit
    minutes: float = 0.0  # 0: no time limit
    batch_size: int = 64
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 500
    eval_batches: int = 8
    log_every: int = 50
    compile: bool = False
    # No loss on assistant turns before the last user message (Example.history_spans).
    mask_history: bool = True
    # BitLinear projections (noesis.ternary): ternary QAT, exported packed.
    ternary: bool = False


@dataclass
class TrainResult:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    train_loss: float = float("nan")  # mean over the last log interval
    heldout_loss: float = float("nan")
    history: list[dict[str, float]] = field(default_factory=list)


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / max(1, config.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * warmup * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def progress_of(config: TrainConfig, step: int, elapsed: float) -> float:
    parts = []
    if config.steps:
        parts.append(step / config.steps)
    if config.minutes:
        parts.append(elapsed / (60 * config.minutes))
    return max(parts)


def train(
    model: LlamaForCausalLM,
    stream: data.TokenStream,
    heldout: data.TokenStream,
    config: TrainConfig,
    device: torch.device,
) -> TrainResult:
    if not (config.steps or config.minutes):
        raise ValueError("give --steps or --minutes")
    optimizer = _optimizer(model, config, device)
    step_fn = _compiled(model) if config.compile else model
    rng = np.random.default_rng(config.seed)
    eval_batches = heldout.fixed_batches(config.batch_size, config.eval_batches)
    result, window, began = TrainResult(), [], time.time()
    while (progress := progress_of(config, result.steps, time.time() - began)) < 1.0:
        lr = learning_rate(config, result.steps, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = _to_device(stream.batch(rng, config.batch_size), config, device)
        loss, step_fn = _step(model, step_fn, optimizer, batch, config, device)
        window.append(loss)
        result.steps += 1
        result.tokens += batch[0].numel()
        if result.steps % config.log_every == 0:
            _log(result, window, lr, began)
            window = []
        if result.steps % config.eval_every == 0:
            result.heldout_loss = evaluate(model, eval_batches, config, device)
            print(f"step {result.steps} heldout_loss {result.heldout_loss:.4f}", flush=True)
    if window:
        _log(result, window, lr, began)
    result.seconds = time.time() - began
    result.heldout_loss = evaluate(model, eval_batches, config, device)
    print(f"final step {result.steps} heldout_loss {result.heldout_loss:.4f}", flush=True)
    return result


def _step(
    model: LlamaForCausalLM,
    step_fn: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    config: TrainConfig,
    device: torch.device,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One optimizer step; returns the loss as a tensor (no host sync) and the forward to reuse."""
    try:
        loss = _loss(step_fn, batch, device)
        loss.backward()
    except Exception as exc:  # torch.compile failures surface at the first forward or backward
        if step_fn is model:
            raise
        print(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly", flush=True)
        optimizer.zero_grad(set_to_none=True)
        step_fn = model
        loss = _loss(step_fn, batch, device)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), step_fn


def _to_device(
    batch: data.Batch, config: TrainConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T+1] and the targets to score: -100 where the loss mask is off."""
    tokens = torch.from_numpy(batch[0]).to(device, non_blocking=True)
    targets = tokens[:, 1:]
    if config.mask_history:
        keep = torch.from_numpy(batch[1][:, 1:]).to(device, non_blocking=True)
        targets = targets.masked_fill(~keep, -100)
    return tokens[:, :-1], targets


def _loss(
    forward: Callable[[torch.Tensor], torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    inputs, targets = batch
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = forward(inputs)  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


@torch.no_grad()
def evaluate(
    model: LlamaForCausalLM, batches: list[data.Batch], config: TrainConfig, device: torch.device
) -> float:
    model.eval()
    losses = [_loss(model, _to_device(b, config, device), device).item() for b in batches]
    model.train()
    return float(np.mean(losses))


def _optimizer(
    model: LlamaForCausalLM, config: TrainConfig, device: torch.device
) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def _compiled(model: LlamaForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return torch.compile(model)
    except Exception as exc:
        print(f"torch.compile unavailable ({exc}); training eagerly", flush=True)
        return model


def _log(result: TrainResult, window: list[torch.Tensor], lr: float, began: float) -> None:
    loss = float(torch.stack(window).mean())  # the one host sync per log interval
    elapsed = time.time() - began
    result.train_loss = loss
    row = {
        "step": result.steps,
        "loss": round(loss, 4),
        "lr": lr,
        "tokens": result.tokens,
        "seconds": round(elapsed, 1),
        "tokens_per_s": round(result.tokens / max(elapsed, 1e-9)),
    }
    result.history.append(row)
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------- export


def export(
    model: LlamaForCausalLM, out: Path, data_dir: Path, dtype: torch.dtype, ternary: bool = False
) -> None:
    """config.json, generation_config.json, model.safetensors and the tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer.load(data_dir / data.TOKENIZER_DIR)
    ids = tokenizer.special_ids(tok)
    eos = [ids[RETURN], ids[CALL], ids[ENDOFTEXT]]
    hf_config = model.config.to_hf(ids[STARTOFTEXT], eos, ids[ENDOFTEXT])
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if ternary:
        hf_config["quantization_config"] = quantization_config()
    _write_json(out / "config.json", hf_config)
    generation = {
        "bos_token_id": ids[STARTOFTEXT],
        "eos_token_id": eos,
        "pad_token_id": ids[ENDOFTEXT],
        "do_sample": False,
    }
    _write_json(out / "generation_config.json", generation)
    if ternary:
        tensors = packed_tensors(model, dtype)
    else:
        state = model.state_dict()
        tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(data_dir / data.TOKENIZER_DIR / name, out / name)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def summary(
    config: TrainConfig,
    model_config: LlamaConfig,
    result: TrainResult,
    data_dir: Path,
    device: torch.device,
) -> dict[str, object]:
    meta = (
        json.loads((data_dir / "meta.json").read_text())
        if (data_dir / "meta.json").exists()
        else {}
    )
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    )
    return {
        "command": " ".join(["python -m noesis.tiny.train", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name or device.type,
        "torch": torch.__version__,
        "parameters": count_parameters(model_config),
        "model": asdict(model_config),
        "train": asdict(config),
        "data": meta,
        "result": asdict(result),
    }


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    config = TrainConfig(
        **{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(config.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    if not (args.data / "meta.json").exists():
        data.build(args.data, data.DataConfig(seed=config.seed, train_items=args.train_items))
    vocab = tokenizer.load(args.data / data.TOKENIZER_DIR).get_vocab_size()
    model_config = _sized(SIZES[config.size], vocab, config.seq_len)
    print(f"{config.size}: {count_parameters(model_config):,} parameters on {device}", flush=True)
    model = LlamaForCausalLM(model_config)
    if args.init is not None:
        load_initial(model, args.init)
    if config.ternary:
        to_bitlinear(model)
    model = model.to(device)
    stream = data.TokenStream(args.data, "train", config.seq_len)
    heldout = data.TokenStream(args.data, "heldout", config.seq_len)
    result = train(model, stream, heldout, config, device)
    export(model, args.out, args.data, torch.bfloat16, ternary=config.ternary)
    record = summary(config, model_config, result, args.data, device)
    _write_json(args.out / "training_summary.json", record)
    print(f"wrote {args.out} in {result.seconds:.0f}s of training", flush=True)


def load_initial(model: LlamaForCausalLM, directory: Path) -> None:
    """Start from the float weights of an earlier run (same shape and tokenizer): fine-tuning, or
    ternary QAT from a float model."""
    path = directory / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"--init {directory}: no model.safetensors there")
    tensors = load_file(str(path))
    if any(name.endswith("weight_packed") for name in tensors):
        raise SystemExit(f"--init {directory}: a packed ternary checkpoint; give a float one")
    expected = model.state_dict()
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    wanted = {n: tuple(t.shape) for n, t in expected.items()}
    if shapes != wanted:
        differ = sorted(set(shapes.items()) ^ set(wanted.items()))[:4]
        raise SystemExit(f"--init {directory}: weights do not fit this model, e.g. {differ}")
    model.load_state_dict({n: t.float() for n, t in tensors.items()})
    print(f"initialized from {path}", flush=True)


def _sized(config: LlamaConfig, vocab_size: int, seq_len: int) -> LlamaConfig:
    """The size's shape with the tokenizer's vocabulary (rounded up to 64) and room for seq_len."""
    vocab = -(-vocab_size // 64) * 64
    positions = max(config.max_position_embeddings, seq_len)
    return replace(config, vocab_size=vocab, max_position_embeddings=positions)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a noesis-tiny model.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="target")
    parser.add_argument("--data", type=Path, default=Path("build/tiny-data"))
    parser.add_argument(
        "--train-items",
        type=int,
        default=data.DataConfig.train_items,
        help="corpus size when --data must be built",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this float checkpoint's weights"
    )
    defaults = TrainConfig()
    for name in (
        "seed",
        "steps",
        "minutes",
        "batch_size",
        "seq_len",
        "lr",
        "warmup_steps",
        "eval_every",
        "eval_batches",
        "log_every",
    ):
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--ternary", action="store_true", help="BitLinear (ternary QAT) projections, packed export"
    )
    parser.add_argument(
        "--mask-history",
        action=argparse.BooleanOptionalAction,
        default=defaults.mask_history,
        help="no loss on assistant turns before the last user message",
    )
    return parser


if __name__ == "__main__":
    main()
