"""rms_norm, fused_add_rms_norm, rms_norm_heads, silu_and_mul, gelu_tanh_and_mul and rotary_embedding equal their
pure-torch references.

Shapes cover decode batches (one thread), prefill-sized ones (the OpenMP path) and the
strided views the model passes (q/k heads inside the fused qkv output, rows of a wider tensor).
"""
from __future__ import annotations

import pytest
import torch

from engine import ops

from engine.ops import reference as ref_ops
from tests.kernels.conftest import tolerances

DTYPES = [torch.float32, torch.bfloat16]
# (num_tokens, hidden): decode, odd sizes (vector tails), and past ops' one-thread limit (2^18 elements).
ROW_SHAPES = [(1, 64), (7, 100), (32, 576), (300, 1024)]


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **tolerances(actual.dtype))
    if actual.dtype == torch.bfloat16:  # same float32 math and roundings: nearly every value is bit-equal (exp may differ by an ulp)
        assert (actual == expected).float().mean().item() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", ROW_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, strided):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    wide = randn((num_tokens, hidden + (16 if strided else 0)), dtype, gen, scale=3.0)
    x = wide[:, :hidden]  # strided: rows of a wider tensor
    weight = randn((hidden,), dtype, gen)
    out = ops.rms_norm(torch.empty(num_tokens, hidden, dtype=dtype), x, weight, 1e-6)
    expected = ref_ops.ref_rms_norm(torch.empty_like(out), x, weight, 1e-6)
    assert_matches(out, expected)
    # An oracle independent of the reference: float64 formula.
    x64 = x.double()
    exact = weight.double() * x64 / x64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(out.double(), exact, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", ROW_SHAPES)
def test_fused_add_rms_norm_matches_reference(dtype, num_tokens, hidden):
    gen = torch.Generator().manual_seed(7 + num_tokens)
    x, residual = randn((num_tokens, hidden), dtype, gen), randn((num_tokens, hidden), dtype, gen, scale=4.0)
    weight = randn((hidden,), dtype, gen)
    ref_x, ref_residual = x.clone(), residual.clone()
    expected_sum = residual + x
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_ops.ref_fused_add_rms_norm(ref_x, ref_residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the stream is the plain sum, rounded once
    assert_matches(x, ref_x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (5, 37), (32, 1536), (128, 1536)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, d):
    gen = torch.Generator().manual_seed(d + num_tokens)
    x = randn((num_tokens, 2 * d), dtype, gen, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0], dtype=dtype)  # exp's clamped range and zero
    out = ops.silu_and_mul(torch.empty(num_tokens, d, dtype=dtype), x)
    expected = ref_ops.ref_silu_and_mul(torch.empty_like(out), x)
    assert_matches(out, expected)
    assert torch.isfinite(out).all()


def test_silu_and_mul_on_strided_rows():
    gen = torch.Generator().manual_seed(3)
    wide = randn((9, 2 * 48 + 8), torch.float32, gen)
    x = wide[:, : 2 * 48]
    buffer = torch.full((9, 64), 5.0)
    out = buffer[:, :48]  # writes only its own columns
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :48]) * x[:, 48:], **tolerances(torch.float32))
    assert (buffer[:, 48:] == 5.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (5, 37), (128, 1536)])
def test_gelu_tanh_and_mul_matches_reference(dtype, num_tokens, d):
    """Gemma's gated MLP: torch's F.gelu(gate, approximate="tanh") * up, with tanh through the kernels' exp."""
    gen = torch.Generator().manual_seed(11 + d + num_tokens)
    x = randn((num_tokens, 2 * d), dtype, gen, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, -8.5, 0.0], dtype=dtype)  # tanh's saturated ends and zero
    out = ops.gelu_tanh_and_mul(torch.empty(num_tokens, d, dtype=dtype), x)
    expected = ref_ops.ref_gelu_tanh_and_mul(torch.empty_like(out), x)
    torch.testing.assert_close(out, expected, **tolerances(dtype))
    if dtype == torch.float32:  # float32: within a few ulps of torch's own formula
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_size", [(1, 4, 2, 64), (7, 9, 3, 100), (300, 8, 2, 128)])
def test_rms_norm_heads_in_place_on_fused_qkv(dtype, num_tokens, heads, kv_heads, head_size):
    """Qwen3's and Gemma 3's q/k norms: each head vector of the q and k views inside the fused qkv output normed in
    place, v untouched."""
    gen = torch.Generator().manual_seed(num_tokens * heads + head_size)
    qkv = randn((num_tokens, (heads + 2 * kv_heads) * head_size), dtype, gen, scale=3.0)
    heads_view = qkv.view(num_tokens, heads + 2 * kv_heads, head_size)
    q, k, v = heads_view[:, :heads], heads_view[:, heads:heads + kv_heads], heads_view[:, heads + kv_heads:]
    q_weight, k_weight = randn((head_size,), dtype, gen), randn((head_size,), dtype, gen)
    expected_q, expected_k, v_before = q.clone(), k.clone(), v.clone()
    ref_ops.ref_rms_norm_heads(expected_q, q_weight, 1e-6)
    ref_ops.ref_rms_norm_heads(expected_k, k_weight, 1e-6)
    ops.rms_norm_heads(q, q_weight, 1e-6)
    ops.rms_norm_heads(k, k_weight, 1e-6)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(v, v_before)


