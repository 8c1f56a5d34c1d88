"""benchmarks/proc_cpu.py: a process's tree and CPU seconds from /proc, checked against real child processes."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Loaded from its file: benchmarks/ on sys.path at collection would shadow the tests' `kernels` package with
# benchmarks/kernels.py.
_spec = importlib.util.spec_from_file_location(
    "proc_cpu", Path(__file__).resolve().parents[2] / "benchmarks" / "proc_cpu.py")
proc_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proc_cpu)
CPUWindow, cpu_seconds, process_tree = proc_cpu.CPUWindow, proc_cpu.cpu_seconds, proc_cpu.process_tree

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def _wait_until_idle(pid: int, spun: float) -> float:
    """Until the process has used `spun` CPU seconds and then no more for 0.3 s (its spin is over: a loaded machine
    stretches a spin's wall time); its CPU seconds then."""
    deadline = time.monotonic() + 30
    last = -1.0
    while time.monotonic() < deadline:
        now = cpu_seconds([pid])[pid]
        if now >= spun and now == last:
            return now
        last = now
        time.sleep(0.3)
    raise AssertionError(f"process {pid} still busy after 30 s ({last} CPU seconds)")


def test_a_busy_grandchild_counts_and_an_idle_child_does_not():
    # A child (idle, sleeping) that starts a grandchild which burns 0.3 s of CPU and then sleeps.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               f"subprocess.Popen([sys.executable, '-c', {SPIN.format(s=0.3)!r}])\ntime.sleep(30)"])
    try:
        window = CPUWindow(parent.pid)
        window.start()
        deadline = time.monotonic() + 20
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = process_tree(parent.pid)[1:]
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and tree.index(parent.pid) < tree.index(grandchild)  # parents first
        _wait_until_idle(grandchild, 0.3)
        used = window.stop()
        # The grandchild was not alive at start(): a window counts the processes alive at both ends.
        assert grandchild not in used and 0 <= used[parent.pid] < 0.3
        window.start()
        time.sleep(0.2)
        assert window.stop()[grandchild] < 0.1  # asleep now
    finally:
        for pid in process_tree(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()


def test_cpu_of_a_process_alive_across_the_window():
    child = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(0.5)\n" + SPIN.format(s=0.5)])
    try:
        time.sleep(0.2)  # alive, not spinning yet
        window = CPUWindow(child.pid)
        window.start()
        _wait_until_idle(child.pid, 0.5)
        used = window.stop()[child.pid]
        assert 0.45 <= used <= 1.0, used  # its 0.5 s spin (and what was left of its start), give or take a tick
    finally:
        child.kill()
        child.wait()
