"""Options declared once on dataclass fields: their range check, command-line flag and config-file
key all come from the field's `option(...)` metadata, so defaults and help text have one home.

Torch-free: `noesis --help` builds every flag from here without loading torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from noesis.errors import ConfigError, check_count

INT_MAX = 2**63 - 1  # sizes end up in int64 tensors


def option(help: str, *, lo: float | None = None, hi: float | None = None,
           choices: tuple[str, ...] | None = None, flag: str | None = None,
           metavar: str | None = None) -> dict[str, Any]:
    """Field metadata making a config field an option: `lo`/`hi` bound an int to [lo, hi] and a
    float to (lo, hi]; `choices` list a string's values (each item's, for a tuple of strings:
    a comma-separated flag); `flag` renames its flag (default: the field name with dashes)."""
    return {"help": help, "lo": lo, "hi": hi, "choices": choices, "flag": flag,
            "metavar": metavar}


def options_of(cls) -> list[dataclasses.Field]:
    """The fields of a config dataclass declared with `option(...)`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def check_options(config) -> None:
    """Check every option field of a config instance against its declared type and range:
    a ConfigError naming the first bad field (called from __post_init__)."""
    for f in options_of(type(config)):
        _check(f, getattr(config, f.name))


def flag_name(f: dataclasses.Field) -> str:
    return "--" + (f.metadata["flag"] or f.name.replace("_", "-"))


def add_option_flags(parser, cls, defaults: dict[str, Any] | None = None,
                     skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> None:
    """One flag per option field of `cls` (bool fields get --x/--no-x), or of those in `only`,
    less `skip`. `defaults` replaces a field's default for this command only; the help text
    states the default in effect."""
    defaults = defaults or {}
    added = [f for f in options_of(cls)
             if f.name not in skip and (only is None or f.name in only)]
    parser.set_defaults(**{_added_key(cls): tuple(f.name for f in added)})
    for f in added:
        default = defaults.get(f.name, _default(f))
        shown = "" if default is None or "default" in f.metadata["help"] else \
            f" (default: {_show(default)})"
        # argparse formats help with %: a literal one in the text is written %%.
        text = (f.metadata["help"] + shown).replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
        if _kind(f) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _argument_type(f)
            kwargs["metavar"] = f.metadata["metavar"] or (
                "{" + ",".join(f.metadata["choices"]) + "}" if f.metadata["choices"] else None)
        parser.add_argument(flag_name(f), **kwargs)


def given_options(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values of the option flags of `cls` that the command added (add_option_flags),
    less `skip`."""
    return {name: getattr(args, name) for name in getattr(args, _added_key(cls), ())
            if name not in skip}


def _added_key(cls) -> str:
    return f"_{cls.__name__}_flags"


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: list[str], values: dict[str, Any]) -> None:
    """Set the parsed `args` from a config file's table, except where `argv` (the command's own
    arguments) gave the flag: the command line wins. Keys are the flags' names with underscores
    (or dashes); an unknown key, or a value the flag would refuse, is a ConfigError naming it."""
    actions = {}
    for action in parser._actions:  # argparse has no public listing of a parser's flags
        if action.option_strings and action.dest not in ("help", "config"):
            actions[action.dest] = action
            for name in action.option_strings:
                actions.setdefault(name.lstrip("-").replace("-", "_"), action)
    unknown = sorted(key for key in values if key.replace("-", "_") not in actions)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; the keys are the command's flags "
                          "with underscores (see --help)")
    given = _explicit_dests(parser, argv)
    for key, value in values.items():
        action = actions[key.replace("-", "_")]
        if action.dest not in given:
            setattr(args, action.dest, _file_value(action, key, value))


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags written in argv: parsed again with every default suppressed, only
    they appear in the namespace."""
    saved = [(action, action.default) for action in parser._actions]
    for action, _ in saved:
        action.default = argparse.SUPPRESS
    try:
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def _file_value(action: argparse.Action, key: str, value: Any) -> Any:
    """A config file's value checked as the flag's text would be."""
    takes_text = action.nargs != 0  # not a switch (store_true and friends)
    if isinstance(action, argparse.BooleanOptionalAction) or not takes_text:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_file_scalar(action, key, item) for item in items]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        value = ",".join(value)  # a comma-separated flag (--cors-origins) as a list
    return _file_scalar(action, key, value)


