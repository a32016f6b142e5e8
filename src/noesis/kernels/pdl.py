"""Programmatic dependent launch (PDL) for the decode kernels: the switch and the launch options.

On Hopper and later a kernel may launch while the one before it finishes and wait for it only
when it starts reading (griddepcontrol). Triton too old to emit it gets no-op stand-ins, so
the kernels' PDL branches compile and stay untaken.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Triton 3.4 and later
    # The kernels import these from here.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    GDC = True
except ImportError:  # older Triton: the kernels run without PDL (their branches stay untaken)
    GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

# Programmatic dependent launch (Hopper on): the batch-1 path's kernels (one-row projections and
# decode attention) let the next kernel launch while they finish, and wait for the one before
# them only when they start reading. On by default on sm_90 and later (EngineConfig.pdl,
# `--no-pdl`, turns it off): on an H200 it took the 8B shape's batch-1 graph from 4.10 to
# 3.93-3.98 ms and the 1B one's from 0.879 to 0.804-0.814 (graph_ab.py --what pdl, 2026-11-23).
# Never under Triton's interpreter, which cannot run the griddepcontrol instructions, and not
# with a Triton too old to emit them.
PDL = GDC  # this Triton can emit PDL


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """griddepcontrol needs compute capability 9.0 (Hopper) or later."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch's PDL constexpr and, when on, the launch option."""
    on = PDL and x.is_cuda and _pdl_capable(x.device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
