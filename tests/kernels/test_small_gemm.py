"""The small-row GEMM (csrc/cpu/small_gemm.cpp) equals F.linear for every ISA path this CPU can run (the AVX2 one
forced on an AVX-512 machine too), both dtypes, odd shapes (N not a multiple of 16, odd K), with and without bias,
strided rows, and one and two threads; and a packed linear sends small row counts to it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import ops
from engine.model_executor.layers.cpu_linear import SMALL_ROWS, pack_linears, pack_small_rows, packed_dtypes, small_rows_available
from kernels.conftest import torch_threads

BEST = ops.small_gemm_isa()
pytestmark = pytest.mark.skipif(BEST == 0, reason="the compiled kernels have no small-row GEMM path on this CPU")

ISAS = [isa for isa in (ops.SMALL_GEMM_AVX2, ops.SMALL_GEMM_AVX512, ops.SMALL_GEMM_AVX512_BF16) if isa <= BEST]
DTYPES = [torch.float32, torch.bfloat16]
# (N, K): a block multiple, N and K odd, N under one block, SmolLM2-like widths.
SHAPES = [(64, 32), (37, 33), (5, 8), (200, 96), (1536, 576)]


def _tolerance(dtype: torch.dtype, k: int) -> dict:
    # float32: summation order only. bfloat16: one output rounding (2^-8 relative) plus summation order.
    return dict(atol=1e-5 * k ** 0.5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


def _expected(x, weight, bias):
    return nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_small_gemm_matches_f_linear(isa, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = pack_small_rows(weight)
    # Up to 4 rows the one-pass tiles; above, the taller tiles (8 rows; 6 on AVX2), whole and partial.
    for rows in (1, 2, 3, 4, 5, 8, 13, 16, 17, 24, 29, 70):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias):
            out = ops.small_gemm(torch.empty(rows, n, dtype=dtype), x, packed, b, isa)
            torch.testing.assert_close(out, _expected(x, weight, b), **_tolerance(dtype, k))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_gemm_splits_columns_over_threads(isa, dtype):
    gen = torch.Generator().manual_seed(7)
    n, k = 1000, 64  # 63 blocks: an uneven split, the last block partial
    weight = torch.randn(n, k, generator=gen).to(dtype)
    packed = pack_small_rows(weight)
    for rows in (3, 12, 40, 300):  # one-pass tiles, tall tiles (a decode batch, a prefill), several row chunks
        x = torch.randn(rows, k, generator=gen).to(dtype)
        outs = []
        for threads in (1, 2):
            with torch_threads(threads), ops.thread_omp_threads(threads):
                outs.append(ops.small_gemm(torch.empty(rows, n, dtype=dtype), x, packed, None, isa))
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)  # each column summed by one thread, in order
        torch.testing.assert_close(outs[0], _expected(x, weight, None), **_tolerance(dtype, k))


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != ops.SMALL_GEMM_AVX512_BF16])
def test_small_gemm_rounds_bfloat16_as_torch_does(isa):
    """The paths that widen bfloat16 sum in float32 in the float32 kernel's order: their bfloat16 output is that
    float32 result rounded to nearest even, bit for bit (the vector epilogue against torch's rounding), bias
    included; a NaN input gives NaN where torch's would."""
    gen = torch.Generator().manual_seed(11)
    n, k = 200, 96  # 12 full blocks and a partial one
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed16, packed32 = pack_small_rows(weight), pack_small_rows(weight.float())
    for rows in (1, 4, 5, 16, 17, 40):  # the one-pass tiles and the tall tiles
        x = torch.randn(rows, k, generator=gen).bfloat16()
        x[0, 3] = float("nan")
        for b in (None, bias):
            got = ops.small_gemm(torch.empty(rows, n, dtype=torch.bfloat16), x, packed16, b, isa)
            wide = ops.small_gemm(torch.empty(rows, n), x.float(), packed32, None if b is None else b.float(), isa)
            want = wide.bfloat16()
            nan = want.isnan()
            assert nan[0].all() and not nan[1:].any()
            assert torch.equal(got.isnan(), nan)
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_gemm_reads_strided_rows_and_writes_strided_out(dtype):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    wide = torch.randn(4, 100, generator=gen).to(dtype)
    x = wide[:, 10:50]  # rows 100 apart
    out_wide = torch.zeros(4, 70, dtype=dtype)
    ops.small_gemm(out_wide[:, 5:53], x, pack_small_rows(weight))
    torch.testing.assert_close(out_wide[:, 5:53], _expected(x, weight, None), **_tolerance(dtype, 40))
    assert out_wide[:, :5].abs().sum() == 0 and out_wide[:, 53:].abs().sum() == 0  # nothing past the columns


def test_small_gemm_refuses_what_it_cannot_serve():
    packed = pack_small_rows(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.small_gemm(torch.empty(2, 32, dtype=torch.bfloat16), torch.randn(2, 16).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="packed weight has"):
        ops.small_gemm(torch.empty(2, 32), torch.randn(2, 17), packed)
    with pytest.raises(RuntimeError, match="not in this build"):
        ops.small_gemm(torch.empty(2, 32), torch.randn(2, 16), packed, None, BEST + 1)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        pack_small_rows(torch.randn(4, 4, dtype=torch.float16))


# Every code that names no path this build has: past the best, between the codes, negative, huge.
NOT_PATHS = sorted({BEST + 1, BEST + 2, 1, -1, -4, 5, 64, 2 ** 31, 2 ** 62, -(2 ** 63)}
                   - {ops.SMALL_GEMM_AUTO, *ISAS})


@pytest.mark.parametrize("isa", NOT_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_gemm_refuses_every_isa_code_it_does_not_have(isa, dtype):
    """An `isa` outside the paths of this build is refused ("not in this build") by both kernels before anything
    is read or written, even when the tensors are wrong too; the output stays untouched."""
    packed = pack_small_rows(torch.randn(32, 16).to(dtype))
    x = torch.randn(3, 16).to(dtype)
    for glu, n in ((False, 32), (True, 16)):
        call = ops.small_gemm_glu if glu else ops.small_gemm
        out = torch.full((3, n), float("nan"), dtype=dtype)
        with pytest.raises(RuntimeError, match="not in this build"):
            call(out, x, packed, None, isa)
        assert out.isnan().all()
        with pytest.raises(RuntimeError, match="not in this build"):  # the isa is checked first
            call(torch.empty(3, n + 1, dtype=dtype), x, packed, None, isa)


@pytest.mark.skipif(not small_rows_available(), reason="PAGEDSERVE_SMALL_ROW_LINEAR=0")
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in packed_dtypes()])
def test_packed_linear_uses_the_small_row_kernel_up_to_small_rows(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    layer = nn.Linear(96, 200, bias=True, dtype=dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    pack_linears(nn.Sequential(layer))
    calls = []
    real = ops.small_gemm
    monkeypatch.setattr(ops, "small_gemm", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    for rows in (1, 4, SMALL_ROWS, SMALL_ROWS + 1, 40):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        torch.testing.assert_close(layer(x), _expected(x, weight, bias), **_tolerance(dtype, 96))
    if layer._packed_weight is None:  # the small-row kernel serves every row count (engine/model_executor/layers/cpu_linear.py)
        assert calls == [1, 4, SMALL_ROWS, SMALL_ROWS + 1, 40]
    else:
        assert calls == [1, 4, SMALL_ROWS]  # more rows go to oneDNN


def _glu_reference(x, packed, bias, n, isa):
    """small_gemm into [gate | up], then silu_and_mul: the two calls small_gemm_glu fuses."""
    gate_up = ops.small_gemm(torch.empty(x.shape[0], 2 * n, dtype=x.dtype), x, packed, bias, isa)
    return ops.silu_and_mul(torch.empty(x.shape[0], n, dtype=x.dtype), gate_up)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 64), (48, 33), (1536, 576)])  # (N, K): odd K, SmolLM2's MLP
def test_small_gemm_glu_equals_gemm_then_silu_and_mul_bit_for_bit(isa, dtype, shape):
    """The fused gate/up tiles give the same bits as the two kernels they replace (csrc/cpu/decode_layers.cpp
    relies on it: the compiled step equals the eager one), on one and two threads; a path without fused tiles
    (AVX2) says so and leaves the output untouched."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(2 * n, k, generator=gen).to(dtype) / k ** 0.5  # gate rows, then up rows
    bias = torch.randn(2 * n, generator=gen).to(dtype)
    packed = pack_small_rows(weight)
    for rows in (1, 3, 4, 5, 8, 13, 17, 40, 130):  # one-pass tiles, tall tiles (partial too), two row chunks
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias):
            want = _glu_reference(x, packed, b, n, isa)
            for threads in (1, 2):
                got = torch.full((rows, n), float("nan"), dtype=dtype)
                with torch_threads(threads), ops.thread_omp_threads(threads):
                    fused = ops.small_gemm_glu(got, x, packed, b, isa)
                assert fused == (isa >= ops.SMALL_GEMM_AVX512)
                if fused:
                    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                else:
                    assert got.isnan().all()


def test_small_gemm_glu_declines_a_split_block_and_refuses_bad_shapes():
    packed = pack_small_rows(torch.randn(2 * 40, 16))  # N = 40: gate and up meet inside a 16-column block
    out = torch.full((3, 40), float("nan"))
    assert ops.small_gemm_glu(out, torch.randn(3, 16), packed) is False
    assert out.isnan().all()
    with pytest.raises(RuntimeError, match="packed weight has"):  # a weight of N columns, not 2N
        ops.small_gemm_glu(torch.empty(3, 80), torch.randn(3, 16), packed)
    with pytest.raises(RuntimeError, match="bias has"):
        ops.small_gemm_glu(torch.empty(3, 40), torch.randn(3, 16), packed, torch.randn(40))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(64, 32), (37, 33), (1000, 64)])
def test_small_gemm_writes_a_bfloat16_result_widened_to_float32(isa, shape):
    """A float32 out of a bfloat16 GEMM (the head's logits) holds exactly the bfloat16 result, widened: the
    values of a bfloat16 out followed by .float(), NaN where that has NaN."""
    n, k = shape
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = pack_small_rows(weight)
    for rows in (1, 4, 5, 17, 40):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        x[-1, 0] = float("nan")
        for b in (None, bias):
            want = ops.small_gemm(torch.empty(rows, n, dtype=torch.bfloat16), x, packed, b, isa).float()
            got = ops.small_gemm(torch.empty(rows, n), x, packed, b, isa)
            assert torch.equal(got.isnan(), want.isnan()) and got[-1].isnan().all()
            assert torch.equal(got[:-1], want[:-1])
    with pytest.raises(RuntimeError, match="share one dtype"):  # the other way round is no widening
        ops.small_gemm(torch.empty(2, n, dtype=torch.bfloat16), torch.randn(2, k), pack_small_rows(weight.float()))


@pytest.mark.skipif(not small_rows_available(), reason="PAGEDSERVE_SMALL_ROW_LINEAR=0")
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in packed_dtypes()])
def test_forward_float32_equals_linear_then_float(dtype):
    """cpu_linear.forward_float32 (the head's logits) gives linear(x).float() at every row count, from the kernel
    directly where it serves bfloat16 rows."""
    from engine.model_executor.layers.cpu_linear import forward_float32

    gen = torch.Generator().manual_seed(9)
    layer = nn.Linear(96, 200, bias=False, dtype=dtype)
    pack_linears(nn.Sequential(layer))
    for rows in (1, 7, SMALL_ROWS + 1, 40):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got = forward_float32(layer, x)
        assert got.dtype == torch.float32 and torch.equal(got, layer(x).float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 33), (1000, 64), (49152, 64)])  # (N, K): a partial block, a vocabulary
def test_small_gemm_argmax_lse_equals_the_logits_stats(isa, dtype, shape):
    """The greedy head without logits: per row the argmax and max of small_gemm's float32 output (bit for bit: the
    same tiles write the same values) and its logsumexp (summed in another order), on one and two threads, at the
    one-pass and the tall tiles' row counts, with and without bias."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = pack_small_rows(weight)
    for rows in (1, 4, 5, 40, 256):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for b in (None, bias):
            logits = ops.small_gemm(torch.empty(rows, n), x, packed, b, isa)
            want_arg, want_lse = ops.ref_argmax_logsumexp(logits)
            for threads in (1, 2):
                with torch_threads(threads), ops.thread_omp_threads(threads):
                    arg, best, lse = ops.small_gemm_argmax_lse(x, packed, n, b, isa)
                assert torch.equal(arg, want_arg)
                assert torch.equal(best, logits.gather(1, want_arg.unsqueeze(1)).squeeze(1))
                torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_small_gemm_argmax_lse_keeps_the_first_of_equal_maxima(isa):
    """torch.argmax's tie rule across the kernel's panels: a vocabulary whose rows repeat every 48 columns has its
    largest output ~1000 times per row; the first one wins whichever thread reduced which panel."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).repeat(1024, 1)  # [49152, 64]
    packed = pack_small_rows(weight)
    x = torch.randn(256, 64, generator=gen)
    want = x.mm(weight[:48].t()).argmax(dim=-1)
    for threads in (1, 2):
        with torch_threads(threads), ops.thread_omp_threads(threads):
            arg, _, _ = ops.small_gemm_argmax_lse(x, packed, weight.shape[0], None, isa)
        assert torch.equal(arg, want)


def test_small_gemm_argmax_lse_refuses_what_it_cannot_serve():
    packed = pack_small_rows(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="packed weight has"):
        ops.small_gemm_argmax_lse(torch.randn(3, 16), packed, 80)
    with pytest.raises(RuntimeError, match="must be positive"):
        ops.small_gemm_argmax_lse(torch.randn(3, 16), packed, 0)
    with pytest.raises(RuntimeError, match="bias has"):
        ops.small_gemm_argmax_lse(torch.randn(3, 16), packed, 40, torch.randn(41))
    arg, best, lse = ops.small_gemm_argmax_lse(torch.randn(0, 16), packed, 40)  # no rows: nothing to do
    assert arg.shape == best.shape == lse.shape == (0,)
