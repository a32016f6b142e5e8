"""Where a decode step's GPU time goes: per-kernel totals from the PyTorch profiler (eager path,
same kernels as the captured graph), batch 1 and batch 64.

    python benchmarks/profile_decode.py --shape llama-8b [--batch-invariant]
    python benchmarks/profile_decode.py --model /tmp/noesis-bench/llama-1b-int4 --batches 1

--batch-invariant profiles the same steps in the batch-invariant mode as well (issue 16: where
its cost goes, kernel by kernel).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_random_checkpoint import make_checkpoint  # noqa: E402


def profile(llm, batch: int, new: int) -> None:
    from noesis import SamplingParams

    prompts = [list(range(10 + i, 138 + i)) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params)
    totals = kernel_totals(prof)
    steps = new
    total = sum(v[0] for v in totals.values())
    print(f"\nbatch {batch}: {total / steps / 1e3:.3f} ms GPU per step (prefill included)")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {us / steps:9.1f} us/step {count // steps:5d}x  {name}")


def kernel_totals(prof) -> dict[str, list[float]]:
    """Kernel name -> [GPU microseconds, launches] over a profiler run."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += event.device_time_total
            entry[1] += 1
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench"))
    parser.add_argument("--model", type=Path,
                        help="profile this checkpoint instead of a random one of --shape")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also profile the batch-invariant mode")
    args = parser.parse_args()
    from noesis import LLM

    path = args.model or args.workdir / args.shape
    if not (path / "config.json").exists():
        tie = args.shape == "llama-1b"
        make_checkpoint(path, args.shape, "bfloat16", 8192, 0, tie, "cuda")
    for invariant in (False, True) if args.batch_invariant else (False,):
        print(f"\n=== {'batch-invariant' if invariant else 'default'} mode")
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096,
                  cuda_graphs=False, progress=False, batch_invariant=invariant)
        for batch in map(int, args.batches.split(",")):
            profile(llm, batch, 32)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
