"""Optional dependency groups (pyproject's extras): a missing one is an error naming the extra to
install, not an ImportError from deep inside a module."""

from __future__ import annotations

import importlib.util

from noesis.errors import NoesisError


class MissingExtra(NoesisError, ImportError):
    """A feature's optional dependencies are not installed."""


def require(extra: str, modules: tuple[str, ...], feature: str) -> None:
    """Raise MissingExtra unless every module in `modules` can be imported."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(f"{feature} needs {', '.join(missing)}, which this install lacks: "
                           f"pip install 'noesis[{extra}]'")


SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")
