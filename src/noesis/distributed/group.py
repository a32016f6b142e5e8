"""The tensor-parallel process group: joining it (spawned ranks or torchrun), the model's
collectives, rank 0's messages to the others, and naming the rank that died when one does.

Two groups: the default one (NCCL on CUDA, gloo on CPU) carries the model's all-reduces and the
logit gather under a short timeout, so a stalled rank ends the step with an error instead of a
hang; a gloo group carries rank 0's messages (load, pool, step, stop) under a long one, because
a worker waits there for as long as the server sits idle. A rank killed outright closes its
sockets, which the others' next collective reports at once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from noesis.engine.engine import EngineFault

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
IDLE_TIMEOUT = timedelta(days=7)  # a worker waiting for rank 0's next message
DEATH_GRACE_S = 5.0  # how long a failed collective waits for a dying rank's exit to show


class RankFailure(EngineFault):
    """A tensor-parallel rank died, stalled past the collective timeout, or fell out of step:
    the group cannot run another forward, and the engine must be rebuilt."""


@dataclass
class ParallelGroup:
    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup  # gloo: rank 0's messages
    workers: list = field(default_factory=list)  # rank 0 of spawned ranks: their Popens
    broken: bool = False
    owner: object = None  # rank 0: the runner whose model the ranks hold

    # ---- the model's collectives (default group, short timeout) -------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `x` [B, n] side by side [B, size * n]; the others: None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    # ---- rank 0's messages (gloo group, long timeout) -----------------------------------------

    def send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    # ---- failures -----------------------------------------------------------------------------

    def failed(self, error: BaseException) -> RankFailure:
        """The error for a forward that failed part-way on rank 0: the ranks are out of step
        now, whatever the cause. Names the spawned ranks that died, with how."""
        self.broken = True
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if _dead(p)]
        if dead:
            names = ", ".join(f"rank {rank} (pid {p.pid}) {_exit(p.returncode)}"
                              for rank, p in dead)
            return RankFailure(f"tensor-parallel {names}; the group is down: {error}")
        return RankFailure(
            f"a tensor-parallel step failed ({error}); no spawned rank has exited, so a rank "
            f"stalled past the {COLLECTIVE_TIMEOUT.total_seconds():.0f} s collective timeout or "
            "the ranks fell out of step (under torchrun its log names the rank)")

    def close(self) -> None:
        """Rank 0: stop the other ranks (a message if the group still works, else a signal),
        then leave the group."""
        if not self.broken:
            try:
                self.send(("stop", None))
            except Exception:  # a rank is gone: the signals below end the rest
                self.broken = True
        for process in self.workers:
            try:
                process.wait(DEATH_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        dist.destroy_process_group()


def join(rank: int, size: int, local_rank: int, init_method: str, device_type: str,
         workers: list | None = None) -> ParallelGroup:
    """Join the group as `rank`: NCCL on cuda:`local_rank`, gloo on the CPU."""
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, size, device, control, workers or [])


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    env = os.environ
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))


def _dead(process: subprocess.Popen) -> bool:
    try:
        process.wait(DEATH_GRACE_S)
    except subprocess.TimeoutExpired:
        return False
    return True


def _exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code} (its traceback is on stderr)"
