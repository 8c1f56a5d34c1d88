"""Shared helpers for the kernel tests: devices, random paged caches, block tables."""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine import ops

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]


@pytest.fixture(scope="session", autouse=True)
def compiled_ops():
    """Builds the kernels once; a test run that silently used the reference would prove nothing."""
    backend = ops.backend()
    assert backend is not ops.OpsBackend.TORCH_REFERENCE, "compiled ops unavailable (see the build warning)"
    # Without the CUDA kernels, ops.py runs CUDA tensors through the reference: the CUDA tests would
    # compare the reference with itself and pass.
    if torch.cuda.is_available():
        assert backend is ops.OpsBackend.COMPILED_CUDA, "CUDA is visible but the CUDA kernels did not build"
    return backend


def tolerances(dtype: torch.dtype) -> dict:
    """Kernel and reference both accumulate in float32; the gap is output rounding."""
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=1e-3, rtol=1e-3),
        torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    }[dtype]


def random_block_tables(context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint, shuffled physical blocks per sequence, padded with block 0: [num_seqs, max_blocks] int32."""
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    max_blocks = max(max(needed), 1)
    assert sum(needed) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    start = 0
    for i, k in enumerate(needed):
        tables[i, :k] = perm[start:start + k].to(torch.int32)
        start += k
    return tables


@contextlib.contextmanager
def torch_threads(n: int):
    """torch.set_num_threads(n) for the block (the compiled ops share torch's OpenMP pool)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
