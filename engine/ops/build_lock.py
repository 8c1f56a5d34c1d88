"""One process builds a kernel build folder at a time, and a build that was killed never blocks the next start.

torch.utils.cpp_extension guards a build folder with a file named `lock` that it removes when its build ends; a
process killed during the build (Ctrl-C at the wrong moment, SIGKILL, the OOM killer) leaves that file behind, and
every later start waits on it forever, silently. So the loader first takes its own lock, an flock(2) on
`pagedserve-build.lock` in the folder: the kernel drops it when its holder dies, however it dies. A live builder
is waited for (at most `timeout_s`, saying so); once ours is held, a torch `lock` in the folder can only be a dead
build's, and is removed. The lock file holds its holder's pid and host, to name it in those messages.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("pagedserve.ops")

LOCK_NAME = "pagedserve-build.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton
_NOTE_EVERY_S = 60.0  # how often a long wait says it is still waiting
# A holder that only checks a built folder (torch runs ninja on every load) lets go well within this: no warning.
_QUIET_S = 2.0


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float, poll_s: float = 0.2) -> Iterator[None]:
    """Holds the build folder's lock for the block, after removing a killed build's torch `lock`; TimeoutError
    (naming the holder) when another live process holds it for more than `timeout_s`."""
    path = build_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # a read-only folder: torch's own lock cannot be taken there either
        logger.warning("pagedserve: cannot open %s (%s); building the kernels without pagedserve's lock", path, exc)
        yield
        return
    try:
        if not _acquire(fd, path, timeout_s, poll_s):
            yield
            return
        try:
            _remove_stale_torch_lock(fd, build_dir)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            yield
        finally:
            os.ftruncate(fd, 0)  # an empty file: no build is under way (a killed holder leaves its pid)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, timeout_s: float, poll_s: float) -> bool:
    """True once the lock is held; False where the file system has no locks (then the build goes on unlocked)."""
    start = time.monotonic()
    named, next_note = "", _NOTE_EVERY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if named:
                logger.warning("pagedserve: the other build finished after %.0f s; going on", time.monotonic() - start)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:  # e.g. ENOLCK on a network mount without a lock manager
            logger.warning("pagedserve: cannot lock %s (%s); building the kernels without pagedserve's lock", path, exc)
            return False
        waited = time.monotonic() - start
        holder = _holder(fd)
        if waited >= _QUIET_S and holder != named:  # once per holder (who writes its pid just after it locks)
            named = holder
            logger.warning("pagedserve: waiting for another process building the kernels (%s) in %s ...",
                           holder, path.parent)
        elif named and waited >= next_note:
            next_note += _NOTE_EVERY_S
            logger.warning("pagedserve: still waiting for %s to finish building the kernels (%.0f s)", holder, waited)
        if waited >= timeout_s:
            raise TimeoutError(
                f"another process ({holder}) has been building the kernels in {path.parent} for over "
                f"{timeout_s:.0f} s; stop it, or wait longer with PAGEDSERVE_BUILD_TIMEOUT=<seconds>")
        time.sleep(poll_s)


def _holder(fd: int) -> str:
    """'pid N' (and 'on host H' when not this one) from the lock file, else 'pid unknown'."""
    try:
        pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    except OSError:
        return "pid unknown"
    if not pid:
        return "pid unknown"
    return f"pid {pid}" + (f" on host {host}" if host and host != socket.gethostname() else "")


def _remove_stale_torch_lock(fd: int, build_dir: Path) -> None:
    """With our lock held, torch's `lock` in the folder is a killed build's: removed, or torch would wait forever."""
    stale = build_dir / TORCH_LOCK_NAME
    if not stale.exists():
        return
    previous = _holder(fd)
    stale.unlink(missing_ok=True)
    logger.warning("pagedserve: removed a stale lock left by %s (a kernel build that was stopped before it "
                   "finished): %s; building again", "an earlier process" if previous == "pid unknown" else previous,
                   stale)
