"""Voice configuration: experts, routing rules (task -> expert, device, tools), per-stage thread
budgets and generation settings, read from TOML or JSON over built-in defaults.

A file names only what it changes; tables are merged key by key over DEFAULTS, except `rules`,
which a file replaces whole. Relative paths are relative to the repository root.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noesis.errors import ConfigError
from noesis.sidecars.config import SidecarsConfig, sidecars_from_tables

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL_TASKS = (
    "calculator", "convert_units", "add_days", "days_between", "day_of_week", "lookup_country",
    "string_tool",
)

DEFAULTS: dict[str, Any] = {
    "router": "noesis-router",
    "experts": {
        "noesis-tiny": "noesis-tiny",
        "noesis-tiny-draft": "noesis-tiny-draft",
        "noesis-tiny-ternary": "noesis-tiny-ternary",
    },
    # First matching rule wins; `tasks = ["*"]` matches any task. `device` is a preference list:
    # the first device present is used ("cuda" only when torch sees one).
    "rules": [
        # The tool a routed question needs is the only one declared: a shorter prompt to prefill.
        # The ternary expert scores as well as the float one on the held-out tool set and decodes
        # 2.2x faster on one CPU thread (326 vs 148 tok/s).
        {"tasks": [task], "expert": "noesis-tiny-ternary", "device": ["cpu"], "tools": [task]}
        for task in TOOL_TASKS
    ]
    + [
        {"tasks": ["greeting"], "expert": "noesis-tiny-draft", "device": ["cpu"], "tools": []},
        # A question the router did not place may still need a tool: every built-in one is
        # declared, in noesis.tiny.tools.DECLARATION_ORDER (the order the model uses best).
        {
            "tasks": ["*"], "expert": "noesis-tiny", "device": ["cuda", "cpu"],
            "tools": [
                "string_tool", "add_days", "days_between", "calculator", "convert_units",
                "day_of_week", "lookup_country",
            ],
        },
    ],
    # Intra-op threads per stage (torch, onnxruntime, ctranslate2). On 2 cores the LLM gets one,
    # so synthesis of the first sentence is not starved while generation goes on; synthesis gets
    # two (first sentence's audio 96 ms after its last token, median of 10 turns, against 150 ms
    # with one: short answers are complete before it starts).
    "threads": {"vad": 1, "asr": 2, "router": 1, "llm": 1, "tts": 2},
    # Whisper's encoder window in seconds: 30 is Whisper's own; less cuts a shorter utterance's
    # encoder input to the utterance, padded to this many seconds (noesis.voice.asr). 10 s: the
    # encoder's 0.9 CPU-s per turn becomes 0.13; 40 spoken questions 34/40 right (30 s: 33/40),
    # WER on 30 sentences Piper 2.8% (2.4%), espeak-ng 8.9% (13.8%); one-word commands suffer
    # (Piper 3 of 8 wrong, 1 with 30 s): benchmarks/RESULTS.md, issue 23.
    "asr": {"window_s": 10},
    "pool": {"memory_budget_bytes": 512 * 2**20, "prefetch_chunk_bytes": 4 * 2**20},
    "generation": {
        "dtype": "float32", "temperature": 0.0, "max_tokens": 160, "max_model_len": 1024,
        "max_tool_steps": 3, "system": "Answer clearly and briefly.",
        # The expert whose checkpoint drafts tokens for the others (speculative decoding, the same
        # greedy text): 6 spoken questions' answers 22% sooner on one CPU thread. "" turns it off.
        "draft": "noesis-tiny-draft",
    },
    "queue_size": 4,
    # Side models beside every expert's decoding (noesis.sidecars), one table each, as in a
    # `noesis serve --sidecars` file: [sidecars.safety] ends an answer that turns harmful (the
    # voice then says noesis.voice.experts.BLOCKED_SPEECH), [sidecars.intent] guesses each
    # turn's tool. None by default.
    "sidecars": {},
}


@dataclass(frozen=True)
class RouteRule:
    tasks: tuple[str, ...]
    expert: str
    devices: tuple[str, ...]
    tools: tuple[str, ...]

    def matches(self, task: str) -> bool:
        return "*" in self.tasks or task in self.tasks


@dataclass(frozen=True)
class Route:
    expert: str
    device: str
    tools: tuple[str, ...]


@dataclass(frozen=True)
class Threads:
    vad: int
    asr: int
    router: int
    llm: int
    tts: int


@dataclass(frozen=True)
class Generation:
    dtype: str
    temperature: float
    max_tokens: int
    max_model_len: int
    max_tool_steps: int
    system: str
    draft: str = ""  # an expert's name, or "": no speculative decoding


@dataclass(frozen=True)
class VoiceConfig:
    router: Path
    experts: dict[str, Path]
    rules: tuple[RouteRule, ...]
    threads: Threads
    memory_budget_bytes: int
    prefetch_chunk_bytes: int
    generation: Generation
    queue_size: int
    asr_window_s: float = 30.0
    sidecars: SidecarsConfig | None = None  # None: no side models

    def route(self, task: str, cuda_available: bool | None = None) -> Route:
        """The expert, device and tools of the first rule matching `task`."""
        for rule in self.rules:
            if rule.matches(task):
                return Route(rule.expert, pick_device(rule.devices, cuda_available), rule.tools)
        raise ConfigError(f"no routing rule matches task {task!r}; add one (or tasks = ['*'])")

    def check_labels(self, labels: tuple[str, ...]) -> None:
        """Every label the router can produce must reach a rule."""
        unrouted = [label for label in labels if not any(r.matches(label) for r in self.rules)]
        if unrouted:
            raise ConfigError(f"routing rules miss the router's tasks {unrouted}")


def pick_device(preferences: tuple[str, ...], cuda_available: bool | None = None) -> str:
    """The first preferred device present; "cuda" counts only when torch sees a GPU."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    for device in preferences:
        if device == "cpu" or (device == "cuda" and cuda_available):
            return device
    raise ConfigError(
        f"none of the devices {list(preferences)} is available here (cuda: {cuda_available}); "
        "add 'cpu' to the rule's device list"
    )


