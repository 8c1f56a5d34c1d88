"""The engine's layer rules (pyproject.toml's [tool.importlinter] contracts), checked by import-linter: the tree
keeps them, and each kind of violation a change could bring (torch in the pure-Python core, an import up a
layer, a cycle, the server reaching past the engine's public face) breaks the run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", "pyproject.toml"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_contract():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


PLANTS = {
    # file, line planted at its end, the contract it must break
    "torch in the core": ("engine/core/scheduler.py", "import torch", "pure Python"),
    "indirect torch in the core": ("engine/core/block_allocator.py", "import engine.ops", "pure Python"),
    "up a layer": ("engine/core/block_manager.py", "import engine.worker.cache_engine", "in layers"),
    "a cycle": ("engine/metrics.py", "import engine.frontend.protocol", "no import cycles"),
    "past the public face": ("server/routes.py", "import engine.core.scheduler", "public face"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_violation_breaks_its_contract(tmp_path, plant):
    for name in ("engine", "server"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path, line, contract = PLANTS[plant]
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}  # planted by the test\n")
    run = _lint(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = run.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and path.removesuffix(".py").replace("/", ".") in broken, run.stdout
