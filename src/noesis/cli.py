"""The `noesis` command: generate, chat, info, serve, eval, bench, replay, quantize; pull, list,
rm."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from noesis.engine.config import EngineConfig
from noesis.extras import SERVER_MODULES, require
from noesis.options import add_option_flags, apply_config_file, given_options, read_config_file
from noesis.server.config import COUNT_MAX, MAX_JSON_DEPTH
from noesis.weights.hub import BUNDLED_DIR

BUNDLED_MODEL = (BUNDLED_DIR / "noesis-tiny").resolve()
BUNDLED_MODELS = (BUNDLED_MODEL, BUNDLED_MODEL.with_name("noesis-tiny-draft"))
# generate and chat sample with these when neither a flag nor the checkpoint's
# generation_config.json sets them (the others fall back to SamplingParams' own).
SAMPLING_FALLBACK = {"temperature": 0.7}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from noesis.errors import NoesisError

    if getattr(args, "tensor_parallel_size", 1) > 1 and _torchrun_worker():
        from noesis.distributed.launch import serve_torchrun_rank

        return serve_torchrun_rank()  # the command itself is rank 0's
    try:
        return args.handler(args)
    except NoesisError as exc:
        print(f"noesis: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _torchrun_worker() -> bool:
    """Whether torchrun started this process as a rank other than 0 (noesis.distributed)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="noesis", description="Local LLM inference: load a Hugging Face checkpoint and run it."
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    from noesis.voice.app import add_voice_parser

    add_voice_parser(sub)  # noesis voice: speech in, routed experts, speech out
    from noesis.models_cli import add_model_parsers

    add_model_parsers(sub)  # noesis pull, list, rm

    gen = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    _add_model_args(gen, "all", skip=("seed",))  # --seed is the request's (sampling)
    gen.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads stdin)")
    _add_sampling_args(gen)
    _add_speculative_args(gen)
    _add_trace_args(gen)
    gen.set_defaults(handler=_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive unless MESSAGE is given)")
    _add_model_args(chat, "all", skip=("seed",))  # --seed is the request's (sampling)
    chat.add_argument("message", nargs="?", help="one-shot: send this message, print the reply")
    chat.add_argument("--system", help="a system message placed before the conversation")
    chat.add_argument(
        "--tools",
        help="models with tool syntax: 'builtin' (noesis-tiny's calculator, convert_units, "
        "day_of_week, lookup_country; run for real), 'none', or comma-separated built-in tool "
        "names (default: all seven built-in tools for the bundled models, else none)",
    )
    chat.add_argument(
        "--unconstrained", action="store_true",
        help="Harmony models: sample freely instead of under the turn grammar (which keeps "
        "channels well formed and tool arguments valid for the tool's schema)",
    )
    chat.add_argument(
        "--tool-timeout", type=float, default=None, metavar="SECONDS",
        help="seconds a tool call may run before its result is a timeout error (an isolated "
        "tool's worker process is killed then; default: the tool executor's, 30)",
    )
    _add_sampling_args(chat)
    _add_speculative_args(chat)
    _add_trace_args(chat)
    _add_template_args(chat)
    _add_control_args(chat)
    _add_sidecar_args(chat)
    chat.set_defaults(handler=_chat)

    info = sub.add_parser("info", help="architecture, parameter count, dtype and memory")
    _add_model_args(info)
    info.add_argument(
        "--timings", action="store_true",
        help="load the model on the device, warm it up and run a short generation: print the "
        "timing buckets (cold load: setup and weights, graph capture, warm-up, prefill, decode, "
        "host overhead per step)",
    )
    _add_sidecar_args(info, listing=True)
    info.set_defaults(handler=_info)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions)")
    # A server's requests often share prefixes (system prompts, tools): cached by default.
    _add_model_args(serve, "all", defaults={"enable_prefix_caching": True})
    _add_serve_args(serve)
    _add_speculative_args(serve)
    _add_trace_args(serve)
    _add_template_args(serve)
    _add_control_args(serve)
    serve.set_defaults(handler=_serve, parser=serve)

    bench = sub.add_parser(
        "bench", help="measure latency, throughput and telemetry overhead (or load a server)")
    _add_model_args(bench, "all", skip=("max_num_seqs",))  # bench's own: the largest batch
    _add_bench_args(bench)
    bench.set_defaults(handler=_bench)

    replay = sub.add_parser(
        "replay", help="replay a --deterministic trace; exit 0 when every token matches")
    replay.add_argument("trace", help="the trace file (--trace PATH of generate, chat, serve)")
    replay.add_argument("--model", "-m", help="the model (default: the path in the trace; its "
                        "hash must match the trace's)")
    replay.add_argument("--device", help="default: the trace's device")
    replay.add_argument("--json", help="also write the report here")
    replay.add_argument("--request", metavar="ID", help="reproduce this request (a server's: "
                        "the response's noesis.request_ids): alone when the trace was recorded "
                        "with --batch-invariant, else in its recorded batches (the traffic up "
                        "to its end)")
    replay.set_defaults(handler=_replay)

    quantize = sub.add_parser(
        "quantize", help="write an int4 (AWQ layout) or int8 (GPTQ layout) copy of a checkpoint")
    quantize.add_argument("src", help="the float checkpoint (directory or cached repo id)")
    quantize.add_argument("dst", help="a new directory for the quantized checkpoint")
    quantize.add_argument("--bits", type=int, choices=(4, 8), required=True)
    quantize.add_argument(
        "--group-size", type=int,
        help="input columns per scale and zero point (default: 128 for int4; -1, one per output "
        "channel, for int8)",
    )
    quantize.set_defaults(handler=_quantize)

    evaluate = sub.add_parser("eval", help="evaluate a model (eval tools: tool use)")
    evals = evaluate.add_subparsers(title="evaluations", metavar="EVAL")
    evaluate.set_defaults(handler=lambda _: evaluate.print_help() or 2)
    tools = evals.add_parser("tools", help="tool use on held-out noesis-tiny conversations")
    _add_model_args(tools)
    _add_eval_tools_args(tools)
    _add_speculative_args(tools, draft_flag=False)  # --draft is eval tools' own (see there)
    tools.set_defaults(handler=_eval_tools)
    return parser


