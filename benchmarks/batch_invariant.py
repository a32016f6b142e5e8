"""Batch-invariant mode against the default on one model (the 8B shape for issue 16): decode
throughput at batch 1, 16 and 64, and the identity check, one request's greedy and seeded tokens
alone against the same request inside batches of 8 and 64 with other traffic (other lengths,
staggered arrivals). Both modes are checked: the default is expected to differ at times.

    python scripts/make_random_checkpoint.py --shape llama-8b --dtype bfloat16 --out /tmp/8b
    python benchmarks/batch_invariant.py --model /tmp/8b [--batches 1,16,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from noesis import SamplingParams  # noqa: E402
from noesis.engine.engine import Engine, EngineConfig  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 128, 128
TARGET = list(range(1000, 1000 + 200))
TARGETS = {
    "greedy": SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=64,
                             ignore_eos=True),
}


def decode_tokens_per_s(engine: Engine, batch: int) -> float:
    """Output tokens per second of `batch` requests decoding together (prefill excluded)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for index in range(batch):
        engine.add_request([(7 * index + j) % 30000 + 10 for j in range(PROMPT_LEN)], params,
                           request_id=f"b{index}")
    started: set[str] = set()
    while len(started) < batch:  # prefills and the first tokens, untimed
        started |= {out.request_id for out in engine.step()}
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return batch * (NEW_TOKENS - 1) / (time.perf_counter() - start)


def identity(engine: Engine, others: int) -> dict[str, list[int]]:
    """The targets' tokens with `others` other requests, half before them, half two steps on."""
    arrivals = {0: list(range(others // 2)), 1: list(TARGETS), 3: list(range(others // 2, others))}
    outputs, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for item in arrivals.get(step, []):
            if isinstance(item, str):
                engine.add_request(TARGET, TARGETS[item], item)
            else:
                length = 16 + 37 * item % 400
                engine.add_request([(item + j) % 30000 + 10 for j in range(length)],
                                   SamplingParams(temperature=0.7, seed=item,
                                                  max_tokens=32 + item % 64, ignore_eos=True))
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        step += 1
    return {name: outputs[name] for name in TARGETS}


def measure(model: str, invariant: bool, batches: list[int]) -> dict:
    engine = Engine(model, EngineConfig(batch_invariant=invariant, progress=False,
                                        max_num_seqs=max(batches + [64])))
    engine.warm_up()
    result = {"tokens_per_s": {b: decode_tokens_per_s(engine, b) for b in batches}}
    alone = identity(engine, 0)
    result["identical"] = {n + 1: identity(engine, n) == alone for n in (7, 63)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for mode in ("default", "invariant"):  # one engine at a time: each takes the free memory
        results[mode] = measure(args.model, mode == "invariant", batches)
        gc.collect()  # the engine and its graphs hold reference cycles
        torch.cuda.empty_cache()
    print(f"{'batch':>6} {'default tok/s':>14} {'invariant tok/s':>16} {'cost':>7}")
    for batch in batches:
        base, inv = (results[m]["tokens_per_s"][batch] for m in ("default", "invariant"))
        print(f"{batch:>6} {base:>14.1f} {inv:>16.1f} {1 - inv / base:>7.1%}")
    for mode in results:
        print(f"{mode}: alone == inside batches {results[mode]['identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
