"""Overhead of a text dialect's turn grammar inside the engine: decode time per token with and
without the Hermes/Qwen turn grammar (tool_choice required, a call whose string argument stays open
for the whole run), batch 1 and 8, graph-captured steps, on a random-weight checkpoint.

    python benchmarks/gpu_dialects.py --model /tmp/noesis-bench/llama-8b [--new 256] [--json F]

The checkpoint's weights are linked into a temporary directory beside a byte-level tokenizer that
has Qwen's special tokens and the Qwen3-format template of tests/data/chat_templates, so the
dialect is detected as it is for a real Qwen model. Uses gpu_structured.per_token_ms.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from gpu_structured import per_token_ms

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen3.jinja"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
NOTE = {
    "type": "function",
    "function": {
        "name": "write_note",
        "parameters": {
            "type": "object",
            "properties": {"note": {"type": "string", "minLength": 4000}},
            "required": ["note"],
        },
    },
}
QUESTION = [{"role": "user", "content": "Write a long note about the weather in Paris."}]


def qwen_overlay(model: Path, out: Path) -> Path:
    """`model`'s weights and config beside a Qwen-style tokenizer (<= 512 ids) and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    for item in model.iterdir():
        if item.suffix in (".json", ".safetensors") and not item.name.startswith("tokenizer"):
            (out / item.name).symlink_to(item.resolve())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([TEMPLATE.read_text() + json.dumps(NOTE)] * 4, trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE.read_text()}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tok.token_to_id("<|im_end|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    from noesis import LLM, SamplingParams
    from noesis.dialects import TurnOptions

    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_overlay(Path(args.model), Path(tmp))
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096, progress=False)
        fmt = llm.turn_format
        assert fmt is not None and fmt.name == "hermes", fmt
        prompt = llm.render_chat(QUESTION, [NOTE])
        options = TurnOptions("required", parallel_tool_calls=False)
        grammar = fmt.params(SamplingParams(), prompt, [NOTE], options).grammar
        rows = []
        print(f"{'batch':>5} {'free ms/tok':>12} {'dialect ms/tok':>15} {'overhead':>9}")
        for batch in (1, 8):
            free = per_token_ms(llm, batch, args.new, None)
            constrained = per_token_ms(llm, batch, args.new, grammar)
            share = constrained / free - 1
            rows.append({"batch": batch, "free_ms": free, "dialect_ms": constrained,
                         "overhead": share})  # fmt: skip
            print(f"{batch:>5} {free:>12.3f} {constrained:>15.3f} {share:>8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dialect": "hermes", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
