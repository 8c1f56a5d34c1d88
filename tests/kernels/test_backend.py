"""Which ops backend an engine gets: a CUDA engine refuses to start without the compiled CUDA kernels.

The loader's decision and refusal run for real; what this CPU machine cannot have is simulated inside
them: a visible GPU with nvcc, or a CUDA build that fails. The CPU build is the one this session already
made (compiled_ops), handed back instead of rebuilt.
"""
from __future__ import annotations

import logging

import pytest
import torch

from engine.ops import build as ops_loader
from engine.ops.build import BackendUnavailable, OpsBackend


CUDA_MISMATCH = ("The detected CUDA version (12.8) mismatches the version that was used to compile PyTorch (13.0). "
                 "Please make sure to use the same CUDA versions.")  # what torch's cpp_extension raises


@pytest.fixture
def fresh_loader(monkeypatch, compiled_ops):
    """The loader as in a new process whose CUDA build fails; the session's loaded module comes back afterwards."""
    session_module = ops_loader.load()

    def build(csrc, with_cuda):
        if with_cuda:
            raise RuntimeError(CUDA_MISMATCH)
        return session_module

    monkeypatch.setattr(ops_loader, "_build", build)
    monkeypatch.setattr(ops_loader, "_module", None)
    monkeypatch.setattr(ops_loader, "_backend", None)
    monkeypatch.setattr(ops_loader, "_cuda_missing", None)
    monkeypatch.delenv("PAGEDSERVE_OPS_BACKEND", raising=False)
    return monkeypatch


def test_cuda_refuses_when_the_cuda_build_fails(fresh_loader, caplog):
    fresh_loader.setattr(ops_loader, "_cuda_build_blocker", lambda: None)  # as on a GPU machine with nvcc
    with pytest.raises(BackendUnavailable, match=r"(?s)backend is compiled-cpu: building the CUDA kernels failed "
                                                 r".*CUDA version \(12\.8\) mismatches.*--device cpu"):
        ops_loader.require_backend("cuda")
    # The CPU kernels still loaded, and a CPU engine starts on them, saying so.
    with caplog.at_level(logging.INFO, logger="pagedserve.ops"):
        assert ops_loader.require_backend("cpu") is OpsBackend.COMPILED_CPU
    assert "pagedserve ops backend: compiled-cpu (device cpu)" in caplog.text


def test_cuda_refuses_without_nvcc(fresh_loader, tmp_path):
    # A CUDA torch that sees a GPU, and a CUDA_HOME without nvcc: the real decision function decides.
    fresh_loader.setattr(torch.cuda, "is_available", lambda: True)
    fresh_loader.setattr(torch.version, "cuda", "13.0")
    import torch.utils.cpp_extension as cpp_extension

    fresh_loader.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    with pytest.raises(BackendUnavailable, match=r"nvcc was not found \(CUDA_HOME=.*\); install the CUDA toolkit"):
        ops_loader.require_backend(torch.device("cuda", 0))


def test_cuda_refuses_the_forced_reference(fresh_loader):
    fresh_loader.setenv("PAGEDSERVE_OPS_BACKEND", "torch")
    with pytest.raises(BackendUnavailable, match="torch-reference: PAGEDSERVE_OPS_BACKEND=torch forces"):
        ops_loader.require_backend("cuda")
    assert ops_loader.require_backend("cpu") is OpsBackend.TORCH_REFERENCE  # slow, but a CPU engine may use it


def test_this_machine_says_why_it_has_no_cuda_kernels(fresh_loader):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailable, match="torch sees no CUDA GPU|is a CPU-only build"):
        ops_loader.require_backend("cuda")


def test_startup_rejects_attention_shapes_the_kernels_cannot_run():
    ops_loader.check_attention_geometry("cpu", 4, 2, 16)  # the CPU kernel takes any head size
    ops_loader.check_attention_geometry("cuda", 32, 8, 128)
    with pytest.raises(ValueError, match="head size is 16; the CUDA paged attention supports head sizes 64, 80"):
        ops_loader.check_attention_geometry("cuda", 4, 2, 16)
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="6 attention heads and 4 key/value heads"):
            ops_loader.check_attention_geometry(device, 6, 4, 64)


def test_a_kernel_build_for_less_than_the_cpu_has_never_adds_an_isa():
    # PAGEDSERVE_CPU_ISA=avx2 on an AVX-512 machine builds what an AVX2-only CPU (Zen 3) runs: `make test-avx2`.
    avx2 = {"avx2", "fma", "f16c"}
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert ops_loader.isa_build(zen4) == ("avx512bf16", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                                                         "-mavx512vl", "-mavx512dq", "-mavx512bf16"])
    assert ops_loader.isa_build(zen4, "avx512")[0] == "avx512"
    assert ops_loader.isa_build(zen4, "AVX2") == ("avx2", ["-mavx2", "-mfma", "-mf16c"])
    assert ops_loader.isa_build(zen4, "generic") == ("generic", [])
    assert ops_loader.isa_build(avx2, "avx512bf16")[0] == "avx2"  # a cap, never a request for what is missing
    assert ops_loader.isa_build(set(), "avx2") == ("generic", [])
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='sse4'"):
        ops_loader.isa_build(zen4, "sse4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_runs_on_the_torch_reference(fresh_loader, dtype):
    """ops.small_gemm and small_gemm_glu serve on the forced reference backend (as every op in ops.py does), with
    the compiled kernel's results: odd N and K, a bias, a bfloat16 GEMM widened into a float32 out."""
    from engine import ops
    from engine.model_executor.layers.cpu_linear import pack_small_rows

    gen = torch.Generator().manual_seed(1)
    n, k, rows = 37, 33, 5
    weight, bias = torch.randn(2 * n, k, generator=gen).to(dtype), torch.randn(2 * n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = pack_small_rows(weight)
    outs = []
    for forced in ("", "torch"):
        fresh_loader.setattr(ops_loader, "_backend", None)
        fresh_loader.setenv("PAGEDSERVE_OPS_BACKEND", forced)
        want_backend = OpsBackend.TORCH_REFERENCE if forced else OpsBackend.COMPILED_CPU
        assert ops_loader.backend() is want_backend
        gemm = ops.small_gemm(torch.empty(rows, 2 * n, dtype=dtype), x, packed, bias)
        wide = ops.small_gemm(torch.empty(rows, 2 * n), x, packed, bias) if dtype == torch.bfloat16 else gemm
        glu = torch.full((rows, n), float("nan"), dtype=dtype)
        fused = ops.small_gemm_glu(glu, x, packed, bias)  # N = 37: the compiled kernel declines a split block
        assert fused is (ops.small_gemm_isa() == 0)  # the reference fuses (so on a build without the kernel too)
        outs.append((gemm, wide, glu))
    (gemm, wide, _), (ref_gemm, ref_wide, ref_glu) = outs
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(ref_gemm, gemm, **tol)
    assert ref_wide.dtype == torch.float32 and torch.equal(ref_wide, ref_gemm.float())
    torch.testing.assert_close(ref_glu, ops.silu_and_mul(torch.empty(rows, n, dtype=dtype), ref_gemm), **tol)
    with pytest.raises(RuntimeError, match="not in this build"):
        ops.small_gemm(torch.empty(rows, 2 * n, dtype=dtype), x, packed, bias, ops.SMALL_GEMM_AVX2)
    with pytest.raises(RuntimeError, match="packed weight has"):
        ops.small_gemm(torch.empty(rows, 2 * n, dtype=dtype), x[:, :-2], packed)
