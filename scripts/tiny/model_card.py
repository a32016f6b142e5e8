"""Write README.md (the model card) of a trained noesis-tiny model from its training_summary.json.

PYTHONPATH=src python scripts/tiny/model_card.py models/noesis-tiny [--hf-eval eval.json]
    [--pair-command "TRAIN_ITEMS=... scripts/tiny/train_pair.sh ..."] [--notes notes.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from noesis.tiny.corpus import DEFAULT_MIXTURE
from noesis.tiny.tools import TOOLS

PAIR_COMMAND = "TRAIN_ARGS=--no-mask-history PYTHONPATH=src scripts/tiny/train_pair.sh /tmp/tiny"


def card(directory: Path, hf_eval: dict | None, pair_command: str, notes: str) -> str:
    summary = json.loads((directory / "training_summary.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    model, train, result, data = (summary[k] for k in ("model", "train", "result", "data"))
    role = "target" if train["size"] == "target" else "draft"
    sections = [
        _header(directory.name, role, summary),
        _architecture(model, config, summary),
        _format(config),
        _data(data),
        _training(summary, train, result, pair_command),
        _evaluation(hf_eval),
        *([notes.strip()] if notes else []),
        _limits(),
    ]
    return "\n\n".join(sections) + "\n"


def _header(name: str, role: str, summary: dict) -> str:
    partner = "noesis-tiny-draft" if role == "target" else "noesis-tiny"
    params = summary["parameters"]
    return f"""# {name}

A {params / 1e6:.1f}M-parameter Llama-architecture model trained in minutes on a synthetic
corpus, so that noesis ships a model that needs no download. It speaks the Harmony format
of gpt-oss (analysis / commentary / final channels) and calls the built-in tools of
`noesis.tiny.tools`. It is the **{role}** of a pair with `{partner}`; both use the same tokenizer,
so the draft can propose tokens for speculative decoding. It is a test bed, not a general assistant:
outside its tasks it knows almost nothing."""


def _architecture(model: dict, config: dict, summary: dict) -> str:
    rows = [
        ("architecture", "LlamaForCausalLM (RMSNorm, RoPE, SwiGLU, grouped-query attention)"),
        ("parameters", f"{summary['parameters']:,} (embeddings tied with the output layer)"),
        ("layers", model["num_layers"]),
        ("hidden size", model["hidden_size"]),
        ("MLP size", model["intermediate_size"]),
        ("attention heads / KV heads / head dim",
         f"{model['num_heads']} / {model['num_kv_heads']} / {model['head_dim']}"),
        ("vocabulary", f"{config['vocab_size']} (byte-level BPE)"),
        ("RoPE theta", model["rope_theta"]),
        ("RMSNorm eps", model["rms_norm_eps"]),
        ("max positions", model["max_position_embeddings"]),
        ("weights", "bf16 `model.safetensors`"),
    ]  # fmt: skip
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"## Architecture\n\n| | |\n|---|---|\n{table}"


def _format(config: dict) -> str:
    tools = ", ".join(f"`{name}`" for name in TOOLS)
    return f"""## Tokenizer and chat format

Byte-level BPE trained with `tokenizers` on the training split; digits are split one by one. The
Harmony special tokens are single ids: `<|endoftext|>` 0 (pad), `<|startoftext|>` 1 (bos, unused),
`<|start|>` 2, `<|end|>` 3, `<|message|>` 4, `<|channel|>` 5, `<|constrain|>` 6, `<|return|>` 7,
`<|call|>` 8. Generation stops at `<|return|>`, `<|call|>` or `<|endoftext|>`
(`eos_token_id` {config["eos_token_id"]}).

`chat_template.jinja` (also in `tokenizer_config.json`) renders OpenAI-style messages (`system` or
`developer` first, `user`, `assistant` with optional `thinking` and `tool_calls`, `tool`) and
`tools` to Harmony exactly as gpt-oss lays it out; `add_generation_prompt` appends
`<|start|>assistant`. Tools the model was trained on: {tools}."""


def _data(data: dict) -> str:
    config = data.get("config", {})
    weights = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MIXTURE.weights.items())
    return f"""## Data

