"""Sidecar configuration: the `[sidecars]` section of a TOML or JSON file (the voice config's
format), one table per sidecar, checked when read; `SidecarsConfig.build` makes the
SidecarRuntime in the engine's own process.

    [sidecars.safety]            # on with this table or --safety; `enabled = false` drops it
    model = "noesis-safety"      # or a folder: an encoder classifier (train_safety_encoder.py
                                 # --export) or a router-format n-gram model
    threshold = 0.9              # p(unsafe) at which a response ends with "content_filter"
                                 # (default: the model's own, else 0.8)
    policy = "closed"            # a failing sidecar or a dropped window blocks too
    cadence = "tokens"           # request | clause | tokens | turn
    every = 8

    [sidecars.intent]            # guesses each turn's tool; scores the guess at the turn's end
    threshold = 0.5              # the router's p at which the guess is acted on

    [sidecars.contradiction]     # scores each branch against its context and siblings: the
    threshold = 0.5              # binding gate reads the score; at threshold it counts a decision

Torch-free: the CLI reads and lists the configuration without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noesis.errors import ConfigError
from noesis.sidecars.runtime import POLICIES, Cadence, Placement

# Kind -> its table's defaults; a table's kind is its `kind` key, else its name.
DEFAULTS: dict[str, dict[str, Any]] = {
    # threshold None: the classifier's own (its config.json may recommend one), else 0.8
    "safety": {"model": "noesis-safety", "threshold": None, "policy": "open", "cadence": "clause"},
    # the router guesses a turn's tool; at p >= threshold it is a prediction, scored at the end
    "intent": {"model": "noesis-router", "threshold": 0.5, "cadence": "turn"},
    # p(a branch contradicts its context or its siblings), read by the binding gate
    "contradiction": {"model": "noesis-contradiction", "threshold": 0.5, "cadence": "clause"},
}
COMMON = {"kind": None, "enabled": True, "model": None, "cadence": "request", "every": 16,
          "device": "cpu", "workers": 1, "queue_size": 8, "batch": 8, "policy": "open",
          "threshold": 0.5}


@dataclass(frozen=True)
class SidecarSpec:
    """One configured sidecar, every option resolved (its model a directory path)."""

    name: str
    kind: str
    model: str
    cadence: Cadence
    placement: Placement
    policy: str
    threshold: float | None  # None: the model's own

    def describe(self) -> str:
        cadence = self.cadence.kind + (f" (every {self.cadence.every} tokens)"
                                       if self.cadence.kind == "tokens" else "")
        place = self.placement
        return (f"{self.name}: {self.kind}, model {self.model}; {place.device}, "
                f"{place.workers} worker(s), queue {place.queue_size}, batch {place.batch}; "
                f"cadence {cadence}; "
                f"fails {self.policy}; threshold "
                f"{'the model' + chr(39) + 's' if self.threshold is None else self.threshold}")


@dataclass(frozen=True)
class SidecarsConfig:
    sidecars: tuple[SidecarSpec, ...] = ()

    @property
    def reads_turns(self) -> bool:
        """Whether a sidecar reads turns as they are admitted (intent): a server then shows
        the engine each chat request's conversation and tools."""
        return any(spec.cadence.kind == "turn" for spec in self.sidecars)

    def build(self):
        """The SidecarRuntime running these sidecars (models loaded here)."""
        from noesis.sidecars.runtime import SidecarRuntime

        return SidecarRuntime([_build(spec) for spec in self.sidecars])


def load_sidecars(path: str | Path | None = None, safety: bool | None = None) -> SidecarsConfig:
    """The `[sidecars]` tables of the file at `path`, each over its kind's defaults; `safety`
    True adds the safety sidecar (a file's `enabled = false` still drops it), False drops it,
    None leaves it to the file."""
    tables: dict[str, dict[str, Any]] = {"safety": {}} if safety else {}
    if path is not None:
        for name, table in read_section(Path(path)).items():
            if not isinstance(table, dict):
                raise ConfigError(f"sidecars.{name} must be a table")
            tables[name] = {**tables.get(name, {}), **table}
    if safety is False:
        tables.pop("safety", None)
    return sidecars_from_tables(tables)


def sidecars_from_tables(tables: dict[str, Any]) -> SidecarsConfig:
    """The sidecars of an already read `[sidecars]` section (the voice config's, say): one
    table per sidecar, each over its kind's defaults; ConfigError naming a bad key."""
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"sidecars.{name} must be a table")
    specs = [_spec(name, table) for name, table in tables.items()]
    return SidecarsConfig(tuple(spec for spec in specs if spec is not None))


def read_section(path: Path) -> dict[str, Any]:
    """The file's `sidecars` table (TOML or JSON, read as every noesis config file is)."""
    from noesis.options import read_config_file

    raw = read_config_file(path)
    if not isinstance(raw.get("sidecars"), dict):
        raise ConfigError(f"sidecar config {path} has no [sidecars] section")
    return raw["sidecars"]


def _spec(name: str, table: dict[str, Any]) -> SidecarSpec | None:
    """The sidecar a table configures (None when disabled), or a ConfigError naming its key."""
    kind = table.get("kind", name)
    if kind not in DEFAULTS:
        raise ConfigError(f"sidecars.{name}: unknown kind {kind!r} (known: {sorted(DEFAULTS)})")
    unknown = sorted(set(table) - set(COMMON))
    if unknown:
        raise ConfigError(f"sidecars.{name}: unknown keys {unknown} (known: {sorted(COMMON)})")
    options = {**COMMON, **DEFAULTS[kind], **table}
    if not options["enabled"]:
        return None
    if options["policy"] not in POLICIES:
        raise ConfigError(f"sidecars.{name}.policy must be one of {POLICIES}, got "
                          f"{options['policy']!r}")
    threshold = options["threshold"]
    if threshold is not None and (isinstance(threshold, bool)
                                  or not isinstance(threshold, (int, float))
                                  or not 0 < threshold <= 1):
        raise ConfigError(f"sidecars.{name}.threshold must be in (0, 1], got {threshold!r}")
    try:
        cadence = Cadence(options["cadence"], options["every"])
        placement = Placement(options["device"], options["workers"], options["queue_size"],
                              options["batch"])
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"sidecars.{name}: {exc}") from exc
    return SidecarSpec(name, kind, _model_dir(name, options["model"]), cadence, placement,
                       options["policy"], None if threshold is None else float(threshold))


def _model_dir(name: str, model: object) -> str:
    """A directory, or a bundled model's name (noesis-safety) made its directory."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"sidecars.{name}.model must be a directory or a bundled model name")
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    from noesis.weights.hub import bundled_models

    bundled = bundled_models().get(model)
    if bundled is None:
        raise ConfigError(f"sidecars.{name}.model: {model!r} is neither a directory nor a bundled "
                          f"model ({', '.join(bundled_models()) or 'none here'})")
    return str(bundled)


def _build(spec: SidecarSpec):
    from noesis.sidecars.contradiction import ContradictionSidecar
    from noesis.sidecars.intent import IntentSidecar
    from noesis.sidecars.safety import SafetySidecar

    builders = {"safety": SafetySidecar.load, "intent": IntentSidecar.load,
                "contradiction": ContradictionSidecar.load}
    sidecar = builders[spec.kind](spec.model, threshold=spec.threshold, policy=spec.policy,
                                  cadence=spec.cadence, placement=spec.placement)
    sidecar.name = spec.name
    return sidecar
