"""The dequantizing Triton kernels compiled for an H100/H200 (sm_90) on this CPU machine, as
noesis.quant.kernel launches them on 8B shapes in bf16: decode (one row on the CUDA cores, 16
rows through tl.dot, a split over K) and prefill, ordered groups and act-order, int4 and int8.
They must compile and assemble without register spills.

The interpreter (test_quant_linear.py) accepts code the compiler rejects; the compiles run in a
child process, started when the tests are collected (see test_kernels_compile.py, whose
compile_launch this reuses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
# (rows, N, K, bits, group size, act-order, decode config or None for the default)
LAUNCHES = {
    "decode int4 g128": (1, 4096, 4096, 4, 128, False, None),
    "decode int4 g128 wide tile": (1, 28672, 4096, 4, 128, False, (32, 256, 0, 8, 3, False)),
    "decode int4 one row dot": (1, 6144, 4096, 4, 128, False, (64, 128, 0, 4, 3, True)),
    "decode int4 act-order": (8, 6144, 4096, 4, 128, True, None),
    "decode int8 per channel": (1, 4096, 14336, 8, -1, False, None),
    "decode int8 split": (16, 4096, 14336, 8, -1, False, (32, 128, 4, 4, 3, True)),
    "prefill int4 g128": (300, 4096, 4096, 4, 128, False, None),
}
# The int4 fragment kernels (quant/int4_fragments.py): the GEMV's inline mma.sync (1 row) and
# the tl.dot matmul (more): (rows, N, K, group, dtype)
FRAGMENT_LAUNCHES = {
    "decode int4 fragments bf16 g128": (1, 14336 * 2, 4096, 128, "bfloat16"),
    "decode int4 fragments f16 g64": (1, 4096, 14336, 64, "float16"),
    "8 rows int4 fragments bf16 g128": (8, 6144, 4096, 128, "bfloat16"),
    "64 rows int4 fragments f16 g64, two tiles a warp": (64, 4096, 14336, 64, "float16"),
    "prefill int4 fragments bf16 g128": (300, 4096, 4096, 128, "bfloat16"),
    "int4 fragments dequantized, bf16 g128": (0, 28672, 4096, 128, "bfloat16"),
}


def compile_all() -> dict[str, str]:
    import torch
    from test_kernels_compile import compile_launch

    from noesis.quant import kernel
    from noesis.quant.int4_fragments import Int4Fragments

    recorded = []

    class Recorder:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((self.real, args, kwargs))

    for name in ("_packed_gemv", "_packed_gemv_dot", "_packed_matmul", "_int4_frag_gemv",
                 "_int4_frag_rows", "_int4_frag_matmul", "_int4_frag_dequantize"):
        setattr(kernel, name, Recorder(getattr(kernel, name)))
    bf16 = torch.bfloat16
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (m, n, k, bits, group, act_order, config) in LAUNCHES.items():
            groups = 1 if group == -1 else k // group
            recorded.clear()
            kernel.packed_matmul(
                torch.zeros(m, k, dtype=bf16), torch.zeros(n, k * bits // 32, dtype=torch.int32),
                torch.zeros(n, groups, dtype=bf16), torch.zeros(n, groups, dtype=bf16),
                torch.zeros(k, dtype=torch.int32) if act_order else None, bits,
                k if group == -1 else group,
                config=config and kernel.GemvConfig(*config),
            )
            (launch,) = recorded
            reports[name] = compile_launch(*launch, Path(tmp))["ptxas"]
        for name, (m, n, k, group, dtype) in FRAGMENT_LAUNCHES.items():
            recorded.clear()
            frags = Int4Fragments(torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32),
                                  torch.zeros(n // 16, k // group, 8, 2, dtype=torch.int32),
                                  n, k, group, getattr(torch, dtype))
            x = torch.zeros(m, k, dtype=frags.dtype)
            if m == 0:
                kernel.fragment_dequantize(frags, frags.dtype)
            elif m == 1:
                kernel.fragment_gemv(x, frags)
            elif m <= kernel.FRAG_ROWS_MAX:
                kernel.fragment_rows(x, frags, (1, 4, 1, 2) if m > 8 else None)
            else:
                kernel.fragment_matmul(x, frags)
            (launch,) = recorded
            if "NO_ASM" in launch[2]:
                launch[2]["NO_ASM"] = False  # the assembly, as on an sm_80-or-later GPU
            reports[name] = compile_launch(*launch, Path(tmp))["ptxas"]
    return reports


_child: tuple[subprocess.Popen, str] | None = None


def start_in_background() -> subprocess.Popen | None:
    global _child
    if _child is None and PTXAS.exists():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cache = tempfile.mkdtemp(prefix="triton-cache-")
        env["TRITON_CACHE_DIR"] = cache
        process = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        _child = (process, cache)
    return _child[0] if _child else None


def test_packed_matmul_compiles_for_sm90_without_spills():
    if not PTXAS.exists():
        pytest.skip("this triton wheel has no ptxas")
    process = start_in_background()
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        shutil.rmtree(_child[1], ignore_errors=True)
    assert process.returncode == 0, stderr[-3000:]
    reports = json.loads(stdout)
    assert set(reports) == set(LAUNCHES) | set(FRAGMENT_LAUNCHES)
    for name, ptxas in reports.items():
        assert "Used" in ptxas and "spill" in ptxas, name
        assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, f"{name}: {ptxas}"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
