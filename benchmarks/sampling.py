"""What a sampling step costs, by sampling setting and batch size, on a 128k vocabulary: the
sampler as the engine calls it (on CUDA eagerly, after the decode graph's replay); "before", the
path it replaced (filter_logits' full-vocabulary sort for the filtered settings, then the noise
hash and the race as ~20 torch passes over [B, V]); and that sort alone. Checks that both paths
pick the same tokens. On CUDA the sampler filters as before and races in the fused kernel; on the
CPU it races each filtered row's candidates only, and an unfiltered row's vocabulary in blocks.

    python benchmarks/sampling.py [--device cuda|cpu] [--vocab 128256] [--batches 1,8,64]
        [--json out.json]

CUDA: GPU time from CUDA events around `--reps` back-to-back calls, and wall time (the same calls
timed on the host, synchronized once at the end); kernels: the profiler's kernel times summed per
call, the GPU's own work (far below the GPU time: the calls are bound by their launches). CPU:
wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from noesis.sampling.noise import exponential  # noqa: E402
from noesis.sampling.sampler import SamplingTensors, argmax, filter_logits, sample  # noqa: E402

SETTINGS = {  # name: (temperature, top_k, top_p, min_p); None: that filter off
    "greedy": (0.0, None, None, None),
    "T=0.7": (0.7, None, None, None),
    "T=0.7 top_p=0.9": (0.7, None, 0.9, None),
    "T=0.7 top_k=40": (0.7, 40, None, None),
    "T=0.7 min_p=0.05": (0.7, None, None, 0.05),
    "T=1 top_k=50 top_p=0.95": (1.0, 50, 0.95, None),
}


def tensors(setting: tuple, batch: int, device: str) -> SamplingTensors:
    temperature, top_k, top_p, min_p = setting
    if temperature == 0.0:
        return SamplingTensors.greedy()
    filtering = top_k is not None or top_p is not None or min_p is not None

    def column(value, default, dtype):
        if not filtering:
            return None
        return torch.full((batch,), default if value is None else value, dtype=dtype,
                          device=device)

    return SamplingTensors(
        temperature=torch.full((batch,), temperature, device=device),
        top_k=column(top_k, 0, torch.int64), top_p=column(top_p, 1.0, torch.float32),
        min_p=column(min_p, 0.0, torch.float32),
        seeds=torch.arange(batch, device=device, dtype=torch.int64) * 7919 + 1,
        steps=torch.full((batch,), 12, device=device, dtype=torch.int64), all_greedy=False)


def torch_passes(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The race as ~20 torch passes over [B, V], after filter_logits' sort when the setting
    filters: what the race kernel (CUDA), the candidate race and the blocked race (CPU) replaced
    (no greedy rows here)."""
    scaled = logits / t.temperature[:, None]
    if t.top_k is not None:
        scaled = filter_logits(scaled, t.top_k, t.top_p, t.min_p)
    return argmax(scaled - exponential(t.seeds, t.steps, logits.shape[-1]).log())


def filters_only(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    return filter_logits(logits / t.temperature[:, None], t.top_k, t.top_p, t.min_p)


def timed(fn, reps: int, device: str) -> tuple[float | None, float]:
    """(GPU us or None on the CPU, wall us) per call."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        end.record()
    sync()
    wall = (time.perf_counter() - t0) / reps * 1e6
    return (start.elapsed_time(end) / reps * 1e3 if cuda else None), wall


def kernel_us(fn, reps: int = 20) -> float | None:
    """The GPU's own work per call: the profiler's kernel (and memcpy/memset) times summed, so
    a call bound by its launches shows how little of its time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        return sum(e.self_device_time_total for e in prof.key_averages()) / reps
    except (AssertionError, AttributeError, RuntimeError) as error:  # no CUDA activity
        print(f"kernel times unavailable: {error}", file=sys.stderr)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--reps", type=int, help="calls timed per cell (200 on CUDA, 10 on CPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    cuda = device == "cuda"
    reps = args.reps or (200 if cuda else 10)
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    results = {"device": name, "torch": torch.__version__, "vocab": args.vocab, "rows": []}
    print(f"{name}, torch {torch.__version__}, vocab {args.vocab}; us per call"
          + (", GPU / wall" if cuda else ", wall"))
    print(f"{'setting':<26}{'batch':>6}{'sampler':>18}{'kernels':>9}{'before':>18}"
          f"{'sort filters':>18}{'kernels':>9}")
    for batch in [int(b) for b in args.batches.split(",")]:
        gen = torch.Generator(device=device).manual_seed(batch)
        # peaked like a model's logits: a few strong candidates over a long tail
        logits = torch.randn(batch, args.vocab, device=device, generator=gen) * 2.0
        logits[:, :64] += 6.0 * torch.rand(batch, 64, device=device, generator=gen)
        for setting_name, setting in SETTINGS.items():
            t = tensors(setting, batch, device)
            run = partial(sample, logits, t)
            row = {"setting": setting_name, "batch": batch, "sampler_us": timed(run, reps, device),
                   "sampler_kernels_us": kernel_us(run) if cuda else None}
            if not t.all_greedy:
                if not sample(logits, t).token_ids.equal(torch_passes(logits, t)):
                    sys.exit(f"{setting_name}, batch {batch}: the sampler and the path it "
                             "replaced disagree")
                row["torch_passes_us"] = timed(partial(torch_passes, logits, t), reps, device)
            if t.top_k is not None:
                row["filters_us"] = timed(partial(filters_only, logits, t), reps, device)
                row["filters_kernels_us"] = (kernel_us(partial(filters_only, logits, t))
                                             if cuda else None)
            results["rows"].append(row)
            line = f"{setting_name:<26}{batch:>6}"
            for key in ("sampler", "torch_passes", "filters"):
                pair, kernels = row.get(f"{key}_us"), row.get(f"{key}_kernels_us")
                cell = "-" if pair is None else (
                    f"{pair[0]:.1f} / {pair[1]:.1f}" if pair[0] is not None else f"{pair[1]:.1f}")
                line += f"{cell:>18}"
                if key != "torch_passes":
                    line += f"{f'{kernels:.1f}' if kernels is not None else '-':>9}"
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
