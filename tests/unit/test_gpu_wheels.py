"""scripts/gpu_wheels.sh downloads what the GPU image lacks, computed from this environment's resolved
dependencies: every requirement of a downloaded wheel is downloaded too or in the image's package list.

On the H100 (issue 40) `pagedserve serve` did not start from the hand-written list: fastapi 0.165 imports
opentelemetry (opentelemetry-api), which the list missed. The closure is checked here over the installed
metadata (the wheels are pinned to these versions, so their Requires-Dist are the same), without a download.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_wheels)

# What the image lacked (issue 40): each must be downloaded.
IMAGE_LACKED = {"fastapi", "starlette", "pydantic", "uvicorn", "sse-starlette", "gguf", "opentelemetry-api",
                "xgrammar"}


def _names(specs: list[str]) -> dict[str, str]:
    return dict(spec.split("==", 1) for spec in specs)


def test_the_wheels_are_what_the_image_lacks_pinned_to_this_environment():
    wheels = _names(gpu_wheels.missing_specs())
    assert IMAGE_LACKED <= set(wheels)
    assert not set(wheels) & {canonicalize_name(p) for p in gpu_wheels.IMAGE_PACKAGES}  # never shadowed
    for name, version in wheels.items():
        assert version == gpu_wheels.installed_version(name), name


def test_every_requirement_of_a_wheel_is_a_wheel_or_in_the_image():
    wheels = set(_names(gpu_wheels.missing_specs()))
    image = {canonicalize_name(p) for p in gpu_wheels.IMAGE_PACKAGES}
    unmet = [f"{name} needs {req}" for name in sorted(wheels) for req in gpu_wheels.requires(name)
             if canonicalize_name(req.name) not in wheels | image]
    assert unmet == []
    # The server's own imports: what failed on the H100.
    assert {"opentelemetry-api", "annotated-doc", "typing-inspection"} <= {
        canonicalize_name(r.name) for r in gpu_wheels.requires("fastapi")}


def test_markers_are_the_gpu_machines():
    """Requirements are taken for CPython 3.12 on Linux x86_64, whatever runs the script; extras only when named."""
    fastapi = {canonicalize_name(r.name) for r in gpu_wheels.requires("fastapi")}
    assert "python-multipart" not in fastapi  # the "standard" extra, not asked for
    assert "python-multipart" in {canonicalize_name(r.name) for r in gpu_wheels.requires("fastapi", ["standard"])}
    assert "triton" in {canonicalize_name(r.name) for r in gpu_wheels.requires("xgrammar")}  # Linux x86_64 only


def test_the_script_lists_the_same_specs_without_downloading():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), "--list"], capture_output=True,
                            text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == gpu_wheels.missing_specs()
