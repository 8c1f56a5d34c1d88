"""What an offline CUDA-torch machine lacks to run pagedserve and scripts/gpu_check.sh: the project's dependency
closure, pinned to the versions this (CPU) environment resolved, minus what the GPU image already holds.

    python scripts/gpu_wheels.py            # one `name==version` a line: the specs scripts/gpu_wheels.sh downloads

The closure is read from the installed packages' metadata (Requires-Dist), with markers evaluated for the GPU
machine's interpreter (CPython 3.12, Linux x86_64), extras followed where a requirement names them. The walk
stops at the packages the image holds (IMAGE_PACKAGES): those are never downloaded (a second version would shadow
the image's), and their own dependencies are the image's (its versions are not this environment's: its
transformers needs no pydantic, say). Every other package the walk reaches is downloaded, so each downloaded
wheel's requirements are downloaded too or in the image.
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path
from typing import Iterable, Optional

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# The GPU image's packages as last read (issue 40): CUDA torch and the usual scientific and test stack.
IMAGE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "accelerate", "pytest",
                  "hypothesis", "httpx", "anyio", "uvloop", "jinja2", "tqdm", "pyyaml", "psutil",
                  "prometheus-client", "ninja",
                  "triton")  # CUDA torch's own dependency on Linux x86_64 (the CPU torch here lists none)
# What scripts/gpu_check.sh runs beyond the project's own dependencies (pyproject's pytest options name
# pytest-timeout's `timeout`).
CHECK_PACKAGES = ("pytest-timeout",)
# The GPU machine's interpreter, for the markers.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """[project].dependencies of pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    """Whether `req` holds on the target interpreter for a package installed with `extras`."""
    return req.marker is None or any(req.marker.evaluate({**TARGET, "extra": e}) for e in (*extras, ""))


def requires(name: str, extras: Iterable[str] = ()) -> list[Requirement]:
    """The requirements of installed `name` (with `extras`) on the target interpreter; [] if not installed."""
    try:
        lines = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return []
    return [req for req in map(Requirement, lines) if _applies(req, tuple(extras))]


def closure(roots: Iterable[str], stop: Iterable[str] = ()) -> dict[str, Requirement]:
    """Every package `roots` (requirement strings) need on the target, transitively, not entering `stop`:
    canonical name -> the requirement that named it (extras merged)."""
    stop = {canonicalize_name(name) for name in stop}
    found: dict[str, Requirement] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in stop or (req.marker is not None and not _applies(req, ())):
            continue
        seen = found.get(key)
        if seen is not None and set(req.extras) <= set(seen.extras):
            continue
        found[key] = req if seen is None else Requirement(f"{req.name}[{','.join(set(req.extras) | set(seen.extras))}]")
        todo.extend(requires(req.name, req.extras))
    return found


def installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def missing_specs(image: Iterable[str] = IMAGE_PACKAGES,
                  roots: Optional[Iterable[str]] = None) -> list[str]:
    """`name==version` (the version installed here) of each package of the closure the image does not hold;
    a package not installed here keeps its requirement's specifier."""
    roots = list(project_requirements() + list(CHECK_PACKAGES) if roots is None else roots)
    specs = []
    for key, req in sorted(closure(roots, stop=image).items()):
        version = installed_version(req.name)
        specs.append(f"{key}=={version}" if version else f"{key}{req.specifier}")
    return specs


def main() -> int:
    print("\n".join(missing_specs()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
