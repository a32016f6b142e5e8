"""Constrained decoding inside the engine: decode time per token with and without a grammar, on
the same random-weight checkpoint, batch 1 and 8 (graph-captured steps). The grammar's mask is
filled on a CPU thread during the forward and applied to the logits on the device.

    python benchmarks/gpu_structured.py --model /tmp/noesis-bench/llama-1b [--new 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# Long free text in a JSON string: the grammar never ends before max_tokens.
SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "minLength": 4000}},
          "required": ["note"]}


def per_token_ms(llm, batch: int, new: int, grammar) -> float:
    from noesis import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=new, ignore_eos=True,
                             grammar=grammar) for i in range(batch)]
    prompts = [[2 + (i * 7 + j) % 200 for j in range(64)] for i in range(batch)]
    # Warm-up with the same grammar: compiling it (llguidance) and the mask kernel happen once.
    warm = [SamplingParams(max_tokens=8, ignore_eos=True, grammar=grammar)] * batch
    llm.generate(prompts, warm)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == batch * new, tokens
    return (time.perf_counter() - start) * 1e3 / new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    from noesis import LLM
    from noesis.structured import GrammarSpec

    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_model_len=4096, progress=False)
    grammar = GrammarSpec.json_schema(SCHEMA, compact=True)
    rows = []
    print(f"{'batch':>5} {'free ms/tok':>12} {'grammar ms/tok':>15} {'overhead':>9}")
    for batch in (1, 8):
        free = per_token_ms(llm, batch, args.new, None)
        constrained = per_token_ms(llm, batch, args.new, grammar)
        share = constrained / free - 1
        rows.append({"batch": batch, "free_ms": free, "grammar_ms": constrained,
                     "overhead": share})
        print(f"{batch:>5} {free:>12.3f} {constrained:>15.3f} {share:>8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "vocab": llm.model_config.vocab_size,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
