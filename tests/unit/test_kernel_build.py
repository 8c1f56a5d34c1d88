"""Two install traps of the kernel build (engine/ops/build.py, engine/ops/build_lock.py), with real processes.

A start here is a real process running the loader's `_build` on a checkout whose csrc/ holds one tiny C++ file
(a Python module with nothing in it), so a build takes seconds, not the real kernels' minutes: what is real is
torch's JIT build (its `lock`, build.ninja, ninja) and the processes, killed with SIGKILL as a user's Ctrl-C or the
OOM killer would.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_CPP = """
#include <Python.h>
#define PS_CAT(a, b) a##b
#define PS_INIT(name) PS_CAT(PyInit_, name)
static PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, nullptr};
PyMODINIT_FUNC PS_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""

# One start: the loader's real _build of <checkout>/csrc. With "stall", torch's build step (inside torch's lock)
# first touches <checkout>/stalled, then waits (up to a minute) for <checkout>/go before it builds.
START = """
import logging, sys, time
from pathlib import Path
import torch.utils.cpp_extension as cpp
from engine.ops import build
logging.basicConfig(level=logging.WARNING, format="%(message)s")
build._SOURCES_CPU = ("tiny.cpp",)
checkout = Path(sys.argv[1])
real_build = cpp._write_ninja_file_and_build_library
def stalled_build(**kwargs):
    (checkout / "stalled").touch()
    deadline = time.monotonic() + 60
    while not (checkout / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    real_build(**kwargs)
if sys.argv[2] == "stall":
    cpp._write_ninja_file_and_build_library = stalled_build
print("loaded", build._build(checkout / "csrc", False).__file__, flush=True)
"""
# A tiny build takes seconds (a torch import, one small compile and link, on 2 shared cores); far past that, a
# start that has not loaded is stuck, as every start after a killed build was without the loader's own lock.
START_BOUND_S = 120


def _checkout(root: Path) -> Path:
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "tiny.cpp").write_text(TINY_CPP)
    return root


def _env(cache: Path) -> dict:
    return dict(os.environ, PAGEDSERVE_CACHE=str(cache), PAGEDSERVE_CPU_ISA="generic")


def _spawn(checkout: Path, cache: Path, stall: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", START, str(checkout), "stall" if stall else "build"], cwd=ROOT,
                            env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[Path, str]:
    """(the loaded module's file, the start's log), once it has loaded."""
    try:
        out, err = proc.communicate(timeout=START_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a start did not load within {START_BOUND_S} s; its log:\n{err[-3000:]}")
    assert proc.returncode == 0 and out.startswith("loaded "), err[-3000:]
    return Path(out.split(" ", 1)[1].strip()), err


def _start(checkout: Path, cache: Path) -> tuple[Path, str]:
    return _finish(_spawn(checkout, cache))


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _build_dirs(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir())


def test_a_start_after_a_build_killed_midway_loads(tmp_path):
    checkout, cache = _checkout(tmp_path / "checkout"), tmp_path / "cache"
    victim = _spawn(checkout, cache, stall=True)
    _wait_for(checkout / "stalled", victim)
    (build_dir,) = _build_dirs(cache)
    assert (build_dir / "lock").exists()  # torch's lock, taken for the build under way
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert (build_dir / "lock").exists()  # ... and left behind: the trap

    module, log = _start(checkout, cache)
    assert module.parent == build_dir and module.is_file()
    assert f"removed a stale lock left by pid {victim.pid} " in log
    assert not (build_dir / "lock").exists()


def test_a_live_build_is_waited_for_not_clobbered(tmp_path):
    checkout, cache = _checkout(tmp_path / "checkout"), tmp_path / "cache"
    first = _spawn(checkout, cache, stall=True)  # holds the build folder until told to go on
    _wait_for(checkout / "stalled", first)
    second = _spawn(checkout, cache)
    said = ""
    while "waiting for another process" not in said and (line := second.stderr.readline()):
        said += line
    (checkout / "go").touch()
    module, _ = _finish(first)
    built = module.stat().st_mtime_ns
    again, log = _finish(second)
    assert again == module and module.stat().st_mtime_ns == built  # loaded what the first built, no rebuild
    log = said + log
    assert f"waiting for another process building the kernels (pid {first.pid})" in log
    assert "stale" not in log


def test_two_checkouts_started_alternately_keep_their_own_builds(tmp_path):
    # Same sources, two paths: a folder keyed on the sources alone was shared, and torch's build.ninja names the
    # sources by absolute path, so each start rebuilt what the other checkout had built.
    a, b, cache = _checkout(tmp_path / "a"), _checkout(tmp_path / "b"), tmp_path / "cache"
    built = {}
    for checkout in (a, b, a, b):
        module, _ = _start(checkout, cache)
        built.setdefault(checkout, (module, module.stat().st_mtime_ns))
        assert built[checkout] == (module, module.stat().st_mtime_ns), f"{checkout.name} rebuilt its kernels"
    assert built[a][0].parent != built[b][0].parent
    assert all(m.stat().st_mtime_ns == t for m, t in built.values())


def _build_lock_module():
    """engine/ops/build_lock.py on its own (it needs no torch), as a child process loads it too."""
    spec = importlib.util.spec_from_file_location("build_lock", ROOT / "engine" / "ops" / "build_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOLD = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("build_lock", sys.argv[1])
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
with lock.build_lock(Path(sys.argv[2]), timeout_s=60):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_build_held_too_long_times_out_naming_its_holder_and_its_death_frees_the_folder(tmp_path, caplog):
    build_lock = _build_lock_module().build_lock
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT / "engine" / "ops" / "build_lock.py"),
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match=rf"another process \(pid {holder.pid}\) has been building the "
                                               r"kernels in .* for over 3 s; .*PAGEDSERVE_BUILD_TIMEOUT"):
            with build_lock(tmp_path, timeout_s=3, poll_s=0.05):  # past the 2 s a wait is quiet
                pytest.fail("took a lock a live process holds")
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for another process building the kernels (pid {holder.pid})" in caplog.text
    with build_lock(tmp_path, timeout_s=5, poll_s=0.05):  # the kernel dropped the dead holder's lock
        assert (tmp_path / "pagedserve-build.lock").read_text().startswith(f"{os.getpid()} ")
    assert (tmp_path / "pagedserve-build.lock").read_text() == ""  # released: no build under way