# The EngineConfig options every command that loads a model takes; generate, chat, serve and
# bench take all of them (flags built from the dataclass fields: noesis.options).
LOAD_OPTIONS = ("device", "dtype", "max_model_len", "revision")


def _add_model_args(parser: argparse.ArgumentParser, engine: str = "load",
                    skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """--model, --telemetry and the engine's option flags: `engine` "all" adds every
    EngineConfig option (less `skip`), "load" only LOAD_OPTIONS."""
    parser.add_argument(
        "--model", "-m", default=os.environ.get("NOESIS_MODEL"),
        help="checkpoint directory, Hugging Face repo id or bundled model name (default: "
        "$NOESIS_MODEL or the bundled noesis-tiny)",
    )
    group = parser.add_argument_group("engine")
    only = None if engine == "all" else LOAD_OPTIONS
    add_option_flags(group, EngineConfig, defaults=defaults, skip=skip, only=only)
    parser.add_argument(
        "--telemetry", metavar="PATH",
        help="write per-step and per-request telemetry here as JSON lines (device time, batch "
        "fill, bytes moved, graph or eager, verify rate, per-token signals)",
    )


def _add_trace_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("deterministic replay")
    group.add_argument(
        "--deterministic", action="store_true",
        help="record a trace (model hashes, seeds, every step's batch and tokens) that "
        "`noesis replay` reproduces token for token; needs --trace",
    )
    group.add_argument("--trace", metavar="PATH", help="where --deterministic writes its trace")


def _add_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench")
    group.add_argument("--prompt-len", type=_int_in(1, COUNT_MAX), default=128)
    group.add_argument("--gen-len", type=_int_in(2, COUNT_MAX), default=128)
    group.add_argument("--batches", default="1,8,64", help="offline throughput batch sizes")
    group.add_argument("--repeats", type=_int_in(1, 100), default=3, help="latency runs")
    group.add_argument(
        "--overhead", metavar="BATCHES",
        help="also measure telemetry's cost per decode step at these batch sizes (e.g. 1,64)")
    group.add_argument("--overhead-steps", type=_int_in(1, COUNT_MAX), default=64)
    group.add_argument("--max-num-seqs", type=_int_in(1, COUNT_MAX),
                       help="engine batch cap (default: the largest batch asked)")
    group.add_argument("--json", help="also write the report here")
    load = parser.add_argument_group("against a running server (no model is loaded)")
    load.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    load.add_argument("--requests", type=_int_in(1, COUNT_MAX), default=64)
    load.add_argument("--concurrency", type=_int_in(1, 4096), default=8)
    load.add_argument("--timeout", type=_seconds, default=120.0, help="seconds per request")
    load.add_argument("--api-key", default=os.environ.get("NOESIS_API_KEY"))


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    # Unset: the checkpoint's generation_config.json, else SAMPLING_FALLBACK (see _sampling).
    recommended = "default: the checkpoint's generation_config.json, else %s"
    group.add_argument("--temperature", "-t", type=float,
                       help=f"0 means greedy ({recommended % SAMPLING_FALLBACK['temperature']})")
    group.add_argument("--top-k", type=int, help=recommended % "0 (off)")
    group.add_argument("--top-p", type=float, help=recommended % 1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, help=recommended % 1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _add_speculative_args(parser: argparse.ArgumentParser, draft_flag: bool = True) -> None:
    group = parser.add_argument_group("speculative decoding (off unless a method is given)")
    group.add_argument(
        "--speculative-method", choices=("draft", "ngram"),
        help="'draft': a smaller model sharing the tokenizer proposes tokens (--draft); "
        "'ngram': prompt lookup proposes what followed the last tokens earlier in the text. "
        "Greedy output is unchanged; sampled output keeps the model's distribution",
    )
    if draft_flag:
        group.add_argument(
            "--draft", help="the draft checkpoint of --speculative-method draft (default for "
            "the bundled noesis-tiny: the bundled noesis-tiny-draft)",
        )
    group.add_argument(
        "--num-speculative-tokens", type=_int_in(1, 16), metavar="K",
        help="most tokens proposed per step; the depth adapts below it (default 4)",
    )
    group.add_argument(
        "--draft-vocab", type=_int_in(256, 1 << 24), metavar="N",
        help="the draft's LM head keeps only the N lowest token ids (roughly the most "
        "frequent) and the control tokens: cheaper drafting at a large vocabulary; output "
        "unchanged, acceptance may fall (default: the whole head)",
    )


def _speculative(args: argparse.Namespace):
    """The SpeculativeConfig the flags ask for, or None (speculation off)."""
    from noesis.errors import ConfigError

    method, k, vocab = args.speculative_method, args.num_speculative_tokens, args.draft_vocab
    if method is None:
        if k is not None:
            raise ConfigError("--num-speculative-tokens needs --speculative-method")
        if vocab is not None:
            raise ConfigError("--draft-vocab needs --speculative-method draft")
        return None
    from noesis.speculative import SpeculativeConfig

    draft = None
    if method == "draft":
        draft = args.draft or _bundled_draft(args)
    if vocab is not None and method != "draft":
        raise ConfigError("--draft-vocab needs --speculative-method draft")
    return SpeculativeConfig(method=method, draft=draft, k=k if k is not None else 4,
                             draft_vocab=vocab)


def _bundled_draft(args: argparse.Namespace) -> str:
    if Path(_model_arg(args)).resolve() == BUNDLED_MODEL and BUNDLED_MODELS[1].is_dir():
        return str(BUNDLED_MODELS[1])
    from noesis.errors import ConfigError

    raise ConfigError("--speculative-method draft needs --draft (a checkpoint sharing the "
                      "model's tokenizer); only the bundled noesis-tiny has a default draft")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=_int_in(0, 65535), default=8000)
    net.add_argument("--served-model-name", help="the name clients send (default: the model dir)")
    net.add_argument(
        "--api-key", default=os.environ.get("NOESIS_API_KEY"),
        help="require this Bearer key on every route but /health (default: $NOESIS_API_KEY; "
        "none: open; an empty key is an error)",
    )
    net.add_argument(
        "--metrics-public", action="store_true",
        help="serve /metrics without the API key (for a scraper on a trusted network)",
    )
    net.add_argument(
        "--enable-docs", action="store_true",
        help="serve /docs, /redoc and /openapi.json (behind the API key, as every route is)",
    )
    net.add_argument(
        "--cors-origins", default="", metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API (CORS), or '*' for any "
             "(default: none)",
    )
    net.add_argument("--max-n", type=_int_in(1, COUNT_MAX), default=16,
                     help="most choices per request")
    net.add_argument(
        "--max-tokens-limit", type=_int_in(1, COUNT_MAX),
        help="most tokens per choice (default: the context)",
    )
    net.add_argument(
        "--max-queue", type=_int_in(0, COUNT_MAX), default=256,
        help="requests that may wait beyond the running batch before 429 (default 256)",
    )
    net.add_argument(
        "--shutdown-timeout", type=_seconds, default=30.0,
        help="seconds running requests get to finish after SIGTERM (default 30)",
    )
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    net.add_argument(
        "--stats-interval", type=_seconds, default=10.0, metavar="SECONDS",
        help="log one line of engine stats (throughput, running/waiting, KV use, prefix-cache "
        "hits) this often while there is work; 0: never (default 10)",
    )
    net.add_argument(
        "--config", metavar="FILE",
        help="a .toml or .json table of options named as these flags are, with underscores "
        "(max_num_seqs = 128); flags on the command line win; an unknown key is an error",
    )
    net.add_argument(
        "--embedding-model", action="append", default=[], metavar="PATH",
        help="a sentence-embedding checkpoint (BERT family) to serve on /v1/embeddings beside "
             "the model, named by its directory (repeatable)",
    )
    _add_sidecar_args(parser, server=True)
    _add_limit_args(parser)


def _add_sidecar_args(parser: argparse.ArgumentParser, listing: bool = False,
                      server: bool = False) -> None:
    """--sidecars and --safety; `server`: the command runs (or, `listing`, lists) the server's
    sidecars, where safety is on by default."""
    group = parser.add_argument_group("sidecars (side models beside the decode: noesis.sidecars)")
    group.add_argument(
        "--sidecars", metavar="FILE", nargs="?" if listing else None,
        const="" if listing else None,
        help=("list the server's sidecars (placement, cadence, policy): FILE's, if given, "
              "and the safety sidecar unless --no-safety" if listing else
              "a .toml or .json file whose [sidecars] tables configure the sidecars (safety, "
              "intent, contradiction: threshold, policy, cadence, placement)"),
    )
    server = server or listing
    group.add_argument(
        "--safety", action=argparse.BooleanOptionalAction, default=None,
        help="the safety sidecar: a classifier reads each clause of the answer and ends a "
             "harmful one with finish_reason content_filter (default: "
             + ("on for the server; --no-safety, or enabled = false in the --sidecars file, "
                "turns it off" if server else "only if the --sidecars file configures it")
             + "; the bundled classifier: models/noesis-safety/README.md)",
    )


def _sidecars(args: argparse.Namespace, server: bool = False):
    """The sidecars the command line asks for; the server runs the safety sidecar unless told
    not to (--no-safety, or the file's `enabled = false`)."""
    from noesis.sidecars.config import load_sidecars

    safety = True if server and args.safety is None else args.safety
    return load_sidecars(args.sidecars or None, safety=safety)


# Flag -> help; the defaults are RequestLimits' (noesis.server.config), stated here so that
# building the parser does not import the server (and torch) for every command.
_LIMIT_FLAGS = {
    "max-json-depth": "nesting of the body's JSON (default 64, at most 512)",
    "max-prompt-chars": "characters of one prompt (default: the context length times the "
    "tokenizer's longest token, the most that can fit)",
    "max-messages": "messages of one chat request (default 2048)",
    "max-stop": "stop strings per request (default 16)",
    "max-stop-chars": "characters of one stop string (default 1024)",
    "max-tools": "tools of one chat request (default 128)",
    "max-schema-bytes": "bytes of compact JSON of one tool's parameters or response_format "
    "schema (default 262144)",
    "max-schema-depth": "nesting of one such schema (default 48)",
}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    limits = parser.add_argument_group("request limits (checked before any work; over is a 400)")
    limits.add_argument(
        "--max-body-bytes", type=_int_in(1, COUNT_MAX), default=16 << 20, metavar="N",
        help="bytes of one request body; more is a 413 (default 16777216)",
    )
    for flag, help_text in _LIMIT_FLAGS.items():
        hi = MAX_JSON_DEPTH if flag == "max-json-depth" else COUNT_MAX
        limits.add_argument(f"--{flag}", type=_int_in(1, hi), metavar="N", help=help_text)


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]; otherwise an error naming the flag (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not 0 <= value <= 1e9:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be between 0 and 1e9 seconds, got {text}")
    return value


def _add_eval_tools_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--split", choices=("heldout", "train", "natural", "control"), default="heldout",
        help="corpus split, or 'natural': questions phrased as people write and say them, with "
        "accuracy per phrasing kind, or 'control': the held-out kinds with questions answerable "
        "with or without a tool and questions needing two calls (default heldout)",
    )
    parser.add_argument("--n", type=int, default=200, help="conversations (default 200)")
    parser.add_argument("--corpus-seed", type=int, default=1234, help="corpus seed (default 1234)")
    parser.add_argument(
        "--draft", help="a draft model: measure its greedy agreement with the target; with "
        "--speculative-method draft the engine also speculates with it (default there: the "
        "bundled noesis-tiny-draft for the bundled model)",
    )
    parser.add_argument("--temperature", "-t", type=float, help="also a sampled run at this T")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled run (default 0)")
    parser.add_argument("--max-tokens", type=int, default=128, help="per generation (default 128)")
    parser.add_argument("--json", help="also write the report (with per-example scores) here")
    parser.add_argument(
        "--constraint", choices=("harmony", "grounded"),
        help="sample under a grammar: 'harmony' = well-formed turns, tool arguments valid for "
        "the tool's schema; 'grounded' = the same with grounded arguments copied from the "
        "user's words, as `noesis chat` and the server decode (default: unconstrained)",
    )
    parser.add_argument(
        "--control", "--controller", choices=("default", "none", "think-budget", "early-exit"),
        help="steer every generation with a control policy (noesis.control): 'default' = the Φ "
        "controller (temperature and top_p per token) and emit-vs-tool through the turn grammar "
        "(use with --constraint); 'none' = the same loop with the request's own knobs; "
        "'think-budget' = the first turn's analysis capped at 16 tokens; 'early-exit' = the "
        "first turn's analysis closed after the first sentence whose probe of the rest is "
        "confident (default: no control; --controller is the old spelling)",
    )


