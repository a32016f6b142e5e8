"""EngineConfig: every engine option, checked when built (before any weight is read), with the
help text and range its command-line flag and config-file key are made from (noesis.options).

Torch-free, so the CLI can build its flags without loading torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from noesis.errors import ConfigError
from noesis.models.capabilities import CAPABILITY_NAMES
from noesis.options import INT_MAX, check_options, option

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy
    from noesis.sidecars.config import SidecarsConfig
    from noesis.speculative.config import SpeculativeConfig

DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")

# Defaults that depend on the device, resolved once it is known (EngineConfig.for_device).
# CPU (and MPS): small batches; a CPU step is compute-bound long before 64 rows. CUDA: decode is
# memory-bound, so wider batches are nearly free per token: 256 rows let a batch of 128 (or 256)
# prompts run as one wave, and an 8192-token step prefills several prompts at once (the KV
# budget still caps what is admitted).
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 64, 2048
CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS = 256, 8192
GGUF_WEIGHTS = ("auto", "packed", "dequantized")  # noesis.weights.gguf.keeps_packed
CONTROL_NAMES = ("default", "none")  # noesis.control.POLICIES, named without importing torch


@dataclass(frozen=True)
class EngineConfig:
    device: str = field(default="auto", metadata=option("auto, cpu, cuda, cuda:N or mps"))
    dtype: str = field(default="auto", metadata=option(
        "weights and activations: auto (the checkpoint's; float32 on CPU), float32, bfloat16 "
        "or float16", choices=DTYPE_NAMES))
    max_model_len: int | None = field(default=None, metadata=option(
        "context length in tokens (default: the model's)", lo=2, hi=INT_MAX))
    page_size: int = field(default=16, metadata=option("tokens per KV page", lo=1, hi=INT_MAX))
    max_num_seqs: int | None = field(default=None, metadata=option(
        f"running batch size (default: {CUDA_MAX_NUM_SEQS} on CUDA, {CPU_MAX_NUM_SEQS} "
        "elsewhere)", lo=1, hi=INT_MAX))
    max_num_batched_tokens: int | None = field(default=None, metadata=option(
        f"tokens per step, also the prefill chunk (default: {CUDA_MAX_NUM_BATCHED_TOKENS} on "
        f"CUDA, {CPU_MAX_NUM_BATCHED_TOKENS} elsewhere)", lo=1, hi=INT_MAX))
    kv_cache_memory: int | None = field(default=None, metadata=option(
        "bytes for the KV pool (default: 1 GiB on CPU; on CUDA what --gpu-memory-utilization "
        "leaves after the weights and activations)", lo=1, hi=INT_MAX, metavar="BYTES"))
    kv_cache_dtype: str = field(default="auto", metadata=option(
        "KV cache elements: auto (the model's dtype) or fp8 (e4m3 with per-head scales fixed "
        "at load: half of bf16's bytes per token)", choices=("auto", "fp8")))
    gguf_weights: str = field(default="auto", metadata=option(
        "GGUF files: keep the block-quantized projections packed (dequantized inside the "
        "matmul: 28-63% of bf16's bytes, by type) or dequantize them at load; auto: packed on "
        "CUDA, dequantized elsewhere (a CPU forward would dequantize every weight again)",
        choices=GGUF_WEIGHTS))
    gpu_memory_utilization: float = field(default=0.9, metadata=option(
        "CUDA: share of the device's memory noesis may fill, in (0, 1]", lo=0.0, hi=1.0))
    cuda_graphs: bool = field(default=True, metadata=option(
        "CUDA: capture decode steps as graphs at load (--no-cuda-graphs: eager steps)"))
    max_graph_batch: int | None = field(default=None, metadata=option(
        "largest captured batch (default: min(max_num_seqs x rows per sequence, 128))",
        lo=1, hi=INT_MAX))
    seed: int = field(default=0, metadata=option(
        "seeds the per-request seeds of requests that bring none", lo=0, hi=INT_MAX))
    enable_prefix_caching: bool = field(default=False, metadata=option(
        "reuse KV pages of shared full-page prompt prefixes across requests",
        flag="prefix-caching"))
    # Steps whose sequences need their last token on the host (grammars, penalties) wait.
    overlap_steps: bool | None = field(default=None, metadata=option(
        "plan and launch the next step while the device runs this one (default: on CUDA, off "
        "elsewhere); --no-overlap-steps reads every step back first"))
    revision: str | None = field(default=None, metadata=option(
        "Hugging Face repos: the branch, tag or commit to load (default: main)"))
    # What to load of a checkpoint that can do more than text (noesis.models.capabilities);
    # checked against the checkpoint's own once its config.json is read.
    capabilities: tuple[str, ...] = field(default=("text",), metadata=option(
        "what to load, comma-separated: text (a vision-language checkpoint's text model alone, "
        "its vision weights never read; noesis has no vision or audio encoder yet)",
        choices=CAPABILITY_NAMES, metavar="NAMES"))
    # Process-wide kernel switches, applied when an engine is built on CUDA (the last engine
    # built sets them for the process); benchmarks flip the module flags directly.
    triton_kernels: bool = field(default=True, metadata=option(
        "CUDA: the fused Triton kernels (--no-triton-kernels: the PyTorch reference ops)"))
    one_row_fusion: bool = field(default=True, metadata=option(
        "CUDA: batch-1 decode runs each decoder block as fused one-row Triton projections"))
    pdl: bool = field(default=True, metadata=option(
        "CUDA sm_90+: programmatic dependent launch between the one-row kernels"))
    # Tensor parallelism (noesis.distributed): the model split over this many ranks, each on
    # its own device (rank r on cuda:r), spawned by the engine or started by torchrun.
    tensor_parallel_size: int = field(default=1, metadata=option(
        "split the model over this many ranks (GPUs; gloo processes on CPU), spawned here or "
        "started by torchrun", lo=1, hi=1024))
    progress: bool = True
    # Speculative decoding (noesis.speculative): a draft model or prompt lookup proposes tokens
    # that one target forward verifies; greedy output is unchanged, sampled output keeps the
    # target's distribution. None: off.
    speculative: SpeculativeConfig | None = None
    # Telemetry (noesis.telemetry): True collects per-step and per-request records in memory
    # (RequestOutput.metrics, the server's histograms); a path also writes them as JSON lines.
    telemetry: bool | str = False
    # Deterministic replay: record a trace at `trace` (model hashes, seeds, every step's batch
    # and tokens) that `noesis replay` reproduces token for token. A trace implies it.
    deterministic: bool = False
    trace: str | None = None
    # noesis.runner.batch_invariant: fixed reduction orders, so a request's tokens do not
    # depend on its batch (a trace recorded in a busy batch replays one request alone).
    batch_invariant: bool = field(default=False, metadata=option(
        "batch-invariant kernels: a request's tokens and logits do not depend on what shares its "
        "batch, its prefill chunks or preemption (slower; CUDA: Triton kernels, CPU: one token "
        "at a time)"))
    # The control plane (noesis.control): "default" or a ControlPolicy moves each sampled
    # request's temperature and top_p token by token from its uncertainty (a request opts out
    # with SamplingParams(control=False)); "none" or None: off.
    control: str | ControlPolicy | None = None
    # Side models (noesis.sidecars): a SidecarsConfig the engine builds its SidecarRuntime from,
    # in its own process (the server's safety sidecar is one); None: none.
    sidecars: SidecarsConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.capabilities, (list, str)):  # ["text"], or "text,vision" as the flag
            names = self.capabilities.split(",") if isinstance(self.capabilities, str) \
                else self.capabilities
            object.__setattr__(self, "capabilities", tuple(names))
        check_options(self)
        if "text" not in self.capabilities:
            raise ConfigError(f"capabilities must include text (noesis generates text), got "
                              f"{self.capabilities!r}")
        _check_control(self.control)
        if not DEVICE_PATTERN.fullmatch(str(self.device)):
            raise ConfigError(f"unknown device {self.device!r} (use auto, cpu, cuda, cuda:N or "
                              "mps)")
        if not isinstance(self.progress, bool):
            raise ConfigError(f"progress must be true or false, got {self.progress!r}")
        if not isinstance(self.telemetry, (bool, str)) or self.telemetry == "":
            raise ConfigError(f"telemetry must be True, False or a file path, got "
                              f"{self.telemetry!r}")
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ConfigError(f"trace must be a file path, got {self.trace!r}")
        if self.deterministic and self.trace is None:
            raise ConfigError("deterministic mode records a trace: give its path (trace=PATH, "
                              "--trace PATH)")
        if self.kv_cache_dtype == "fp8" and (self.tensor_parallel_size > 1 or self.batch_invariant
                                             or self.speculative is not None):
            raise ConfigError("kv_cache_dtype='fp8' runs on one device without batch_invariant "
                              "or speculative decoding; drop one of them")
        if self.speculative is not None:
            from noesis.speculative.config import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise ConfigError("speculative must be a noesis.SpeculativeConfig, got "
                                  f"{type(self.speculative).__name__}")

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the device-dependent defaults filled in (see the table above)."""
        cuda = device_type == "cuda"
        seqs = CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS
        tokens = CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS
        return dataclasses.replace(
            self,
            max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
        )


def _check_control(control: object) -> None:
    """A policy name or a ControlPolicy object (one with next_phi), or None."""
    if control is None or (isinstance(control, str) and control in CONTROL_NAMES):
        return
    if isinstance(control, str) or not callable(getattr(control, "next_phi", None)):
        shown = repr(control) if isinstance(control, str) else type(control).__name__
        raise ConfigError(f"control must be {', '.join(CONTROL_NAMES)} or a "
                          f"noesis.control.ControlPolicy, got {shown[:40]}")
