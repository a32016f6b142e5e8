"""The compiled CPU kernel for packed ternary projections: build once with gcc, call via ctypes.

`csrc/bitlinear.c` is compiled into a per-source, per-ISA, per-CPU cache directory on first use
(about a second), then loaded with ctypes. It links the OpenMP runtime that PyTorch already loaded,
so it runs on PyTorch's threads: `torch.get_num_threads()` bounds it like any torch operator.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from noesis.errors import NoesisError
from noesis.ternary.quant import check_packed

SOURCE = Path(__file__).parent / "csrc" / "bitlinear.c"
# Instruction sets to build for: "native" is this CPU's best (AVX-512 VNNI, else AVX2); the
# others exist so that tests can check the narrower code paths on a wide CPU.
ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-march=haswell"],
    "scalar": ["-march=x86-64"],
}
CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-D_ISOC11_SOURCE"]


class KernelUnavailable(NoesisError, RuntimeError):
    """The ternary CPU kernel cannot be built here (no C compiler, or the build failed)."""


def ternary_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    isa: str = "native",
) -> torch.Tensor:
    """y [M, N] float32 = quantized x [M, K] times the packed ternary W [N, K], scaled per row."""
    check_packed(packed, packed.shape[0], in_features)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}], got {list(x.shape)}")
    if scale.shape != (packed.shape[0],):
        raise ValueError(f"scale must be [{packed.shape[0]}], got {list(scale.shape)}")
    if x.device.type != "cpu" or packed.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError("the ternary kernel runs on CPU tensors only")
    return run(library(isa), x, packed.contiguous(), scale.contiguous(), in_features)


def run(
    lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The kernel call without checks, for callers that validated packed and scale once:
    packed contiguous uint8 [N, ceil(K / 4)], scale contiguous [N], x [M, K] on CPU."""
    if scale.dtype != torch.float32:
        scale = scale.float()
    if x.dtype != torch.float32 or not x.is_contiguous():  # checks cost less than no-op calls
        x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    status = lib.bitlinear_forward(
        x.data_ptr(), x.shape[0], in_features, packed.data_ptr(), packed.shape[0],
        scale.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("ternary kernel could not allocate its activation workspace")
    return y


def kernel_isa(isa: str = "native") -> str:
    """The code path the build for `isa` took: avx512-vnni, avx2 or scalar."""
    return library(isa).bitlinear_isa().decode()


@functools.cache
def library(isa: str = "native") -> ctypes.CDLL:
    """The built kernel for `isa`, compiled on first use and cached on disk."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown isa {isa!r}; choose from {sorted(ISA_FLAGS)}")
    path = _build(isa)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.bitlinear_forward.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.bitlinear_forward.restype = ctypes.c_int
    lib.bitlinear_isa.restype = ctypes.c_char_p
    return lib


def _build(isa: str) -> Path:
    compiler = _compiler()
    flags = [*CFLAGS, *ISA_FLAGS[isa]]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags]).encode() + _cpu_signature()
    ).hexdigest()[:16]
    target = _cache_dir() / f"bitlinear-{isa}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(
            f"cannot create the kernel cache {target.parent} (set NOESIS_CACHE_DIR): {exc}"
        ) from exc
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(
                f"building the ternary CPU kernel failed ({' '.join(command)}):\n{result.stderr}"
            )
        os.replace(built, target)  # atomic: a concurrent build never sees half a file
    return target


def _compiler() -> str:
    named = os.environ.get("CC")
    compiler = shutil.which(named) if named else shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        wanted = f"$CC={named!r} is not an executable" if named else "no gcc or cc on PATH"
        raise KernelUnavailable(f"the ternary CPU kernel needs a C compiler: {wanted}")
    return compiler


def _cache_dir() -> Path:
    if os.environ.get("NOESIS_CACHE_DIR"):
        return Path(os.environ["NOESIS_CACHE_DIR"]) / "ternary"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "noesis" / "ternary"


def _cpu_signature() -> bytes:
    """-march=native output differs per CPU: key the cache on the CPU's flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return flags.encode()