def _file_scalar(action: argparse.Action, key: str, value: Any) -> Any:
    if isinstance(value, (dict, list, bool)) or value is None:
        raise ConfigError(f"config key {key!r} takes a single value, got {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"config key {key!r}: {exc}") from None
    elif not isinstance(value, str):
        raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"config key {key!r} must be one of {list(action.choices)}, got "
                          f"{value!r}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A .toml or .json file holding one table of options (the format the voice config uses)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            import tomllib  # Python 3.11+

            value = tomllib.loads(text)
        elif path.suffix == ".json":
            value = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: use a .toml or .json file")
    except ImportError as exc:
        raise ConfigError("TOML config files need Python 3.11+; use a .json file") from exc
    except ValueError as exc:  # json and tomllib decode errors are ValueErrors
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"config file {path} must hold a table of options")
    return value


def _kind(f: dataclasses.Field) -> type:
    """The option's type, read from its annotation ("int | None" -> int); tuple: a tuple of
    strings ("tuple[str, ...]")."""
    names = str(f.type).replace(" ", "").split("|")
    if "tuple[str,...]" in names:
        return tuple
    for kind in (bool, int, float, str):
        if kind.__name__ in names:
            return kind
    raise TypeError(f"option {f.name} has type {f.type}: options are bool, int, float, str or "
                    "tuple[str, ...]")


def _nullable(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return "on" if value is True else "off" if value is False else str(value)


def _check(f: dataclasses.Field, value: Any) -> None:
    if value is None and _nullable(f):
        return
    kind, meta = _kind(f), f.metadata
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{f.name} must be true or false, got {value!r}")
    elif kind is int:
        lo = int(meta["lo"]) if meta["lo"] is not None else -INT_MAX - 1
        check_count(f.name, value, lo, int(meta["hi"]) if meta["hi"] is not None else INT_MAX)
    elif kind is float:
        _check_number(f, value)
    elif kind is tuple:
        _check_strings(f, value)
    elif not isinstance(value, str) or (meta["choices"] and value not in meta["choices"]):
        wanted = f"one of {', '.join(meta['choices'])}" if meta["choices"] else "a string"
        raise ConfigError(f"{f.name} must be {wanted}, got {value!r}")


def _check_number(f: dataclasses.Field, value: Any) -> None:
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or (lo is not None and value <= lo) or \
            (hi is not None and value > hi):
        bounds = f"({lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{f.name} must be a number in {bounds}, got {value!r}")


def _check_strings(f: dataclasses.Field, value: Any) -> None:
    """A non-empty tuple of distinct strings, each one of the choices when they are declared."""
    choices = f.metadata["choices"]
    wanted = f"one or more of {', '.join(choices)}" if choices else "one or more strings"
    items = value if isinstance(value, tuple) else ()
    bad = [item for item in items if not isinstance(item, str) or (choices and item not in choices)]
    if not items or bad or len(set(items)) != len(items):
        raise ConfigError(f"{f.name} must be {wanted} (no repeats), got {value!r}")


def _argument_type(f: dataclasses.Field):
    """An argparse type converting the text and applying the field's own check, so that a bad
    value is a usage error naming the flag (exit 2) before anything loads."""
    kind = _kind(f)

    def parse(text: str) -> Any:
        try:
            value = tuple(text.split(",")) if kind is tuple else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind.__name__}: {text[:40]!r}") from None
        try:
            _check(f, value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse
