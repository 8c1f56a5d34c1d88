"""Builds and loads pagedserve's compiled ops (csrc/), and says which backend serves them.

The C++/CUDA sources in csrc/ are JIT-built with torch.utils.cpp_extension on first
use and cached (in $PAGEDSERVE_CACHE, else torch's extensions dir), in a folder per sources, their path and
ISA, which one process builds at a time (engine/ops/build_lock.py). Where CUDA is
visible the build also holds the CUDA kernels. If the build fails (no compiler, say)
the backend is the pure-torch reference, with a warning; PAGEDSERVE_OPS_BACKEND=torch
forces it. An engine on a CUDA device refuses to start without the compiled CUDA
kernels (require_backend): the reference is a Python loop per sequence, far too slow to serve.

PAGEDSERVE_CPU_ISA=avx2 (or generic, avx512) builds the CPU kernels for less than this CPU
has; with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 holding torch to the same,
an AVX2-only CPU's code paths run, and are tested (`make test-avx2`) and measured
(benchmarks/peers.sh ISA=avx2), on an AVX-512 machine.
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

from engine.ops.build_lock import build_lock

logger = logging.getLogger("pagedserve.ops")

_SOURCES_CPU = (
    "bindings.cpp", "cpu/attention.cpp", "cpu/prefill_attention.cpp", "cpu/cache.cpp", "cpu/layernorm.cpp",
    "cpu/activation.cpp", "cpu/pos_encoding.cpp", "cpu/sampling.cpp", "cpu/small_gemm.cpp", "cpu/decode_layers.cpp",
    "cpu/q8_gemm.cpp", "cpu/kquant_gemm.cpp", "cpu/kquant_panel.cpp", "cpu/kquant_pack.cpp", "cpu/kquant_wide.cpp",
    "cpu/kquant_x16.cpp", "cpu/moe.cpp", "cpu/ggml_quantize.cpp",
)
_SOURCES_CUDA = (
    "cuda/attention_kernels.cu", "cuda/attention_f32.cu", "cuda/attention_f16.cu", "cuda/attention_bf16.cu",
    "cuda/cache_kernels.cu", "cuda/elementwise_kernels.cu", "cuda/torch_bindings.cpp",
)


class OpsBackend(str, enum.Enum):
    """Which implementation serves the ops."""

    COMPILED_CUDA = "compiled-cuda"  # C++ CPU ops + CUDA kernels
    COMPILED_CPU = "compiled-cpu"
    TORCH_REFERENCE = "torch-reference"



# Head sizes the CUDA paged-attention kernel is instantiated for (csrc/cuda/attention_kernels.cu).
CUDA_HEAD_SIZES = (64, 80, 96, 128, 256)


class BackendUnavailable(ValueError):
    """The device needs compiled ops that did not load (the message names the cause and the fix); a ValueError,
    so `pagedserve serve` reports it as a configuration that cannot work, without a traceback."""


_lock = threading.Lock()
_module = None
_backend: Optional[OpsBackend] = None
_cuda_missing: Optional[str] = None  # why the CUDA kernels are not in the loaded backend


def find_csrc() -> Optional[Path]:
    """csrc/ next to the engine package (source tree), else shipped as engine/_csrc or engine/csrc."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "csrc", here.parent / "_csrc"):
        if (candidate / "ops.h").is_file():
            return candidate
    return None


# The CPU kernel builds, least to most: each adds to the one before; the build's folder name holds it.
ISA_LEVELS = ("generic", "avx2", "avx512", "avx512bf16")


def isa_build(cpu_flags: set[str], wanted: str = "") -> tuple[str, list[str]]:
    """The kernel build (a name from ISA_LEVELS and its compiler flags) for a CPU with these /proc/cpuinfo flags:
    the most it has, or at most `wanted` (PAGEDSERVE_CPU_ISA), which never adds what the CPU lacks."""
    wanted = wanted.lower() or ISA_LEVELS[-1]
    if wanted not in ISA_LEVELS:
        raise ValueError(f"PAGEDSERVE_CPU_ISA={wanted!r}: expected one of {', '.join(ISA_LEVELS)}")
    cap = ISA_LEVELS.index(wanted)
    if not {"avx2", "fma", "f16c"} <= cpu_flags or cap < 1:
        return "generic", []
    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags or cap < 2:
        return "avx2", avx2
    avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if "avx512_bf16" in cpu_flags and cap >= 3:  # vdpbf16ps: bf16 dot products in the attention kernels
        return "avx512bf16", avx512 + ["-mavx512bf16"]
    return "avx512", avx512


def _cpu_isa_flags() -> tuple[str, list[str]]:
    # Targeted flags, not -march=native, so a cache built here stays valid on
    # any machine that has the same extensions (the ISA is part of the name).
    # PAGEDSERVE_CPU_ISA=avx2 builds an AVX2-only CPU's kernels on an AVX-512 machine: how a Zen 3 runs is
    # tested and measured there (`make test-avx2`, benchmarks/peers.sh ISA=avx2).
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        flags = set()
    return isa_build(flags, os.environ.get("PAGEDSERVE_CPU_ISA", ""))


