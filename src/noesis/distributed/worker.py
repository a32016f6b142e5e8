"""A spawned rank's process: `python -m noesis.distributed.worker RANK SIZE INIT_METHOD DEVICE`
joins the group and runs rank 0's forwards until rank 0 stops or goes away."""

from __future__ import annotations

import sys

import torch

from noesis.distributed.group import join
from noesis.distributed.runner import serve


def main(argv: list[str]) -> int:
    rank, size, init_method, device_type = int(argv[0]), int(argv[1]), argv[2], argv[3]
    if device_type == "cpu":  # the cores are shared between the ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    serve(join(rank, size, rank, init_method, device_type))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
