"""Where a decode step's wall time goes at a given batch: host phases (plan, launch, wait for the
device, outputs) and the device's busy share, with overlapped steps on and off.

    python benchmarks/step_timeline.py --model /tmp/noesis-bench/llama-8b --batches 1,64,128

Host phases come from timers around the engine's calls; the device's busy time is the sum of its
kernel and copy durations in a torch.profiler run of the same steady-state steps (one stream, so
they never overlap): wall minus busy is the time the device sat idle.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steady_state(engine, batch: int, prompt_len: int, warm_steps: int) -> None:
    from noesis.sampling.params import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for _ in range(batch):
        vocab = engine.loaded.config.vocab_size
        ids = torch.randint(10, min(30000, vocab), (prompt_len,), generator=gen).tolist()
        engine.add_request(ids, params)
    for _ in range(warm_steps):
        engine.step()


def run_steps(engine, steps: int) -> float:
    """Seconds for `steps` engine steps, the device drained before and after."""
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    return time.perf_counter() - start


def timed(engine, steps: int) -> dict[str, float]:
    """Mean ms per step of each host phase over `steps` steps."""
    phases: dict[str, float] = defaultdict(float)
    runner, scheduler = engine.runner, engine.scheduler

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                phases[label] += time.perf_counter() - start

        setattr(owner, name, timed_call)
        return real

    originals = [(runner, "launch", wrap(runner, "launch", "launch")),
                 (runner, "fetch", wrap(runner, "fetch", "wait for device")),
                 (scheduler, "schedule", wrap(scheduler, "schedule", "plan"))]
    try:
        wall = run_steps(engine, steps)
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)
    result = {label: seconds / steps * 1e3 for label, seconds in phases.items()}
    result["rest (resolve, outputs)"] = wall / steps * 1e3 - sum(result.values())
    result["step"] = wall / steps * 1e3
    return result


def device_busy(engine, steps: int) -> tuple[float, float]:
    """(wall ms, device-busy ms) per step under the profiler (CUDA only)."""
    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = run_steps(engine, steps)
    busy = sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    return wall / steps * 1e3, busy / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,64,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from noesis.engine.engine import Engine, EngineConfig

    config = EngineConfig(device=args.device, max_num_seqs=128, max_model_len=4096,
                          progress=False)
    engine = Engine(args.model, config)
    for batch in [int(b) for b in args.batches.split(",")]:
        for overlap in (True, False):
            engine.overlap = overlap
            steady_state(engine, batch, args.prompt_len, 12)
            phases = timed(engine, args.steps)
            wall, busy = device_busy(engine, 20)
            engine.abort_all()
            while engine.has_unfinished():
                engine.step()
            text = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
            print(f"batch {batch:>3} overlap {'on ' if overlap else 'off'}: {text} ms | profiled "
                  f"step {wall:.3f} ms, device busy {busy:.3f} ms ({busy / wall:.0%})",
                  flush=True)
    counts = engine.runner.step_counts
    print(f"steps: graph {counts['graph']}, eager {counts['eager']}")


if __name__ == "__main__":
    main()
