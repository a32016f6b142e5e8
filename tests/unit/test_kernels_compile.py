"""The one-row Triton kernels compiled for an H100/H200 (sm_90) on this CPU machine: Triton's
interpreter (test_kernels.py) runs Python semantics and accepts code the compiler rejects (a
kernel reading a non-constexpr global, for one), so each mode is also lowered to PTX and
assembled with the ptxas that ships in the triton wheel. It must not spill registers, and must
read the weights in 16-byte loads (given 16-byte aligned pointers, as the JIT specializes them).

The compiles run in a child process: once the interpreter has run a kernel in a process, it
leaves triton.language patched for itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

POINTERS = {"x_ptr": "*bf16", "norm_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
            "res_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64",
            "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
SCALARS = {"N": "i32", "eps": "fp32", "stride_slot": "i32", "stride_cache_head": "i32"}
BLOCKS = dict(PAIR=0, HEAD_DIM=0, NUM_HEADS=0, NUM_KV_HEADS=0)
PLAIN, GLU, QKV = 0, 1, 2  # triton_kernels' modes (checked in the child)
CASES = {
    "qkv, Llama-3.1-8B heads": (dict(MODE=QKV, NORM=True, RESIDUAL=False, K=4096, PAIR=64,
                                     HEAD_DIM=128, NUM_HEADS=32, NUM_KV_HEADS=8), "bf16"),
    "o with the residual": (dict(MODE=PLAIN, NORM=False, RESIDUAL=True, K=4096), "bf16"),
    "gate_up": (dict(MODE=GLU, NORM=True, RESIDUAL=False, K=2048, PAIR=8192), "bf16"),
    "down, K not a tile multiple": (dict(MODE=PLAIN, NORM=False, RESIDUAL=True, K=14000),
                                    "bf16"),
    "norm + LM head, float32 out": (dict(MODE=PLAIN, NORM=True, RESIDUAL=False, K=2048),
                                    "fp32"),
}


def compile_all() -> dict[str, dict]:
    """In the child: ptxas's report and the PTX's 16-byte loads for each case, under the
    engine's default configs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from noesis.kernels import triton_kernels as tk

    assert (tk.PLAIN, tk.GLU, tk.QKV) == (PLAIN, GLU, QKV)
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (constants, out) in CASES.items():
            rows, block_k, warps, stages = tk.ROW_GEMV_CONFIGS[constants["MODE"]]
            constants = BLOCKS | constants | dict(ROWS=rows, BLOCK_K=block_k)
            signature = POINTERS | SCALARS | {"y_ptr": f"*{out}"}
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(POINTERS))}
            source = ASTSource(tk._row_gemv, signature | dict.fromkeys(constants, "constexpr"),
                               constants, aligned)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(compiled.asm["ptx"])
            done = subprocess.run(
                [PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", Path(tmp) / "kernel.cubin"],
                capture_output=True, text=True, check=True,
            )
            reports[name] = {"ptxas": done.stderr,
                             "v4_loads": len(re.findall(r"ld\.global\S*\.v4\.", ptx.read_text()))}
    return reports


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    if not PTXAS.exists():
        pytest.skip("this triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", list(CASES))
def test_row_gemv_compiles_for_sm90_without_spills(reports, name):
    report = reports[name]["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert registers <= 128, report
    assert spills is None or spills.group(1) == "0", report
    # rows x K tile of bf16 weights over warps x 32 threads, 8 per 16-byte load (QKV and GLU
    # read two such tiles)
    mode = CASES[name][0]["MODE"]
    assert reports[name]["v4_loads"] >= (2 if mode == PLAIN else 4)


if __name__ == "__main__":
    print(json.dumps(compile_all()))