def _model_arg(args: argparse.Namespace) -> str:
    """--model, with a bundled model's name made its path (as resolve_model_dir would)."""
    if args.model:
        from noesis.weights.hub import bundled_models

        bundled = None if Path(args.model).is_dir() else bundled_models().get(args.model)
        return str(bundled or args.model)
    if BUNDLED_MODEL.is_dir():
        return str(BUNDLED_MODEL)
    from noesis.errors import ModelNotFound

    raise ModelNotFound("no --model given and the bundled model is not present; pass --model")


def _load(args: argparse.Namespace):
    from noesis.llm import LLM

    options = given_options(EngineConfig, args)
    speculative = _speculative(args)
    if speculative is not None:
        options["speculative"] = speculative
    options.update(_recording(args))
    options.update(_template_options(args))
    options.update(_control_options(args))
    if getattr(args, "sidecars", None) is not None or getattr(args, "safety", None):
        options["sidecars"] = _sidecars(args)  # chat: sidecars only when asked for
    return LLM(_model_arg(args), **options)


def _add_template_args(parser: argparse.ArgumentParser) -> None:
    from noesis.dialects import NAMES

    parser.add_argument(
        "--chat-template", metavar="FILE",
        help="a Jinja chat template file to use instead of the checkpoint's own",
    )
    parser.add_argument(
        "--tool-dialect", choices=NAMES,
        help="how the model writes tool calls, where its template does not show it (default: "
        "detected from the template and vocabulary)",
    )


