"""Every Triton kernel, compiled for an H100/H200 (sm_90) on this CPU machine as the wrappers in
the kernel modules (KERNEL_MODULES) launch it on the decode path.

Triton's interpreter (test_kernels.py) runs Python semantics and accepts code the compiler
rejects (a kernel reading a non-constexpr global, for one). Here each launch is intercepted,
its arguments turned into the signature the JIT would build (tensors 16-byte aligned, as the
JIT specializes them), lowered to PTX, and assembled with the ptxas that ships in the triton
wheel: it must compile and must not spill registers, the one-row GEMVs must read their
weights in 16-byte loads, and the launches asked for programmatic dependent launch must carry
its griddepcontrol instructions (and no others).

The compiles run in a child process: once the interpreter has run a kernel in a process, it
leaves triton.language patched for itself. The child starts as soon as the session's tests are
collected (tests/conftest.py calls `start_in_background`), on the second core that the tests
before these leave idle; the fixture waits for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


KERNEL_MODULES = (
    "noesis.kernels.paged_decode",
    "noesis.kernels.pointwise",
    "noesis.kernels.row_gemv",
    "noesis.kernels.rope",
    "noesis.kernels.bitmask",
    "noesis.sampling.race_kernel",
    "noesis.quant.packed_row",
)


def kernel_modules() -> list:
    import importlib

    return [importlib.import_module(name) for name in KERNEL_MODULES]


def launches() -> dict[str, tuple]:
    """(kernel, args, kwargs) of each wrapper's launches on representative decode shapes (8B
    heads), with CPU tensors: the launches are recorded, not run."""
    import torch
    from triton.runtime.jit import JITFunction

    from noesis.kernels import bitmask, paged_decode, pdl, pointwise, rope, row_gemv
    from noesis.quant import packed_row
    from noesis.sampling import race_kernel

    recorded: list[tuple] = []
    pdl_off = pdl.pdl_launch

    class Recorder:
        def __init__(self, kernel: JITFunction) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((self.kernel, args, kwargs))

    kernels = {
        (module, name): value
        for module in kernel_modules()
        for name, value in vars(module).items()
        if isinstance(value, JITFunction)
    }
    for (module, name), kernel in kernels.items():
        setattr(module, name, Recorder(kernel))
    bf16 = dict(dtype=torch.bfloat16)
    hidden, heads, kv_heads, head_dim = 4096, 32, 8, 128
    kv = torch.zeros(2, 64, 16, kv_heads, head_dim, **bf16)
    fp8_kv = torch.zeros(2, 64, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    kv_scales = torch.ones(2, kv_heads, 1)
    cos, sin = torch.ones(1, head_dim), torch.zeros(1, head_dim)
    x, norm = torch.zeros(1, hidden, **bf16), torch.ones(hidden, **bf16)
    qkv_rows, inter = (heads + 2 * kv_heads) * head_dim, 14336

    def rope_launch(tokens, cache, **options):  # q, k and v of `tokens` rows into `cache`
        return lambda: rope.rope_write_kv(
            torch.zeros(tokens, heads, head_dim, **bf16),
            torch.zeros(tokens, kv_heads, head_dim, **bf16),
            torch.zeros(tokens, kv_heads, head_dim, **bf16),
            torch.ones(tokens, head_dim), torch.zeros(tokens, head_dim),
            torch.zeros(tokens, dtype=torch.int64), cache[0], cache[1], **options,
        )  # fmt: skip

    def packed(n, k, bits, group=128):  # a PackedLinear's tensors: AWQ int4 g128, int8 per row
        groups = 1 if group == -1 else k // group
        return SimpleNamespace(
            qweight=torch.zeros(n, k * bits // 32, dtype=torch.int32),
            scales=torch.zeros(n, groups, **bf16), qzeros=torch.zeros(n, groups, **bf16),
            bits=bits, group_size=k if group == -1 else group,
        )

    def packed_qkv(bits, cache, scales=None):
        return packed_row.norm_qkv_rope_store(
            x, norm, 1e-5, packed(qkv_rows, hidden, bits), heads, kv_heads, cos, sin,
            torch.zeros(1, dtype=torch.int64), cache[0], cache[1], kv_scales=scales)
    calls = {
        "paged decode, batch 1 (two launches)": lambda: paged_decode.paged_decode_attention(
            torch.zeros(1, heads, head_dim, **bf16),
            kv[0],
            kv[1],
            torch.zeros(1, 32, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            0.1,
            512,
        ),
        "paged decode, batch 1, sliding window and sinks": lambda: (
            paged_decode.paged_decode_attention(
                torch.zeros(1, heads, head_dim, **bf16), kv[0], kv[1],
                torch.zeros(1, 32, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0.1,
                512, 128, sinks=torch.zeros(heads))
        ),
        "paged decode, batch 64 (fused merge)": lambda: paged_decode.paged_decode_attention(
            torch.zeros(64, heads, head_dim, **bf16),
            kv[0],
            kv[1],
            torch.zeros(64, 32, dtype=torch.int64),
            torch.ones(64, dtype=torch.int64),
            0.1,
            512,
        ),
        "paged decode, batch 1, fp8 cache": lambda: paged_decode.paged_decode_attention(
            torch.zeros(1, heads, head_dim, **bf16),
            fp8_kv[0],
            fp8_kv[1],
            torch.zeros(1, 32, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            0.1,
            512,
            kv_scales=kv_scales,
        ),
        "add + RMSNorm": lambda: pointwise.add_rms_norm(
            torch.zeros(4, hidden, **bf16), torch.zeros(4, hidden, **bf16), norm, 1e-5
        ),
        "SiLU-mul": lambda: pointwise.silu_mul(torch.zeros(4, 2 * 14336, **bf16)),
        "RoPE + KV write": rope_launch(4, kv),
        "RoPE + q/k norms + KV write (Qwen3)": rope_launch(
            1, kv, qk_norm=(norm[:head_dim], norm[:head_dim], 1e-6)
        ),
        "RoPE + KV write, fp8 cache": rope_launch(4, fp8_kv, kv_scales=kv_scales),
        "exponential race": lambda: race_kernel.exponential_race(
            torch.zeros(2, 128256),
            torch.ones(2),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
        ),
        "greedy argmax": lambda: race_kernel.greedy_argmax(torch.zeros(2, 128256)),
        "exponential race, reporting rows": lambda: race_kernel.exponential_race(
            torch.zeros(2, 128256),
            torch.ones(2),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            report=True,
        ),
        "greedy argmax, reporting rows": lambda: race_kernel.greedy_argmax(
            torch.zeros(2, 128256), report=True
        ),
        "pending tokens": lambda: pointwise.take_pending(
            torch.zeros(8, dtype=torch.int64),
            torch.zeros(8, dtype=torch.int64),
            torch.zeros(8, dtype=torch.int64),
        ),
        "grammar bitmask": lambda: bitmask.apply_token_bitmask_(
            torch.zeros(2, 128256), torch.zeros(2, 4008, dtype=torch.int32)
        ),
        "one-row o_proj + residual": lambda: row_gemv.gemv(
            torch.zeros(1, heads * head_dim, **bf16),
            torch.zeros(hidden, heads * head_dim, **bf16),
            x,
        ),
        "one-row down, K not a tile multiple": lambda: row_gemv.gemv(
            torch.zeros(1, 14000, **bf16), torch.zeros(hidden, 14000, **bf16), x
        ),
        "one-row norm + gate/up + SiLU-mul": lambda: row_gemv.norm_glu(
            x, norm, 1e-5, torch.zeros(2 * 14336, hidden, **bf16)
        ),
        "one-row norm + qkv + RoPE + KV write": lambda: row_gemv.norm_qkv_rope_store(
            x,
            norm,
            1e-5,
            torch.zeros((heads + 2 * kv_heads) * head_dim, hidden, **bf16),
            heads,
            kv_heads,
            cos,
            sin,
            torch.zeros(1, dtype=torch.int64),
            kv[0],
            kv[1],
        ),
        "one-row norm + qkv + RoPE + fp8 KV write": lambda: row_gemv.norm_qkv_rope_store(
            x,
            norm,
            1e-5,
            torch.zeros((heads + 2 * kv_heads) * head_dim, hidden, **bf16),
            heads,
            kv_heads,
            cos,
            sin,
            torch.zeros(1, dtype=torch.int64),
            fp8_kv[0],
            fp8_kv[1],
            kv_scales=kv_scales,
        ),
        "one-row norm + LM head": lambda: row_gemv.norm_logits(
            x, norm, 1e-5, torch.zeros(128256, hidden, **bf16)
        ),
        # Qwen2's q/k/v biases
        "one-row norm + qkv + bias + RoPE + KV write": lambda: row_gemv.norm_qkv_rope_store(
            x, norm, 1e-5, torch.zeros(qkv_rows, hidden, **bf16), heads, kv_heads, cos, sin,
            torch.zeros(1, dtype=torch.int64), kv[0], kv[1], bias=torch.zeros(qkv_rows, **bf16),
        ),
        # gpt-oss-20b's router: the norm stored for the experts, a bias, logits in bf16
        "one-row norm + MoE router + bias": lambda: row_gemv.norm_logits(
            torch.zeros(1, 2880, **bf16), torch.ones(2880, **bf16), 1e-5,
            torch.zeros(32, 2880, **bf16), bias=torch.zeros(32, **bf16),
            normed=torch.zeros(1, 2880, **bf16), dtype=torch.bfloat16,
        ),
        # the packed block at the configs an H100 picks (down: gemv_configs.json's)
        "packed one-row o_proj + residual, int4": lambda: packed_row.gemv(
            torch.zeros(1, heads * head_dim, **bf16), packed(hidden, heads * head_dim, 4), x
        ),
        "packed one-row down + residual, int4": lambda: packed_row.gemv(
            torch.zeros(1, inter, **bf16), packed(hidden, inter, 4), x, config=(64, 256, 4, 3)
        ),
        "packed one-row down + residual, int8 per channel": lambda: packed_row.gemv(
            torch.zeros(1, inter, **bf16), packed(hidden, inter, 8, -1), x
        ),
        "packed one-row norm + gate/up + SiLU-mul, int4": lambda: packed_row.norm_glu(
            x, norm, 1e-5, packed(2 * inter, hidden, 4)
        ),
        "packed one-row norm + gate/up + SiLU-mul, int8 per channel": lambda: packed_row.norm_glu(
            x, norm, 1e-5, packed(2 * inter, hidden, 8, -1)
        ),
        "packed one-row norm + qkv + RoPE + KV write, int4": lambda: packed_qkv(4, kv),
        "packed one-row norm + qkv + RoPE + fp8 KV write, int4": lambda: packed_qkv(
            4, fp8_kv, kv_scales
        ),
    }
    pdl_launches = (
        "paged decode, batch 1 (two launches)",
        "paged decode, batch 64 (fused merge)",
        "one-row norm + qkv + RoPE + KV write",
        "one-row o_proj + residual",
        "packed one-row norm + qkv + RoPE + KV write, int4",
        "packed one-row o_proj + residual, int4",
    )

    def pdl_on(x):
        return {"PDL": True, "launch_pdl": True}

    found = {}
    try:
        for name, call in [*calls.items(), *((f"{n} with PDL", calls[n]) for n in pdl_launches)]:
            pdl.pdl_launch = pdl_on if "PDL" in name else pdl_off
            recorded.clear()
            call()
            for i, (kernel, args, kwargs) in enumerate(recorded):
                if "ASM" in kwargs:  # inline PTX, as on a GPU (CPU tensors record it off)
                    kwargs["ASM"] = True
                found[name if len(recorded) == 1 else f"{name} [{i}]"] = (kernel, args, kwargs)
    finally:  # kernels calling helpers (_mix32) find them in the module when compiled
        for (module, name), kernel in kernels.items():
            setattr(module, name, kernel)
        pdl.pdl_launch = pdl_off
    return found


TYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.uint8": "u8",
    "torch.bool": "i1",
    "torch.float8_e4m3fn": "fp8e4nv",
}


def compile_launch(kernel, args, kwargs, tmp: Path) -> dict:
    """The signature the JIT would build for this launch, compiled for sm_90 and assembled."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    bound = dict(zip(kernel.arg_names[: len(args)], args, strict=True)) | kwargs
    signature, constants, aligned = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[str(value.dtype)]
            aligned[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{param.name}: unexpected argument {value!r}")
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and value and param.name not in kernel.do_not_specialize:
                aligned[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = tmp / f"{kernel.__name__}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    done = subprocess.run(
        [PTXAS, "-v", "--gpu-name=sm_90a", ptx, "-o", tmp / "kernel.cubin"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = ptx.read_text()
    return {
        "kernel": kernel.__name__,
        "ptxas": done.stderr,
        "v4_loads": len(re.findall(r"ld\.global\S*\.v4\.", text)),
        # 16-byte copies into shared memory (a software-pipelined loop's loads)
        "async_16_byte": len(re.findall(r"cp\.async\S*\s+\[[^]]+\],\s*\[[^]]+\],\s*0x10\b", text)),
        "pdl": "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text,
    }


def compile_all() -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return {name: compile_launch(*launch, Path(tmp)) for name, launch in launches().items()}


_child: tuple[subprocess.Popen, str] | None = None


def start_in_background() -> subprocess.Popen | None:
    """Start the child that compiles every launch (this file run as a script), once."""
    global _child
    if _child is None and PTXAS.exists():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cache = tempfile.mkdtemp(prefix="triton-cache-")  # compile afresh
        env["TRITON_CACHE_DIR"] = cache
        process = subprocess.Popen(
            [sys.executable, __file__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        _child = (process, cache)
    return _child[0] if _child else None


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    if not PTXAS.exists():
        pytest.skip("this triton wheel has no ptxas")
    process = start_in_background()  # already running, unless not collected or under xdist
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        shutil.rmtree(_child[1], ignore_errors=True)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


def test_every_kernel_compiles_for_sm90_without_spills(reports):
    kernels = {
        name
        for module in kernel_modules()
        for name, value in vars(module).items()
        if hasattr(value, "arg_names")
    }
    helpers = {  # called inside kernels, compiled with them
        "_mix32", "_x_tile", "quantize_e4m3", "_program_rows", "_rstd", "_row_epilogue",
        "_packed_tile", "_word_dots", "_zero_point", "_pair_dots", "_pairs_of_floats",
        "_pairs_of_words", "_x_operand", "_dots", "_first_split",
    }
    assert {report["kernel"] for report in reports.values()} == kernels - helpers  # all of them
    for name, report in reports.items():
        ptxas = report["ptxas"]
        assert re.search(r"Used \d+ registers", ptxas), (name, ptxas)
        spills = re.search(r"(\d+) bytes spill stores", ptxas)
        assert spills is None or spills.group(1) == "0", (name, ptxas)


def test_programmatic_dependent_launch_compiles_in_where_asked(reports):
    with_pdl = {name for name in reports if "with PDL" in name}
    assert len(with_pdl) == 7  # paged decode in two launches and in one, four projections
    for name, report in reports.items():
        assert report["pdl"] == (name in with_pdl), name


def test_one_row_gemvs_read_weights_in_16_byte_loads(reports):
    rows = {name: r for name, r in reports.items() if name.startswith("one-row")}
    assert len(rows) == 10
    for name, report in rows.items():
        # each weight tile (two in the paired modes) in one or more 16-byte loads per thread;
        # scalar loads would leave none
        paired = "qkv" in name or "gate" in name
        assert report["v4_loads"] >= (2 if paired else 1), (name, report["v4_loads"])


def test_packed_one_row_blocks_read_words_in_16_byte_loads(reports):
    """The packed kernels' words stream through cp.async (their loops are pipelined): 16 bytes a
    copy, the pair's rows too in the paired modes."""
    rows = {name: r for name, r in reports.items() if name.startswith("packed one-row")}
    assert len(rows) == 9
    for name, report in rows.items():
        paired = "qkv" in name or "gate" in name
        assert report["async_16_byte"] >= (2 if paired else 1), (name, report)


if __name__ == "__main__":
    print(json.dumps(compile_all()))
