"""What every child process of noesis does first (the engine, the body parser, tool workers):
take a name that ps and top show, and exit by itself once its parent is gone."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

PR_SET_NAME = 15
PARENT_POLL_S = 0.5


def become_child(name: str, parent: int | None = None) -> None:
    """Name this process and start the thread that ends it when `parent` (default: the parent
    now) is gone, even killed with SIGKILL, and even while the main thread is blocked (loading a
    model, reading a pipe, running a tool)."""
    name_process(name)
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="noesis-parent-watch", daemon=True).start()


def name_process(name: str) -> None:
    """Set this process's name (15 bytes at most); a no-op where the kernel has no prctl."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