def _add_control_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control", choices=("default", "none"),
        help="the control plane (noesis.control): 'default' moves each sampled request's "
        "temperature and top_p per token from its uncertainty (never above the request's own; "
        "greedy stays greedy) and, in tool loops, allows or forbids the tool call; 'none' (the "
        "default): off",
    )


def _control_options(args: argparse.Namespace) -> dict:
    """The EngineConfig option of --control (commands without it give none)."""
    control = getattr(args, "control", None)
    return {} if control is None else {"control": control}


def _template_options(args: argparse.Namespace) -> dict:
    """LLM / ServeConfig options of --chat-template and --tool-dialect (commands without them
    give none)."""
    options = {}
    path = getattr(args, "chat_template", None)
    if path is not None:
        from noesis.errors import ConfigError

        try:
            options["chat_template"] = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template: cannot read {path}: {exc}") from exc
    if getattr(args, "tool_dialect", None) is not None:
        options["tool_dialect"] = args.tool_dialect
    return options


def _recording(args: argparse.Namespace) -> dict:
    """EngineConfig options of --telemetry, --deterministic and --trace."""
    options = {"telemetry": args.telemetry} if args.telemetry else {}
    deterministic, trace = getattr(args, "deterministic", False), getattr(args, "trace", None)
    if deterministic or trace:
        options.update(deterministic=True, trace=trace)
    return options


