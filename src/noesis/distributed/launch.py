"""Starting a tensor-parallel engine: rank 0's side (TensorParallel, which the Engine holds) and
the other ranks, either spawned here (one process per rank, kept for the life of this process
and reused by the next engine of the same size) or started by torchrun (ranks > 0 serve rank 0
and exit when it stops).
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import noesis
from noesis.distributed.group import ParallelGroup, join, torchrun_rank
from noesis.distributed.layers import check_shardable
from noesis.distributed.runner import PoolShape, TensorParallelRunner, serve
from noesis.engine.loading import LoadedModel, read_model_config, resolve_device
from noesis.errors import ConfigError
from noesis.models.capabilities import check_load
from noesis.weights.hub import resolve_model_dir

_group: ParallelGroup | None = None  # this process's group (rank 0), reused across engines


class TensorParallel:
    """Rank 0 of a tensor-parallel engine: loads its shard while the other ranks load theirs,
    then builds the runner that drives them."""

    def __init__(self, model: str, config) -> None:
        """Checks what it can before any rank starts, then joins or spawns the group."""
        launched = torchrun_rank()
        if launched is not None and launched[0] > 0:  # torchrun's other ranks serve rank 0
            raise SystemExit(serve_torchrun_rank())
        _check_config(config)
        self.size = config.tensor_parallel_size
        model_config = read_model_config(resolve_model_dir(model, config.revision))
        check_load(config.capabilities, model_config.capabilities, model_config.architecture)
        check_shardable(model_config, self.size)
        self.group = _connect(self.size, config.device)

    def load(self, model: str, config) -> LoadedModel:
        from noesis.distributed.loading import load_shard

        self.group.send(("load", (str(model), config)))
        return load_shard(model, self.group.device, config.dtype, config.revision, self.size,
                          self.group)

    def runner(self, model, kv, rope, device, max_model_len, max_num_seqs) -> TensorParallelRunner:
        """Rank 0's runner, once every rank has built a pool like `kv`."""
        shape = PoolShape(kv.num_pages, kv.page_size, max_model_len, max_num_seqs)
        self.group.send(("pool", shape))
        self.group.barrier()
        runner = TensorParallelRunner(model, kv, rope, device, max_model_len,
                                      max_num_seqs=max_num_seqs, group=self.group)
        self.group.owner = runner  # the ranks now hold this engine's model, not an older one's
        return runner


def serve_torchrun_rank() -> int:
    """A torchrun rank > 0: join the group, run rank 0's forwards until it stops; exit code."""
    rank, size, local_rank = torchrun_rank()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    group = join(rank, size, local_rank, "env://", device_type)
    serve(group)
    torch.distributed.destroy_process_group()
    return 0


def _check_config(config) -> None:
    if config.speculative is not None or config.trace is not None:
        what = "speculative decoding" if config.speculative is not None else "a replay trace"
        raise ConfigError(f"{what} is not supported with tensor parallelism yet")
    device = resolve_device(config.device)
    if device.type not in ("cuda", "cpu") or device.index not in (None, 0):
        raise ConfigError(f"tensor parallelism runs on device 'cuda' (rank r on cuda:r) or "
                          f"'cpu', got {config.device!r}")
    if device.type == "cuda" and torch.cuda.device_count() < config.tensor_parallel_size \
            and torchrun_rank() is None:
        raise ConfigError(f"tensor_parallel_size {config.tensor_parallel_size} needs as many "
                          f"GPUs; PyTorch sees {torch.cuda.device_count()}")


def _connect(size: int, device: str) -> ParallelGroup:
    """The group this engine runs on: torchrun's (this process is rank 0 of it; ranks > 0
    never get here, see Engine), or spawned ranks, reused while they live."""
    global _group
    device_type = resolve_device(device).type
    launched = torchrun_rank()
    if launched is not None:
        rank, world, local_rank = launched
        if world != size:
            raise ConfigError(f"tensor_parallel_size is {size} but torchrun started {world} "
                              "ranks (--nproc-per-node times --nnodes must equal it)")
        if torch.distributed.is_initialized():
            return _group
        _group = join(rank, size, local_rank, "env://", device_type)
        atexit.register(_close_at_exit, _group, None)  # the other ranks stop with this one
        return _group
    if _group is not None:
        if (not _group.broken and _group.size == size
                and _group.device.type == device_type):
            return _group
        _group.close()
    _group = _spawn(size, device_type)
    return _group


def _spawn(size: int, device_type: str) -> ParallelGroup:
    """Ranks 1..size-1 as child processes (`noesis.distributed.worker`: plain subprocesses, so
    that a daemonic engine process may start them and the caller's main module is not run
    again); this process is rank 0. They meet in a file store (no port to pick), and stop with
    a message at exit or when this process's sockets close."""
    handle, path = tempfile.mkstemp(prefix="noesis-tp-")
    os.close(handle)
    init_method = Path(path).as_uri()
    source = str(Path(noesis.__file__).parents[1])  # this noesis, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, (source, os.environ.get("PYTHONPATH"))))}
    workers = [subprocess.Popen([sys.executable, "-m", "noesis.distributed.worker", str(rank),
                                 str(size), init_method, device_type], env=env)
               for rank in range(1, size)]
    try:
        group = join(0, size, 0, init_method, device_type, workers)
    except BaseException:
        for process in workers:
            process.kill()
        raise
    atexit.register(_close_at_exit, group, path)
    return group


def _close_at_exit(group: ParallelGroup, store: str | None) -> None:
    if _group is group:
        group.close()
    if store is not None:
        Path(store).unlink(missing_ok=True)