def load_config(path: str | Path | None = None) -> VoiceConfig:
    """DEFAULTS, overridden by a .toml or .json file when one is given."""
    raw = copy.deepcopy(DEFAULTS)
    if path is not None:
        raw = merge(raw, read_file(Path(path)))
    return parse(raw)


def read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"voice config {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib  # Python 3.11+

            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text)
    except ImportError as exc:
        raise ConfigError("TOML voice configs need Python 3.11+; use a .json file") from exc
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"voice config {path} is not valid {path.suffix[1:]}: {exc}") from exc
    raise ConfigError(f"voice config {path}: use a .toml or .json file")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(override) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown voice config keys {unknown} (known: {sorted(DEFAULTS)})")
    for key, value in override.items():
        if isinstance(base.get(key), dict) and key != "rules":
            if not isinstance(value, dict):
                raise ConfigError(f"voice config key {key!r} must be a table")
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def parse(raw: dict[str, Any]) -> VoiceConfig:
    try:
        experts = {name: _path(p) for name, p in raw["experts"].items()}
        rules = tuple(_rule(r, experts) for r in raw["rules"])
        threads = Threads(**raw["threads"])
        generation = Generation(**raw["generation"])
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"voice config: {exc}") from exc
    if generation.draft and generation.draft not in experts:
        raise ConfigError(
            f"generation.draft names expert {generation.draft!r}; experts: {sorted(experts)}"
        )
    for stage, count in vars(threads).items():
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"voice config threads.{stage} must be an integer >= 1")
    pool = raw["pool"]
    return VoiceConfig(
        router=_path(raw["router"]),
        experts=experts,
        rules=rules,
        threads=threads,
        memory_budget_bytes=_positive(pool, "memory_budget_bytes"),
        prefetch_chunk_bytes=_positive(pool, "prefetch_chunk_bytes"),
        generation=generation,
        queue_size=_positive(raw, "queue_size"),
        asr_window_s=_window(raw["asr"]),
        sidecars=_sidecars(raw["sidecars"]),
    )


def _sidecars(raw: Any) -> SidecarsConfig | None:
    if not isinstance(raw, dict):
        raise ConfigError("voice config key 'sidecars' must be a table of sidecar tables")
    config = sidecars_from_tables(raw)
    return config if config.sidecars else None


def _rule(raw: dict[str, Any], experts: dict[str, Path]) -> RouteRule:
    from noesis.tiny.tools import TOOLS

    rule = RouteRule(
        tuple(raw["tasks"]), raw["expert"], tuple(raw["device"]), tuple(raw.get("tools", ()))
    )
    if rule.expert not in experts:
        raise ConfigError(f"rule {raw} names expert {rule.expert!r}; experts: {sorted(experts)}")
    bad_devices = [d for d in rule.devices if d not in ("cuda", "cpu")]
    if bad_devices or not rule.devices:
        raise ConfigError(f"rule {raw}: device must be a list of 'cuda' / 'cpu'")
    unknown = [t for t in rule.tools if t not in TOOLS]
    if unknown:
        raise ConfigError(f"rule {raw}: unknown tools {unknown} (built-in: {sorted(TOOLS)})")
    return rule


def _path(value: str) -> Path:
    """A bundled model's name (noesis-tiny: found in a clone and in an installed wheel alike), an
    absolute path, or a path relative to the repository (configs written for a clone)."""
    from noesis.weights.hub import bundled_models

    bundled = bundled_models().get(value)
    if bundled is not None:
        return bundled
    path = Path(value)
    return path if path.is_absolute() else REPO_ROOT / path


def _window(asr: dict[str, Any]) -> float:
    unknown = sorted(set(asr) - {"window_s"})
    value = asr.get("window_s")
    if unknown or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"voice config [asr] takes window_s (seconds), got {asr!r}")
    if not 1 <= value <= 30:
        raise ConfigError(f"voice config asr.window_s must be in [1, 30] seconds, got {value}")
    return float(value)


def _positive(table: dict[str, Any], key: str) -> int:
    value = table[key]
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"voice config {key} must be a positive integer, got {value!r}")
    return value
