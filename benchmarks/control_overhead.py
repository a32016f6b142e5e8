"""What the control plane costs per decode step: the sampler with per-token metrics on against the
same call with them off, on a 128k vocabulary at batch 1 and 64 (the 8B shape's sampler input),
plus the host's per-token knobs for every row of the step (TokenKnobs.observe per row: belief,
Φ and the row's knobs, then the runner's read of each row's temperature and top_p). Checks the
CUDA kernel against the PyTorch reference on the same logits.

    python benchmarks/control_overhead.py [--device cuda] [--batches 1,64] [--json out.json]
        [--step-ms 1:3.94,64:5.17]

--step-ms: the decode step the added time is a share of, per batch (default: the 8B graph step
on the H200 in benchmarks/RESULTS.md). On an H100 pass its own: --step-ms 1:5.41,64:7.27 (the
8B graph steps of the 2026-11-25 gpu_quant run).

`of step` is (added us + host us) / step. The engine's CUDA graphs hold the forward and the LM
head only (noesis.runner.cuda_graph); the sampler, and token_metrics with it, is launched
eagerly from Python after the replay (ModelRunner.launch -> _sample). So `added us`, the eager
sampler with metrics on minus off, launch overhead included, is the real path's device cost, not
a flattering one. `kernel us` is token_metrics alone replayed from a CUDA graph (what it would
cost captured: the kernels' own time; the capture also shows the call is graph-safe); `eager us`
the same call launched from Python. The host part is a ceiling: with overlapped steps (the CUDA
default) it runs while the device computes the next step.

--model DIR adds the end-to-end answer: one engine (CUDA graphs, overlapped steps, the default
policy) decoding `batch` sampled requests (T=0.7, top_p 0.9, 128-token prompts) with control on
against the same requests opted out (SamplingParams(control=False): no metrics, no knobs),
alternating on / off / on / off and taking each side's best: decode tokens per second, prefill
excluded. This is the cost a user sees; the table above splits it into its parts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from noesis.control import DefaultPolicy  # noqa: E402
from noesis.control.knobs import TokenControl  # noqa: E402
from noesis.sampling.metrics import TokenMetrics, reference_metrics, token_metrics  # noqa: E402
from noesis.sampling.params import SamplingParams  # noqa: E402
from noesis.sampling.sampler import SamplingTensors, sample  # noqa: E402


def knobs(batch: int, greedy: bool, metrics: bool, device: str) -> SamplingTensors:
    if greedy:
        return SamplingTensors.greedy(metrics=metrics)
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    return SamplingTensors(torch.full((batch,), 0.7, device=device), None, None, None,
                           torch.arange(batch, device=device), zeros, all_greedy=False,
                           metrics=metrics)  # fmt: skip


def time_ms(fn, reps: int, device: str) -> float:
    for _ in range(5):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) * 1e3 / reps


def metrics_us(logits: torch.Tensor, reps: int, device: str) -> tuple[float, float]:
    """(graph-replayed, eager) microseconds of one token_metrics call on these logits; on the
    CPU both are the eager time."""
    eager = time_ms(lambda: token_metrics(logits), reps, device) * 1e3
    if device != "cuda":
        return eager, eager
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capture
        token_metrics(logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token_metrics(logits)
    return time_ms(graph.replay, reps, device) * 1e3, eager


def host_knobs_us(batch: int, steps: int = 2000) -> float:
    """Per step of `batch` controlled rows: what the engine runs on the host when a step is read
    back (each row's TokenKnobs.observe under the default policy: belief, Φ, the row's knobs)
    and when the next is planned (each row's temperature and top_p, as the runner reads them)."""
    control = TokenControl(DefaultPolicy())
    rows = [control.knobs(SamplingParams(temperature=0.7, top_p=0.95)) for _ in range(batch)]
    stream = [[TokenMetrics(0.2 + (i + row) % 7 * 0.3, 0.1, 0.9, 0.5) for row in range(batch)]
              for i in range(steps)]  # fmt: skip
    began = time.perf_counter()
    for metrics in stream:
        for knobs, row in zip(rows, metrics, strict=True):
            knobs.observe(row)
        [(knobs.temperature, knobs.top_p) for knobs in rows]
    return (time.perf_counter() - began) * 1e6 / steps


def engine_ab(model: str, batches: list[int], new_tokens: int = 128) -> dict[int, dict]:
    """Decode tok/s with control on and opted out, same engine, alternating (best of two)."""
    from noesis.engine.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(control="default", progress=False,
                                        max_num_seqs=max(batches + [64])))  # fmt: skip
    engine.warm_up()
    result = {}
    for batch in batches:
        runs = {True: [], False: []}
        for control in (True, False, True, False):
            params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=new_tokens,
                                    ignore_eos=True, seed=3, control=control)  # fmt: skip
            for index in range(batch):
                engine.add_request([(7 * index + j) % 30000 + 10 for j in range(128)], params)
            started: set[str] = set()
            while len(started) < batch:  # prefills and first tokens, untimed
                started |= {out.request_id for out in engine.step()}
            began = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            runs[control].append(batch * (new_tokens - 1) / (time.perf_counter() - began))
        on, off = max(runs[True]), max(runs[False])
        result[batch] = {"on_tok_s": on, "off_tok_s": off, "cost": 1 - on / off, "runs": runs}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--step-ms", default="1:3.94,64:5.17")
    parser.add_argument("--model", help="also time the engine end to end on this checkpoint")
    parser.add_argument("--json")
    args = parser.parse_args()
    steps = dict(item.split(":") for item in args.step_ms.split(",") if item)
    batches = [int(b) for b in args.batches.split(",")]
    host_us = {batch: host_knobs_us(batch) for batch in batches}  # per step
    rows = []
    for batch in batches:
        gen = torch.Generator(device=args.device).manual_seed(batch)
        logits = torch.randn(batch, args.vocab, device=args.device, generator=gen) * 3
        error = (token_metrics(logits) - reference_metrics(logits)).abs().max().item()
        kernel_us, eager_us = metrics_us(logits, args.reps, args.device)
        for name, greedy in (("greedy", True), ("T=0.7", False)):
            off, on = (knobs(batch, greedy, m, args.device) for m in (False, True))
            off_ms = time_ms(lambda o=off, x=logits: sample(x, o), args.reps, args.device)
            on_ms = time_ms(lambda o=on, x=logits: sample(x, o), args.reps, args.device)
            step = float(steps.get(str(batch), "nan"))
            host_ms = 0.0 if greedy else host_us[batch] / 1e3  # greedy rows have no knobs
            rows.append({"batch": batch, "setting": name, "off_ms": off_ms, "on_ms": on_ms,
                         "added_us": (on_ms - off_ms) * 1e3, "host_us": host_ms * 1e3,
                         "share_of_step": (on_ms - off_ms + host_ms) / step, "step_ms": step,
                         "kernel_us": kernel_us, "eager_us": eager_us,
                         "max_abs_error_vs_reference": error})  # fmt: skip
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "vocab": args.vocab, "rows": rows,
              "host_knobs_us_per_step": host_us}  # fmt: skip
    print(f"{'batch':>5} {'setting':>8} {'off ms':>8} {'on ms':>8} {'added us':>9} "
          f"{'host us':>8} {'of step':>8} {'kernel us':>9} {'eager us':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>5} {r['setting']:>8} {r['off_ms']:>8.3f} {r['on_ms']:>8.3f} "
              f"{r['added_us']:>9.1f} {r['host_us']:>8.1f} {100 * r['share_of_step']:>7.2f}% "
              f"{r['kernel_us']:>9.1f} {r['eager_us']:>8.1f}")  # fmt: skip
    per_row = ", ".join(f"{us / b:.2f} at batch {b}" for b, us in host_us.items())
    print(
        f"host knobs: us per token and row {per_row}; kernel vs "
        f"reference max abs error {max(r['max_abs_error_vs_reference'] for r in rows):.2e}"
    )
    if args.model:
        report["engine"] = engine_ab(args.model, batches)
        print(f"{'batch':>5} {'on tok/s':>10} {'off tok/s':>10} {'cost':>7}  engine: {args.model}")
        for batch, r in report["engine"].items():
            print(f"{batch:>5} {r['on_tok_s']:>10.1f} {r['off_tok_s']:>10.1f} {r['cost']:>7.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