def rope_table(max_len: int, head_size: int) -> torch.Tensor:  # [max_len, head_size] float32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_size", [(1, 9, 3, 64), (6, 4, 4, 32), (130, 9, 3, 64), (2100, 8, 2, 128)])
def test_rotary_embedding_in_place_on_fused_qkv(dtype, num_tokens, heads, kv_heads, head_size):
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = randn((num_tokens, (heads + 2 * kv_heads) * head_size), dtype, gen)
    table = rope_table(4096, head_size)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    original, expected_qkv = qkv.clone(), qkv.clone()
    width = (heads + kv_heads) * head_size
    qk = qkv[:, :width].view(num_tokens, heads + kv_heads, head_size)  # strided view into the fused output
    ops.rotary_embedding(positions, qk, table)
    ref_ops.ref_rotary_embedding(positions, expected_qkv[:, :width].view(num_tokens, heads + kv_heads, head_size), table)
    assert_matches(qkv, expected_qkv)
    assert torch.equal(qkv[:, width:], original[:, width:])  # v untouched
    # Independent oracle: each (x1, x2) pair is a complex number rotated by position * freq, in float64.
    half = head_size // 2
    x = original[:, :width].view(num_tokens, heads + kv_heads, head_size).double()
    angle = torch.atan2(table[positions, half:].double(), table[positions, :half].double())[:, None]
    rotated = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    exact = torch.cat([rotated.real, rotated.imag], dim=-1)
    tol = dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qk.double(), exact, **tol)


def test_rotary_embedding_rejects_positions_past_the_table():
    table = rope_table(16, 32)
    x = torch.randn(2, 3, 32)
    with pytest.raises(RuntimeError, match="outside the cos/sin table"):
        ops.rotary_embedding(torch.tensor([3, 16]), x, table)


# ---- CUDA kernels (one launch each) against the same references, on the same CUDA tensors.

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# --use_fast_math: exp and rsqrt are a few float32 ulps off torch's.
CUDA_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def cuda_randn(shape, dtype, gen, scale=1.0):
    return randn(shape, dtype, gen, scale).cuda()


@pytest.fixture
def cuda_kernels():
    """The CUDA tests prove nothing if the reference served them."""
    assert ops.backend() is ops.OpsBackend.COMPILED_CUDA, "the CUDA kernels did not build"


@CUDA
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", ROW_SHAPES + [(3, 4096)])
def test_cuda_rms_norm_and_fused_add_match_reference(cuda_kernels, dtype, num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = cuda_randn((num_tokens, hidden + 8), dtype, gen, scale=3.0)[:, :hidden]  # strided rows
    weight = cuda_randn((hidden,), dtype, gen)
    out = ops.rms_norm(torch.empty(num_tokens, hidden, dtype=dtype, device="cuda"), x, weight, 1e-6)
    torch.testing.assert_close(out, ref_ops.ref_rms_norm(torch.empty_like(out), x, weight, 1e-6), **CUDA_TOL[dtype])
    x, residual = cuda_randn((num_tokens, hidden), dtype, gen), cuda_randn((num_tokens, hidden), dtype, gen, 4.0)
    ref_x, ref_residual = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_ops.ref_fused_add_rms_norm(ref_x, ref_residual, weight, 1e-5)
    assert torch.equal(residual, ref_residual)  # the plain sum, rounded once
    torch.testing.assert_close(x, ref_x, **CUDA_TOL[dtype])


@CUDA
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (5, 37), (128, 1536)])
def test_cuda_silu_and_mul_matches_reference(cuda_kernels, dtype, num_tokens, d):
    gen = torch.Generator().manual_seed(d)
    x = cuda_randn((num_tokens, 2 * d + 4), dtype, gen, scale=4.0)[:, : 2 * d]
    x[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0], dtype=dtype)
    out = ops.silu_and_mul(torch.empty(num_tokens, d, dtype=dtype, device="cuda"), x)
    expected = ref_ops.ref_silu_and_mul(torch.empty_like(out), x)
    torch.testing.assert_close(out, expected, **CUDA_TOL[dtype])
    assert torch.isfinite(out).all()


@CUDA
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_size", [(1, 9, 3, 64), (130, 8, 2, 128), (7, 4, 4, 80)])
def test_cuda_rotary_embedding_matches_reference(cuda_kernels, dtype, num_tokens, heads, kv_heads, head_size):
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = cuda_randn((num_tokens, (heads + 2 * kv_heads) * head_size), dtype, gen)
    table = rope_table(4096, head_size).cuda()
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).cuda()
    original, expected = qkv.clone(), qkv.clone()
    width = (heads + kv_heads) * head_size
    ops.rotary_embedding(positions, qkv[:, :width].view(num_tokens, heads + kv_heads, head_size), table)
    ref_ops.ref_rotary_embedding(positions, expected[:, :width].view(num_tokens, heads + kv_heads, head_size), table)
    torch.testing.assert_close(qkv, expected, **CUDA_TOL[dtype])
    assert torch.equal(qkv[:, width:], original[:, width:])  # v untouched
