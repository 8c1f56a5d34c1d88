"""Builds and loads pagedserve's compiled ops (csrc/), and says which backend serves them.

The C++/CUDA sources in csrc/ are JIT-built with torch.utils.cpp_extension on first
use and cached (in $PAGEDSERVE_CACHE, else torch's extensions dir). Where CUDA is
visible the build also holds the CUDA kernels. If the build fails (no compiler, say)
the backend is the pure-torch reference, with a warning; PAGEDSERVE_OPS_BACKEND=torch
forces it.
"""
from __future__ import annotations

import enum
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("pagedserve.ops")

_SOURCES_CPU = (
    "bindings.cpp", "cpu/attention.cpp", "cpu/prefill_attention.cpp", "cpu/cache.cpp", "cpu/layernorm.cpp",
    "cpu/activation.cpp", "cpu/pos_encoding.cpp", "cpu/sampling.cpp",
)
_SOURCES_CUDA = (
    "cuda/attention_kernels.cu", "cuda/cache_kernels.cu", "cuda/elementwise_kernels.cu", "cuda/torch_bindings.cpp",
)


class OpsBackend(str, enum.Enum):
    """Which implementation serves the ops."""

    COMPILED_CUDA = "compiled-cuda"  # C++ CPU ops + CUDA kernels
    COMPILED_CPU = "compiled-cpu"
    TORCH_REFERENCE = "torch-reference"



_lock = threading.Lock()
_module = None
_backend: Optional[OpsBackend] = None


def find_csrc() -> Optional[Path]:
    """csrc/ next to the engine package (source tree), else shipped as engine/_csrc or engine/csrc."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "_csrc", here / "csrc"):
        if (candidate / "ops.h").is_file():
            return candidate
    return None


def _cpu_isa_flags() -> tuple[str, list[str]]:
    # Targeted flags, not -march=native, so a cache built here stays valid on
    # any machine that has the same extensions (the ISA is part of the name).
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic", []
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx2", avx2
    avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if "avx512_bf16" in flags:  # vdpbf16ps: bf16 dot products in the attention kernels
        return "avx512bf16", avx512 + ["-mavx512bf16"]
    return "avx512", avx512


def _want_cuda() -> bool:
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and Path(CUDA_HOME, "bin", "nvcc").exists()


def _build(csrc: Path, with_cuda: bool):
    from torch.utils.cpp_extension import load

    isa, isa_flags = _cpu_isa_flags()
    sources = list(_SOURCES_CPU) + (list(_SOURCES_CUDA) if with_cuda else [])
    digest = hashlib.sha1()
    for rel in sorted(p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.is_file()):
        digest.update(rel.encode() + (csrc / rel).read_bytes())
    name = f"pagedserve_{'cuda' if with_cuda else 'cpu'}_{isa}_{digest.hexdigest()[:10]}"
    root = os.environ.get("PAGEDSERVE_CACHE")
    build_dir = Path(root) / name if root else None
    if build_dir is not None:
        build_dir.mkdir(parents=True, exist_ok=True)
    else:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
    if not (build_dir / f"{name}.so").exists():
        kind = "CUDA" if with_cuda else "CPU"
        logger.warning("building pagedserve %s kernels (first run, ~%s s) in %s ...",
                       kind, 180 if with_cuda else 40, build_dir)
    # -fno-trapping-math: lets gcc if-convert (and so vectorize) the clamps in csrc/cpu/vec_utils.h.
    cflags = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math", *isa_flags]
    if with_cuda:
        cflags.append("-DPAGEDSERVE_CUDA")
    return load(
        name=name,
        sources=[str(csrc / s) for s in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=["-O3", "-DPAGEDSERVE_CUDA", "--use_fast_math", "-lineinfo"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(csrc)],
        build_directory=str(build_dir),
        verbose=os.environ.get("PAGEDSERVE_VERBOSE_BUILD") == "1",
    )


def load():
    """Builds (once) and returns the compiled module, or None for the torch reference."""
    global _module, _backend
    with _lock:
        if _backend is not None:
            return _module
        if os.environ.get("PAGEDSERVE_OPS_BACKEND", "").lower() == "torch":
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        csrc = find_csrc()
        if csrc is None:
            logger.warning("pagedserve: csrc/ not found next to the engine package; using the "
                           "pure-torch reference ops (slow)")
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            logger.warning("pagedserve: no C++ compiler found; using the pure-torch reference ops (slow)")
            _backend = OpsBackend.TORCH_REFERENCE
            return None
        attempts = [True, False] if _want_cuda() else [False]
        for with_cuda in attempts:
            try:
                _module = _build(csrc, with_cuda)
                _backend = OpsBackend.COMPILED_CUDA if with_cuda else OpsBackend.COMPILED_CPU
                return _module
            except Exception as exc:  # a failed build must not take the engine down
                logger.warning("pagedserve: building the %s kernels failed (%s: %s)",
                               "CUDA" if with_cuda else "CPU", type(exc).__name__, str(exc)[-2000:])
        logger.warning("pagedserve: using the pure-torch reference ops (slow)")
        _backend = OpsBackend.TORCH_REFERENCE
        return None


def backend() -> OpsBackend:
    """Which implementation the ops use (builds the kernels if not done yet)."""
    load()
    assert _backend is not None
    return _backend
