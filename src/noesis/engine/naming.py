"""The names noesis's child processes show in ps and top (Linux: the kernel's `comm`)."""

from __future__ import annotations

import ctypes
import sys

PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Set this process's name (15 bytes at most); a no-op where the kernel has no prctl."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
