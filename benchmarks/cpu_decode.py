"""CPU benchmark: decode tok/s and time to first token, noesis vs transformers eager.

    python benchmarks/cpu_decode.py [--checkpoint DIR] [--threads N] [--prompt-len 128] [--new 64]

Without --checkpoint it writes a random ~125M-parameter Llama-shaped checkpoint (float32) to
.bench/llama-100m first. Both engines run greedy, batch 1, with the same torch thread count; each
figure is the median of --repeats runs after a warm-up. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def ensure_checkpoint(path: Path | None) -> Path:
    if path is not None:
        return path
    path = ROOT / ".bench" / "llama-100m"
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_random_checkpoint.py"),
             "--shape", "100m", "--dtype", "float32", "--out", str(path)],
            check=True,
        )
    return path


def time_noesis(path: Path, prompt: list[int], new: int, repeats: int) -> dict:
    from noesis import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    load = time.perf_counter() - start

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        assert len(out.token_ids) == max_tokens
        return time.perf_counter() - t0

    return measure(run, new, repeats) | {"load_s": load}


def time_transformers(path: Path, prompt: list[int], new: int, repeats: int) -> dict:
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    ids = torch.tensor([prompt])

    def run(max_tokens: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == len(prompt) + max_tokens
        return time.perf_counter() - t0

    return measure(run, new, repeats) | {"load_s": load}


def measure(run, new: int, repeats: int) -> dict:
    run(2)  # warm-up
    ttft = statistics.median(run(1) for _ in range(repeats))
    total = statistics.median(run(new) for _ in range(repeats))
    return {"ttft_s": ttft, "decode_tok_s": (new - 1) / (total - ttft), "total_s": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / ".bench" / "cpu_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_checkpoint(args.checkpoint)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 500, (args.prompt_len,), generator=gen).tolist()
    results = {
        "noesis": time_noesis(path, prompt, args.new, args.repeats),
        "transformers (eager)": time_transformers(path, prompt, args.new, args.repeats),
    }
    print_table(results, args)
    meta = {
        "checkpoint": str(path), "threads": args.threads, "prompt_len": args.prompt_len,
        "new_tokens": args.new, "repeats": args.repeats, "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"\nJSON written to {args.json}")


def print_table(results: dict, args) -> None:
    print(f"\nbatch 1, prompt {args.prompt_len} tokens, {args.new} new tokens, "
          f"{args.threads} threads, float32, median of {args.repeats}")
    print(f"{'engine':<22}{'decode tok/s':>14}{'TTFT ms':>10}{'load s':>9}")
    for name, r in results.items():
        print(f"{name:<22}{r['decode_tok_s']:>14.1f}{r['ttft_s'] * 1e3:>10.1f}{r['load_s']:>9.2f}")
    ratio = results["noesis"]["decode_tok_s"] / results["transformers (eager)"]["decode_tok_s"]
    print(f"noesis / transformers decode speed: {ratio:.2f}x")


if __name__ == "__main__":
    main()
