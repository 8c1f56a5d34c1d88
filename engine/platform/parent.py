"""A child process that never outlives its parent, even one killed with SIGKILL (no torch)."""
from __future__ import annotations

import ctypes
import os
import signal
import threading

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent(parent: int, name: str, poll_s: float = 0.5) -> None:
    """SIGKILL when `parent` exits (Linux's PR_SET_PDEATHSIG), and a thread that polls for it elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watch thread alone
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            threading.Event().wait(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()