def _sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling flags given, checked (before a model loads): the knobs left unset are
    absent, for the checkpoint to recommend."""
    from noesis.sampling.defaults import GENERATION_KEYS
    from noesis.sampling.params import SamplingParams

    flags = dict(
        min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    flags |= {key: getattr(args, key) for key in GENERATION_KEYS if getattr(args, key) is not None}
    SamplingParams(**flags)  # InvalidSamplingParams names a bad flag now, not after loading
    return flags


def _sampling(flags: dict, llm):
    """The flags given, over the checkpoint's generation_config.json, over SAMPLING_FALLBACK."""
    from noesis.sampling.defaults import generation_defaults

    recommended = generation_defaults(llm.engine.loaded.model_dir)
    fallback = {k: v for k, v in SAMPLING_FALLBACK.items() if k not in recommended}
    return llm.get_default_sampling_params(**{**fallback, **flags})


def _generate(args: argparse.Namespace) -> int:
    flags = _sampling_flags(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = _load(args)
    try:
        _stream_to_terminal(llm.stream(prompt, _sampling(flags, llm)))
    finally:
        llm.engine.close()  # telemetry and trace files flushed
    return 0


def _stream_to_terminal(deltas) -> str:
    text = []
    for delta in deltas:
        sys.stdout.write(delta)
        sys.stdout.flush()
        text.append(delta)
    sys.stdout.write("\n")
    return "".join(text)


def _chat(args: argparse.Namespace) -> int:
    flags = _sampling_flags(args)
    if args.tool_timeout is not None and not 0 < args.tool_timeout <= 1e9:  # NaN fails too
        from noesis.errors import ConfigError

        raise ConfigError(f"--tool-timeout must be in (0, 1e9] seconds, got {args.tool_timeout}")
    llm = _load(args)
    try:
        return _chat_loop(args, llm, _sampling(flags, llm))
    finally:
        llm.engine.close()  # telemetry and trace files flushed


def _chat_loop(args: argparse.Namespace, llm, params) -> int:
    reply = _chat_reply(args, llm, params)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        reply(history, args.message)
        return 0
    print("Chatting with", _model_arg(args), "- /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            message = input("> ")
        except EOFError:
            print()
            return 0
        if message.strip() in ("/exit", "/quit"):
            return 0
        if message.strip() == "/reset":
            del history[1 if args.system else 0 :]
            continue
        if message.strip():
            reply(history, message)


def _chat_reply(args: argparse.Namespace, llm, params):
    """The function that answers one user message: Harmony display (and built-in tools) for a
    Harmony model, plain streamed text otherwise."""
    from noesis import chat
    from noesis.errors import InvalidRequest
    from noesis.tools.builtin import DECLARATION_ORDER
    from noesis.tools.executor import ToolExecutor

    turns = None if llm.harmony is not None else llm.turn_format  # a text dialect's
    if llm.harmony is None and (turns is None or not turns.has_calls):
        if args.tools not in (None, "none"):
            raise InvalidRequest(
                "--tools needs a Harmony model or a tool-call dialect: this model's chat "
                "template shows no tool syntax noesis knows (name one with --tool-dialect "
                "hermes, llama3_json or mistral)"
            )
        if turns is None:
            return lambda history, message: _reply(llm, history, message, params)
    bundled = Path(_model_arg(args)).resolve() in BUNDLED_MODELS
    # The bundled models get every built-in tool they know, in the order they use best.
    default = ",".join(DECLARATION_ORDER) if bundled else "none"
    tools = chat.tool_registry(args.tools or default)
    timeout = {} if args.tool_timeout is None else {"timeout_s": args.tool_timeout}
    executor = ToolExecutor(**timeout)
    display = chat.Display()
    control = None if args.control == "none" else args.control  # the loop's, as the engine's

    def reply(history: list[dict], message: str) -> None:
        history.append({"role": "user", "content": message})
        chat.reply(llm, history, tools, display, executor=executor, params=params,
                   constrained=not args.unconstrained, control=control)  # fmt: skip

    return reply


def _reply(llm, history: list[dict], message: str, params) -> None:
    history.append({"role": "user", "content": message})
    prompt = llm.render_chat(history)
    reply = _stream_to_terminal(llm.stream(prompt, params))
    history.append({"role": "assistant", "content": reply})


def _eval_tools(args: argparse.Namespace) -> int:
    import json
    import shlex

    from noesis.llm import LLM
    from noesis.sampling.params import SamplingParams
    from noesis.tiny.harness import EvalConfig, evaluate_tools, format_report

    sampled = None if args.temperature is None else SamplingParams(temperature=args.temperature)
    config = EvalConfig(
        split=args.split, n=args.n, corpus_seed=args.corpus_seed, max_tokens=args.max_tokens,
        sampled=sampled, seed=args.seed, constraint=args.constraint, controller=args.control,
    )
    # Passes 2 and 3 repeat pass 1's prompt: prefix caching skips most of their prefill.
    options = {"progress": False, "enable_prefix_caching": True, **_recording(args),
               **given_options(EngineConfig, args, skip=("revision",))}
    draft = LLM(args.draft, **options) if args.draft else None
    speculative = _speculative(args)
    if speculative is not None:
        options["speculative"] = speculative
    llm = LLM(_model_arg(args), revision=args.revision, **options)
    report = evaluate_tools(llm, config, draft)
    if llm.engine.speculator is not None:
        report["speculative"] = llm.engine.speculator.summary()
    meta = {
        "command": "noesis " + shlex.join(args.argv),
        "model": _model_arg(args),
        "draft": args.draft,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.loaded.dtype).removeprefix("torch."),
    }
    print(format_report(report, _eval_header(meta, report)))
    if "speculative" in report:
        print(_speculative_line(report["speculative"]))
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, **report}, indent=2) + "\n")
    return 0