def _cuda_build_blocker() -> Optional[str]:
    """None when the CUDA kernels should be built, else why not (in words a user can act on)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not Path(CUDA_HOME, "bin", "nvcc").exists():
        return (f"nvcc was not found (CUDA_HOME={CUDA_HOME}); install the CUDA toolkit of torch's CUDA "
                f"{torch.version.cuda} and put nvcc on PATH or set CUDA_HOME")
    return None


def _build(csrc: Path, with_cuda: bool):
    from torch.utils.cpp_extension import load

    isa, isa_flags = _cpu_isa_flags()
    sources = list(_SOURCES_CPU) + (list(_SOURCES_CUDA) if with_cuda else [])
    # The sources' folder is in the name too: torch's build.ninja holds absolute paths, so two checkouts sharing
    # one build folder would each rebuild what the other built.
    digest = hashlib.sha1(str(csrc.resolve()).encode())
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
    # load() under our lock as well as torch's: torch's is left behind by a killed build, then waited on forever.
    locked_load = build_lock(build_dir, float(os.environ.get("PAGEDSERVE_BUILD_TIMEOUT", "1800")))(load)
    return locked_load(
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
    global _module, _backend, _cuda_missing
    with _lock:
        if _backend is not None:
            return _module
        _module, _backend, _cuda_missing = _load_locked()
        return _module


def _load_locked():
    """(module, backend, why the CUDA kernels are missing or None)."""
    if os.environ.get("PAGEDSERVE_OPS_BACKEND", "").lower() == "torch":
        return None, OpsBackend.TORCH_REFERENCE, "PAGEDSERVE_OPS_BACKEND=torch forces the reference ops (unset it)"
    csrc = find_csrc()
    if csrc is None:
        logger.warning("pagedserve: csrc/ not found next to the engine package; using the "
                       "pure-torch reference ops (slow)")
        return None, OpsBackend.TORCH_REFERENCE, "csrc/ was not found next to the engine package (reinstall pagedserve)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("pagedserve: no C++ compiler found; using the pure-torch reference ops (slow)")
        return None, OpsBackend.TORCH_REFERENCE, "no C++ compiler was found (install g++ or set CXX)"
    cuda_missing = _cuda_build_blocker()
    for with_cuda in ([True, False] if cuda_missing is None else [False]):
        try:
            module = _build(csrc, with_cuda)
            return module, OpsBackend.COMPILED_CUDA if with_cuda else OpsBackend.COMPILED_CPU, cuda_missing
        except Exception as exc:  # a failed build must not take the engine down
            detail = f"{type(exc).__name__}: {str(exc)[-2000:]}"
            logger.warning("pagedserve: building the %s kernels failed (%s)", "CUDA" if with_cuda else "CPU", detail)
            if with_cuda:
                cuda_missing = (f"building the CUDA kernels failed ({detail.strip()[-600:]}); rebuild with "
                                "PAGEDSERVE_VERBOSE_BUILD=1 to see the compiler's output (nvcc and torch must "
                                "share one CUDA major version)")
    logger.warning("pagedserve: using the pure-torch reference ops (slow)")
    return None, OpsBackend.TORCH_REFERENCE, cuda_missing or "building the CPU kernels failed"


def backend() -> OpsBackend:
    """Which implementation the ops use (builds the kernels if not done yet)."""
    load()
    assert _backend is not None
    return _backend


def require_backend(device: torch.device | str) -> OpsBackend:
    """The backend an engine on `device` runs, logged; BackendUnavailable on a CUDA device without the compiled
    CUDA kernels (which a CPU engine does not need: there the reference is only slow)."""
    got = backend()
    device = torch.device(device)
    logger.info("pagedserve ops backend: %s (device %s)", got.value, device)
    if device.type == "cuda" and got is not OpsBackend.COMPILED_CUDA:
        raise BackendUnavailable(
            f"device=cuda needs pagedserve's compiled CUDA kernels, but the ops backend is {got.value}: "
            f"{_cuda_missing}. Fix that and restart, or run on the CPU with --device cpu."
        )
    return got


def check_attention_geometry(device: torch.device | str, num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """ValueError, at startup, for a model the paged-attention kernels of `device` cannot run."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"The model has {num_heads} attention heads and {num_kv_heads} key/value heads: "
                         "the heads must be a whole multiple of the key/value heads.")
    if torch.device(device).type == "cuda" and head_size not in CUDA_HEAD_SIZES:
        raise ValueError(f"The model's head size is {head_size}; the CUDA paged attention supports head sizes "
                         f"{', '.join(map(str, CUDA_HEAD_SIZES))}. Run it with --device cpu.")