`noesis.tiny.corpus`, seed {config.get("seed")}: {data.get("train_items", 0):,} training items
({data.get("train_tokens", 0):,} tokens) and {data.get("heldout_items", 0):,} held-out items
({data.get("heldout_tokens", 0):,} tokens). Every {config.get("doc_every")}th item is a templated
plain-English document (stories, facts, diary entries); the rest are conversations: a system
message, a developer message with instructions and 0-{DEFAULT_MIXTURE.max_declared} declared tools,
a user question, an `analysis` message, and either a tool call, the tool's real result and a
`final` answer, or a direct `final` answer. Task weights: {weights}. In
{DEFAULT_MIXTURE.missing_tool:.0%} of tool questions the needed tool is not declared and the model
must say it can't; {DEFAULT_MIXTURE.no_tools:.0%} of conversations declare no tools at all. The
held-out split uses only held-out names, words, countries, numbers and years (a stable hash of each
entity decides its split). Most names and words are made up afresh for each example and the lookup
table holds 20,000 fictional countries, so the model learns to copy entities rather than memorize a
list of them (a first run with small closed lists copied unseen names badly). In
{DEFAULT_MIXTURE.history:.0%} of conversations an earlier exchange comes first, its analysis dropped
as gpt-oss does. In the training split, {DEFAULT_MIXTURE.paraphrased:.0%} of tool questions are
written by `noesis.tiny.paraphrase` in a natural voice instead of the templates: numbers in words or
mixed with digits, lower case without punctuation, polite and terse forms, typos, and speech
transcripts with fillers, with many verbs, operators, unit spellings and date forms. Held-out items
keep the templates, and no question of the natural evaluation split (`noesis eval tools --split
natural`, seed 1234) is ever trained on."""


def _training(summary: dict, train: dict, result: dict, pair_command: str) -> str:
    minutes = result["seconds"] / 60
    data_config = summary["data"].get("config", {})
    data_seed, items = data_config.get("seed"), data_config.get("train_items")
    reused = data_config.get("tokenizer_from")
    reuse = f" --tokenizer {reused}" if reused else ""
    masked = train.get("mask_history", False)
    masking = "masked" if masked else "not masked (trained before --mask-history)"
    command = summary["command"] + ("" if masked else " --no-mask-history")
    throughput = result["tokens"] / max(result["seconds"], 1e-9)
    optimizer = (
        f"AdamW (0.9, 0.95), peak lr {train['lr']}, {train['warmup_steps']} warmup steps, cosine to"
        f" {train['min_lr_ratio']} x peak, weight decay {train['weight_decay']}, clip"
        f" {train['grad_clip']}"
    )
    return f"""## Training

| | |
|---|---|
| command | `{summary["command"]}` |
| device | {summary["device"]} (torch {summary["torch"]}) |
| date | {summary["date"]} |
| steps | {result["steps"]:,} of batch {train["batch_size"]} x {train["seq_len"]} tokens |
| tokens seen | {result["tokens"]:,} ({throughput:,.0f} tokens/s, GPU shared by the pair) |
| wall time | {minutes:.1f} min (budget {train["minutes"]} min, torch.compile {train["compile"]}) |
| optimizer | {optimizer} |
| final train loss | {result["train_loss"]:.4f} (mean of the last {train["log_every"]} steps) |
| final held-out loss | {result["heldout_loss"]:.4f} ({train["eval_batches"]} batches) |
| loss on earlier assistant turns | {masking} |

Reproduce (one device; target and draft train side by side):

```
{pair_command}
# which runs:
python -m noesis.tiny.data --out /tmp/tiny/data --seed {data_seed} --train-items {items}{reuse}
{command}
```"""


def _evaluation(hf_eval: dict | None) -> str:
    text = """## Tool-use evaluation

`noesis eval tools --split heldout` and `--split natural` (the engine harness): figures in
`benchmarks/RESULTS.md` (sections "Bundled model, tool use" and "Natural phrasing")."""
    if hf_eval:
        rows = "\n".join(
            f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
            for k, v in hf_eval.items()
            if k not in ("by_task", "seconds")
        )
        text += f"""

Preliminary check, not the harness: `scripts/tiny/hf_eval.py` (transformers, greedy, CPU, float32,
held-out seed 1234), scored with `noesis.tiny.evaluate`. Selection counts a direct answer as right
when no call is expected; call rates are over the calls made; `call_arguments_correct` means the
call gives the expected result when executed; final answers are scored with the tool result
supplied; draft agreement is the share of the target's greedy tokens that the draft also predicts.

| | |
|---|---|
{rows}"""
    return text


def _limits() -> str:
    return """## Limits

Trained for minutes on templated data: it handles the corpus's question patterns, the seven tools
and short templated English, and little else. Facts outside a prompt or a tool result are not
knowledge it has. Do not use it for anything but testing noesis."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--hf-eval", type=Path)
    parser.add_argument("--pair-command", default=PAIR_COMMAND)
    parser.add_argument("--notes", type=Path, help="markdown appended after the evaluation")
    args = parser.parse_args()
    hf_eval = json.loads(args.hf_eval.read_text()) if args.hf_eval else None
    notes = args.notes.read_text() if args.notes else ""
    (args.model / "README.md").write_text(card(args.model, hf_eval, args.pair_command, notes))


if __name__ == "__main__":
    main()
