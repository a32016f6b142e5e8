"""Where a mixed step's time goes: 128 sequences decoding while one new 512-token prompt prefills,
against a decode-only step of the same batch. Wall time per step kind, then per-kernel GPU totals.

    python benchmarks/profile_mixed.py --model /tmp/noesis-bench/llama-8b --batch 128
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from profile_decode import kernel_totals  # benchmarks/ is on sys.path when run as a script


def fill(engine, batch: int, prompt_len: int, rng: random.Random, params) -> None:
    for _ in range(batch):
        engine.add_request([rng.randrange(10, 300) for _ in range(prompt_len)], params)
    while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()


def timed_steps(engine, count: int, add_every: int, prompt_len: int, rng, params) -> dict:
    """Step `count` times, adding a new prompt every `add_every` steps (0: never); wall ms by
    kind of step."""
    kinds: dict[str, list[float]] = defaultdict(list)
    for i in range(count):
        if add_every and i % add_every == 0:
            engine.add_request([rng.randrange(10, 300) for _ in range(prompt_len)], params)
        before = dict(engine.runner.step_counts)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        kind = "graph" if engine.runner.step_counts["graph"] > before["graph"] else "eager"
        kinds[kind].append(ms)
    return {k: (len(v), sorted(v)[len(v) // 2]) for k, v in kinds.items()}


def kernel_table(engine, rng, prompt_len: int, params) -> None:
    engine.add_request([rng.randrange(10, 300) for _ in range(prompt_len)], params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    totals = kernel_totals(prof)
    total = sum(v[0] for v in totals.values())
    print(f"mixed step GPU total {total / 1e3:.2f} ms")
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:18]:
        print(f"  {us / 1e3:8.3f} ms {n:5d}x  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    from noesis.engine.engine import Engine, EngineConfig
    from noesis.sampling.params import SamplingParams

    engine = Engine(args.model, EngineConfig(device="cuda", max_num_seqs=args.batch + 8,
                                             enable_prefix_caching=True, progress=False))
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    fill(engine, args.batch, args.prompt_len, rng, params)
    print("decode only:", timed_steps(engine, args.steps, 0, args.prompt_len, rng, params))
    print("one prompt every 2 steps:",
          timed_steps(engine, args.steps, 2, args.prompt_len, rng, params))
    kernel_table(engine, rng, args.prompt_len, params)


if __name__ == "__main__":
    main()