def _speculative_line(spec: dict) -> str:
    """The speculator's summary: its totals, then a table per output channel."""
    lines = [
        f"\nspeculative decoding ({spec['method']}, k={spec['k']}): acceptance "
        f"{_ratio(spec['acceptance'], percent=True)} ({spec['accepted']}/{spec['proposed']} "
        f"proposed tokens), {_ratio(spec['tokens_per_verify'])} tokens per verify row over "
        f"{spec['verify_rows']} rows, {_ratio(spec['tokens_per_target_row'])} tokens per target "
        f"forward per request ({spec['generated']} tokens / {spec['target_rows']} rows)",
        f"{'channel':<12}{'proposed':>10}{'accepted':>10}{'acceptance':>12}{'verify rows':>13}"
        f"{'mean accepted':>15}{'tokens/forward':>16}",
    ]
    for name, counts in spec["channels"].items():
        lines.append(
            f"{name:<12}{counts['proposed']:>10}{counts['accepted']:>10}"
            f"{_ratio(counts['acceptance'], percent=True):>12}{counts['verify_rows']:>13}"
            f"{_ratio(counts['mean_accepted_length']):>15}"
            f"{_ratio(counts['tokens_per_target_row']):>16}"
        )
    return "\n".join(lines)


def _ratio(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if percent else f"{value:.2f}"


def _eval_header(meta: dict, report: dict) -> str:
    return (
        f"noesis eval tools: {meta['model']} on {report['split']} (n={report['examples']}, "
        f"corpus seed {report['corpus_seed']}), {meta['device']} {meta['dtype']}"
    )


def _info(args: argparse.Namespace) -> int:
    from noesis.engine.loading import describe_checkpoint

    described = describe_checkpoint(_model_arg(args), args.dtype, args.device, args.revision)
    for key, value in described.items():
        print(f"{key:<24}{value}")
    if args.timings:
        _print_timings(args)
    if args.sidecars is not None:
        specs = _sidecars(args, server=True).sidecars
        print(f"{'sidecars':<24}{len(specs) or 'none'}")
        for spec in specs:
            print(f"  {spec.describe()}")
    return 0


TIMING_LABELS = {
    "load_s": "cold load", "read_s": "  read (files into memory)",
    "place_s": "  place (device, dtype)",
    "capture_s": "graph capture", "warmup_s": "warm-up", "prefill_s": "prefill (device)",
    "decode_s": "decode (device)", "host_s": "host overhead",
}


def _print_timings(args: argparse.Namespace) -> None:
    """Load, warm up, then a 64-token prompt and 32 new tokens: the timing buckets."""
    from noesis.engine.engine import Engine, EngineConfig
    from noesis.sampling.params import SamplingParams
    from noesis.telemetry.bench import prompt_ids

    config = EngineConfig(progress=False, telemetry=args.telemetry or True,
                          **given_options(EngineConfig, args))
    engine = Engine(_model_arg(args), config)
    engine.warm_up()
    prompt = prompt_ids(engine, min(64, engine.max_model_len // 2), 0)
    new = max(1, min(32, engine.max_model_len - len(prompt)))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    buckets = engine.timing_buckets()
    engine.close()
    print(f"timings ({engine.device}; prefill and decode of a {len(prompt)}-token prompt and "
          f"{new} new tokens over {buckets['steps']} steps)")
    for key, label in TIMING_LABELS.items():
        if key in buckets:
            per_step = f"  ({1e3 * buckets[key] / buckets['steps']:.3f} ms per step)" \
                if key == "host_s" and buckets["steps"] else ""
            print(f"  {label:<28}{buckets[key]:.4f} s{per_step}")


def _bench(args: argparse.Namespace) -> int:
    import json

    from noesis.telemetry import bench

    if args.url:
        require("server", ("httpx",), "noesis bench --url")
        report = bench.run_server_load(bench.LoadConfig(
            url=args.url, requests=args.requests, concurrency=args.concurrency,
            prompt_len=args.prompt_len, gen_len=args.gen_len, api_key=args.api_key,
            timeout_s=args.timeout))
        print(bench.format_load(report))
    else:
        report = _bench_offline(args, bench)
        print(bench.format_offline(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _bench_offline(args: argparse.Namespace, bench) -> dict:
    import shlex

    from noesis.engine.engine import Engine, EngineConfig

    batches = _int_list(args.batches, "--batches")
    overhead = _int_list(args.overhead, "--overhead") if args.overhead else ()
    config = bench.BenchConfig(prompt_len=args.prompt_len, gen_len=args.gen_len,
                               batches=batches, repeats=args.repeats, overhead_batches=overhead,
                               overhead_steps=args.overhead_steps)
    largest = max((*batches, *overhead))
    engine = Engine(_model_arg(args), EngineConfig(
        progress=False, telemetry=args.telemetry or False,
        max_num_seqs=args.max_num_seqs or largest, **given_options(EngineConfig, args)))
    engine.warm_up()
    report = {"command": "noesis " + shlex.join(args.argv), "model": _model_arg(args),
              "device": str(engine.device),
              "dtype": str(engine.loaded.dtype).removeprefix("torch."),
              **bench.run_offline(engine, config)}
    engine.close()
    return report


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    from noesis.errors import ConfigError

    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} takes positive integers separated by commas, got {text!r}")
    return values


def _quantize(args: argparse.Namespace) -> int:
    from noesis.quant.quantize import quantize_checkpoint
    from noesis.weights.hub import resolve_model_dir

    totals = quantize_checkpoint(resolve_model_dir(args.src), Path(args.dst), args.bits,
                                 args.group_size)
    print(f"quantized {totals['projections']} projections to int{args.bits}: weights "
          f"{totals['bytes_read'] / 2**20:,.1f} MiB -> {totals['bytes_written'] / 2**20:,.1f} MiB "
          f"in {args.dst}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    import json

    from noesis.telemetry.replay import replay, report_dict

    report = replay(args.trace, model=args.model, device=args.device, request_id=args.request)
    if args.json:
        Path(args.json).write_text(json.dumps(report_dict(report), indent=2) + "\n")
    if report.ok:
        requests = f"{report.requests} request{'s' if report.requests != 1 else ''}"
        print(f"replay: all {report.tokens} tokens of {requests} over {report.steps} steps match")
        return 0
    print(f"replay: {report.divergence.describe()}", file=sys.stderr)
    return 1


def _serve(args: argparse.Namespace) -> int:
    if args.config is not None:  # under the command line's flags
        apply_config_file(args.parser, args, args.argv[1:], read_config_file(args.config))
    require("server", SERVER_MODULES, "noesis serve")
    if args.api_key is not None and not args.api_key.strip():
        print(
            "noesis serve: error: the API key (--api-key or $NOESIS_API_KEY) is empty: that "
            "would leave the server open; give a real key, or none for an open server",
            file=sys.stderr,
        )
        return 2
    from noesis.server.app import serve
    from noesis.server.config import RequestLimits, ServeConfig

    engine = EngineConfig(speculative=_speculative(args), **_recording(args),
                          **_control_options(args), sidecars=_sidecars(args, server=True),
                          **given_options(EngineConfig, args))
    names = [flag.replace("-", "_") for flag in _LIMIT_FLAGS]
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    config = ServeConfig(
        model=_model_arg(args), engine=engine, served_model_name=args.served_model_name,
        host=args.host, port=args.port, api_key=args.api_key, max_n=args.max_n,
        metrics_public=args.metrics_public, enable_docs=args.enable_docs,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        stats_interval=args.stats_interval,
        max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes, limits=RequestLimits(**given),
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
        embedding_models=tuple(args.embedding_model), **_template_options(args),
    )
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
