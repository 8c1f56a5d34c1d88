"""The int8 GEMM (csrc/cpu/q8_gemm.cpp) equals its pure-torch reference (engine/model_executor/layers/quant.py ref_q8_gemm) on every ISA
path this CPU runs (AVX2 forced on an AVX-512 machine too; `make test-avx2` runs them as an AVX2-only
CPU's build), float32 and bfloat16 in and out, odd shapes (N not a
multiple of 16, K not of 32), every tile height, with and without bias, strided rows, one and two threads; and
quantize_q8_0 writes the bytes llama.cpp's gguf-py writes for a Q8_0 tensor."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import ops
from engine.model_executor.layers.quant import (QK, dequantize_q8_0, pack_q8, q8_file_rows, q8_numel, q8_rows,
                                                quantize_activations, quantize_q8_0, ref_q8_gemm)
from kernels.conftest import torch_threads

BEST = ops.q8_gemm_isa()
pytestmark = pytest.mark.skipif(BEST == 0, reason="the compiled kernels have no int8 GEMM path on this CPU")

# X16: the x16 panels (csrc/cpu/kquant_x16.cpp, AVX2 registers: any SIMD build), AVX2's prefill path
X16 = [ops.Q8_GEMM_X16] if BEST >= ops.Q8_GEMM_AVX2 else []
ISAS = [isa for isa in (ops.Q8_GEMM_AVX2, ops.Q8_GEMM_AVX512, ops.Q8_GEMM_VNNI) if isa <= BEST]
ISAS += X16 + [ops.Q8_GEMM_PANEL]
# The paths that split x per 32-block into two int8 parts and sum exactly in int32 (AVX2 and X16: vpmaddwd, VNNI:
# vpdpbusd).
TWO_PARTS = [isa for isa in (ops.Q8_GEMM_AVX2, ops.Q8_GEMM_VNNI) if isa <= BEST] + X16
# (N, K): whole blocks, N and K ragged, N under one block, SmolLM2's and the 1B model's widths.
SHAPES = [(64, 64), (37, 70), (5, 32), (200, 1000), (1536, 576), (256, 2048)]
# The panel path multiplies bfloat16 x with bfloat16 panels into bfloat16 rows where the CPU has bfloat16 dot
# products and the kernels are built with AVX-512 (not for an AVX2 CPU: PAGEDSERVE_CPU_ISA=avx2).
BF16_DOT = BEST >= ops.Q8_GEMM_AVX512 and "avx512_bf16" in open("/proc/cpuinfo").read()
ROWS = (1, 2, 3, 4, 5, 6, 7, 12, 13, 70, 130)  # one-pass tiles (<= 4), tall tiles whole and partial, two row chunks


def _ref(x, q, d, bias, isa, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    panel_bf16 = isa == ops.Q8_GEMM_PANEL and x.dtype == out_dtype == torch.bfloat16 and BF16_DOT
    return ref_q8_gemm(x, q, d, bias, quantized_x=isa in TWO_PARTS,
                       weight_dtype=torch.bfloat16 if panel_bf16 else torch.float32)


def _check(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    if out.dtype == torch.float32:  # summation order only
        torch.testing.assert_close(out.double(), ref, atol=2e-5 * k ** 0.5, rtol=1e-5)
    else:  # plus one rounding to bfloat16
        torch.testing.assert_close(out.double(), ref, atol=2e-2 * k ** 0.5 / 8, rtol=1.6e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_q8_gemm_matches_reference(isa, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
    packed = pack_q8(q, d)
    bias = torch.randn(n, generator=gen).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias):
            out = ops.q8_gemm(torch.empty(rows, n, dtype=dtype), x, packed, b, isa)
            _check(out, _ref(x, q, d, b, isa), k)


@pytest.mark.parametrize("isa", ISAS)
def test_q8_gemm_tall_batches(isa):
    """A prefill's row counts on every path (the panels' default starts at a few dozen rows; the tiles serve them when
    forced or where the panels are off): ragged shapes, 129 and 300 rows (3 row chunks, a partial tile)."""
    for n, k in ((37, 70), (200, 1000)):
        gen = torch.Generator().manual_seed(n + k)
        q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
        packed = pack_q8(q, d)
        for rows in (129, 300):
            x = torch.randn(rows, k, generator=gen)
            _check(ops.q8_gemm(torch.empty(rows, n), x, packed, None, isa), _ref(x, q, d, None, isa), k)


@pytest.mark.parametrize("isa", ISAS)
def test_q8_gemm_bfloat16_in_float32_out_and_strided_rows(isa):
    n, k = 100, 96
    gen = torch.Generator().manual_seed(3)
    q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
    packed = pack_q8(q, d)
    wide = torch.randn(9, k + 40, generator=gen).bfloat16()
    x = wide[:, 8:8 + k]  # rows k + 40 apart
    out = ops.q8_gemm(torch.empty(9, n), x, packed, None, isa)  # a head's logits: float32 from bfloat16
    _check(out, _ref(x, q, d, None, isa, torch.float32), k)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != ops.Q8_GEMM_PANEL])  # torch's GEMM: no such promise
def test_q8_gemm_same_bits_on_one_and_two_threads(isa):
    n, k = 1000, 256  # 63 blocks: an uneven split, the last block partial
    gen = torch.Generator().manual_seed(5)
    packed = pack_q8(*quantize_q8_0(torch.randn(n, k, generator=gen)))
    for rows in (1, 3, 12, 300):
        x = torch.randn(rows, k, generator=gen)
        outs = []
        for threads in (1, 2):
            with torch_threads(threads), ops.thread_omp_threads(threads):
                outs.append(ops.q8_gemm(torch.empty(rows, n), x, packed, None, isa))
        assert torch.equal(outs[0], outs[1])


def test_q8_gemm_is_close_to_the_float_product():
    """What a user sees: int8 weights (and, on VNNI, x in two int8 parts) move a linear's output by well under 1 %
    of its scale for Gaussian weights and inputs."""
    n, k = 512, 1024
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(4, k, generator=gen)
    out = ops.q8_gemm(torch.empty(4, n), x, pack_q8(*quantize_q8_0(w)), None)
    exact = x @ w.T
    assert ((out - exact).norm() / exact.norm()).item() < 0.01


def test_pack_q8_in_row_ranges_equals_one_pack():
    """The GGUF loader packs a weight a chunk of rows at a time into one buffer (row0 / total_rows), from strided
    [N, KB, 32] views of the file's blocks: the bytes equal one pack of the whole weight, ragged last block included."""
    n, k = 37 + 64, 96
    gen = torch.Generator().manual_seed(4)
    q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
    whole = pack_q8(q, d)
    blocks = torch.cat([d.view(torch.uint8).view(n, k // QK, 2), q.view(torch.uint8).view(n, k // QK, QK)], dim=-1)
    qv, dv = blocks[..., 2:].view(torch.int8), blocks[..., :2].view(torch.float16).squeeze(-1)
    out = torch.zeros_like(whole)
    for r0, r1 in ((0, 32), (32, 48), (48, n)):
        pack_q8(qv[r0:r1], dv[r0:r1], out, row0=r0, total_rows=n)
    assert torch.equal(out, whole)
    with pytest.raises(ValueError, match="16-row blocks"):
        pack_q8(qv[8:24], dv[8:24], out, row0=8, total_rows=n)


def test_q8_gemm_rejects_a_wrong_weight():
    q, d = quantize_q8_0(torch.randn(48, 64))
    packed = pack_q8(q, d)
    with pytest.raises(RuntimeError, match="packed weight has"):
        ops.q8_gemm(torch.empty(1, 64), torch.randn(1, 64), packed, None)  # 4 blocks, not 3
    with pytest.raises(RuntimeError, match="uint8"):
        ops.q8_gemm(torch.empty(1, 48), torch.randn(1, 64), packed.view(torch.int8), None)


def test_quantize_q8_0_writes_gguf_py_bytes():
    """The blocks of `--quantization int8` are the ones llama.cpp's converter writes for --outtype q8_0."""
    gguf = pytest.importorskip("gguf")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen)
    w[3, 32:64] = 0  # a block of zeros: d = 0
    w[5, :32] = torch.arange(32) / 31 * 127 * 0.5  # ties at .5: rounded away from zero
    q, d = quantize_q8_0(w)
    raw = gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)  # [40, 3 * 34] bytes
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(40, 3, 34)
    assert torch.equal(blocks[..., :2].contiguous().view(torch.float16).view(40, 3), d)
    assert torch.equal(blocks[..., 2:].contiguous().view(torch.int8).view(40, 96), q)


def test_pack_q8_round_trips_rows():
    n, k = 45, 70  # padded to 48 columns and 96 k
    gen = torch.Generator().manual_seed(2)
    q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
    packed = pack_q8(q, d)
    assert packed.numel() == q8_numel(n, k) == 3 * 3 * 16 * (QK + 2)
    ids = torch.tensor([[0, 44], [16, 17]])
    torch.testing.assert_close(q8_rows(packed, ids, n, k), dequantize_q8_0(q, d, k)[ids], rtol=0, atol=0)


def _peak_rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) >> 10


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_pack_q8_temporaries_stay_small():
    """Packing a down_proj-wide weight (K 8192) adds little to the process's peak beyond its output: the load of a
    1B Q8_0 GGUF peaks at the end, packing the head, so every packing temporary is on top of the whole model."""
    n, k = 2048, 8192
    q = torch.ones(n, k, dtype=torch.int8)  # 16 MiB
    d = torch.ones(n, k // QK, dtype=torch.float16)
    out = torch.ones(q8_numel(n, k), dtype=torch.uint8)  # touched: resident before the peak is reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _peak_rss_mib()
    pack_q8(q, d, out)
    assert _peak_rss_mib() - before <= 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_file_rows_equal_the_packed_rows(dtype):
    """Rows gathered from Q8_0 blocks as a GGUF file lays them out (float16 d, 32 int8 q) equal those of the packed
    copy, bit for bit (the mapped token embedding and the packed one give a model the same numbers)."""
    n, k = 45, 96
    q, d = quantize_q8_0(torch.randn(n, k, generator=torch.Generator().manual_seed(3)))
    blocks = torch.cat([d.view(n, 3, 1).view(torch.uint8), q.view(n, 3, 32).view(torch.uint8)], -1).view(n, 3 * 34)
    ids = torch.tensor([[0, 44, 7], [16, 17, 16]])
    torch.testing.assert_close(q8_file_rows(blocks, ids, k, dtype), q8_rows(pack_q8(q, d), ids, n, k, dtype),
                               rtol=0, atol=0)


@pytest.mark.parametrize("isa", [ops.Q8_GEMM_AUTO] + TWO_PARTS)
def test_q8_gemm_default_tracks_the_float_product(isa):
    """The default path (two int8 parts of x on AVX2 and VNNI CPUs, x in float32 on AVX-512 without VNNI), and each
    two-part path forced, moves a linear's output on outlier-heavy rows by a small fraction of what rounding x to
    bfloat16 moves it; one int8 part alone (llama.cpp's Q8_0 x Q8_0 dot), which moved SmolLM2's greedy outputs
    (csrc/cpu/q8_gemm.cpp), moves it further than bfloat16."""
    n, k = 96, 320
    gen = torch.Generator().manual_seed(9)
    q, d = quantize_q8_0(torch.randn(n, k, generator=gen))
    x = torch.randn(3, k, generator=gen) * torch.linspace(0.01, 10, k)  # outlier-heavy rows
    out = ops.q8_gemm(torch.empty(3, n), x, pack_q8(q, d), None, isa)
    exact = ref_q8_gemm(x, q, d, None)
    err = (out.double() - exact).abs().max().item()
    bf16_err = (ref_q8_gemm(x.bfloat16().float(), q, d, None) - exact).abs().max().item()
    xh, _, dx = quantize_activations(x)
    one_part_err = (ref_q8_gemm((xh * dx.unsqueeze(-1)).flatten(1)[:, :k], q, d, None) - exact).abs().max().item()
    assert err < bf16_err / 20, (err, bf16_err)
    assert one_part_err > bf16_err, (one_part_err, bf16_err)