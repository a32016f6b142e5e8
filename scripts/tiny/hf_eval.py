"""A stopgap check of a noesis-tiny model through transformers (greedy, CPU): score held-out
examples with noesis.tiny.evaluate, and measure draft/target greedy agreement.

The engine-backed `noesis eval tools` is the real harness; this script only tells whether a trained
pair is sane, with the same scoring functions.

    PYTHONPATH=src python scripts/tiny/hf_eval.py models/noesis-tiny --n 200
        --draft models/noesis-tiny-draft --json eval.json   # (one command line)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.tiny import corpus, evaluate, harmony

MAX_NEW_TOKENS = 96


def generate(model, tokenizer, text: str) -> tuple[str, list[int]]:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=False), new


def agreement(target, draft, prompt_ids: list[int], target_ids: list[int]) -> tuple[int, int]:
    """Positions where the draft's greedy next token equals the target's, on the target's path."""
    ids = torch.tensor([prompt_ids + target_ids])
    with torch.no_grad():
        draft_next = draft(ids).logits[0, len(prompt_ids) - 1 : -1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(draft_next, target_ids, strict=True)), len(target_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--draft")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--show", type=int, default=3, help="print this many transcripts")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    draft = None
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    encoding = HarmonyEncoding.from_file(args.model, NOESIS_TINY)  # reads the generated text
    scores, agree, total, began = [], 0, 0, time.time()
    for i, example in enumerate(corpus.generate(args.seed, "heldout", args.n)):
        prompt = harmony.render(example.prompt_messages, example.tools, add_generation_prompt=True)
        first, first_ids = generate(model, tokenizer, prompt)
        call = evaluate.score_call(example, parse_text(encoding, first))
        final_text = first
        if example.expected_tool is not None:
            before = harmony.render(example.messages_before_final, example.tools, True)
            final_text, _ = generate(model, tokenizer, before)
        scores.append(
            evaluate.ExampleScore(
                example.id, example.task, example.expected_tool, call,
                evaluate.final_correct(example, parse_text(encoding, final_text)), len(first_ids),
            )
        )  # fmt: skip
        if draft is not None:
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            hits, count = agreement(model, draft, prompt_ids, first_ids)
            agree, total = agree + hits, total + count
        if i < args.show:
            print(f"--- {example.id} ({example.task}, expects {example.expected_tool})")
            print(example.prompt_messages[-1]["content"])
            print(first)
            if final_text is not first:
                print(final_text)
    summary = evaluate.summarize(scores)
    if draft is not None:
        summary["draft_greedy_agreement"] = agree / max(total, 1)
    summary["seconds"] = round(time.time() - began, 1)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)


if __name__ == "__main__":
    main()
