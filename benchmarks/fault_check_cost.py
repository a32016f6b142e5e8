"""What the sampler's per-row fault check costs on a GPU: decode with it and without it, side by
side in one run, against the bandwidth roofline and transformers on the same weights.

    python benchmarks/fault_check_cost.py [--shape llama-1b] [--batches 1,64] [--reps 3]
        [--no-hf] [--json out.json]

The check (`SamplerOutput.reported_ids`: -1 in the host's copy of a row whose logits hold NaN or
+inf or nothing finite; on CUDA folded into the greedy and race kernels' own pass over the
logits, elsewhere a row maximum and `isfinite`) lets the engine end a request whose logits went
NaN without touching the others. "off" sets `noesis.sampling.sampler.CHECK_ROWS = False`.
Per batch size: steady decode tok/s with the check on and off (each the
median of --reps alternating runs of 192 engine steps once every sequence decodes), their ratio,
the roofline (weights plus the KV read per step, at the measured copy bandwidth), and the GPU time
of greedy sampling alone on the captured graph's logits, on and off. transformers: eager
`generate`, batch 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_decode import (  # noqa: E402
    TIED,
    bench_transformers,
    copy_bandwidth,
    event_time,
    library_versions,
    prompt_ids,
    steady_decode,
)
from make_random_checkpoint import make_checkpoint  # noqa: E402

import noesis.sampling.sampler as sampler  # noqa: E402


def with_check(enabled: bool) -> None:
    sampler.CHECK_ROWS = enabled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench"))
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "fault_check_cost.json")
    args = parser.parse_args()
    from noesis import LLM

    path = args.workdir / args.shape
    if not (path / "config.json").exists():
        make_checkpoint(path, args.shape, tie=TIED[args.shape])
    bandwidth = copy_bandwidth()
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=4096, max_num_seqs=128,
              progress=False)
    engine = llm.engine
    config = engine.loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    kv_per_token = 2 * config.num_layers * config.kv_size * 2
    rows = {}
    for batch in map(int, args.batches.split(",")):
        prompts = [prompt_ids(128, 100 + i) for i in range(batch)]
        runs = {True: [], False: []}
        mean_ctx = 0.0
        for _ in range(args.reps):
            for enabled in (True, False):
                with_check(enabled)
                seconds, steps, mean_ctx = steady_decode(engine, prompts)
                runs[enabled].append(batch * steps / seconds)
        roofline = batch * bandwidth / (weight_bytes + batch * mean_ctx * kv_per_token)
        logits = engine.runner.graphs.logits[batch]  # the captured graph's output buffer
        greedy = sampler.SamplingTensors.greedy()
        sample_ms = {}
        for enabled in (True, False):
            with_check(enabled)
            sample_ms[enabled] = event_time(partial(sampler.sample, logits, greedy)) * 1e3
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        rows[batch] = {"on_tok_s": on, "off_tok_s": off, "on_over_off": on / off,
                       "runs_on": runs[True], "runs_off": runs[False],
                       "roofline_tok_s": roofline, "on_share_of_roofline": on / roofline,
                       "greedy_sample_ms_on": sample_ms[True],
                       "greedy_sample_ms_off": sample_ms[False]}
    with_check(True)
    del llm, engine
    torch.cuda.empty_cache()
    hf = None if args.no_hf else bench_transformers(path, compile_=False)
    result = {"device": torch.cuda.get_device_name(), "shape": args.shape,
              "copy_bandwidth_gb_s": bandwidth / 1e9, "batches": rows,
              "transformers_eager": hf, "versions": library_versions()}
    print(f"{result['device']}, {args.shape} bf16, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("batch  check on tok/s  off tok/s  on/off   roofline  on/roofline  "
          "sample ms on/off")
    for batch, row in rows.items():
        print(f"{batch:>5}  {row['on_tok_s']:>14.1f}  {row['off_tok_s']:>9.1f}  "
              f"{row['on_over_off']:>6.3f}  {row['roofline_tok_s']:>9.1f}  "
              f"{row['on_share_of_roofline']:>11.3f}  "
              f"{row['greedy_sample_ms_on']:.4f}/{row['greedy_sample_ms_off']:.4f}")
    if hf is not None:
        print(f"transformers eager, batch 1: {hf.get('decode_tok_s', float('nan')):.1f} tok/s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
