"""CPU seconds of a server's processes, read from /proc (Linux): the process given and its descendants (an engine
core process, tensor-parallel ranks). benchmarks/serving.py --server-pid reports them a timed run, per output token:
on a machine the client shares with the server, where the CPU goes (docs/benchmarks.md, issue 41's budget)."""
from __future__ import annotations

import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces and parentheses)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):  # (a process that just exited)
                continue
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(sorted(children.get(tree[i], [])))
        i += 1
    return tree


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process still alive (its threads included)."""
    out = {}
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)
    return out


class CPUWindow:
    """The CPU a process tree used between start() and stop(): {pid: seconds}, for the processes alive at both."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._before: dict[int, float] = {}
        self.used: dict[int, float] = {}  # the last window's

    def start(self) -> None:
        self._before = cpu_seconds(process_tree(self.pid))

    def stop(self) -> dict[int, float]:
        after = cpu_seconds(process_tree(self.pid))
        self.used = {pid: after[pid] - before for pid, before in self._before.items() if pid in after}
        return self.used
