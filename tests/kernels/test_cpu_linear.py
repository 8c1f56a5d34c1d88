"""Prepacked oneDNN linears (engine/cpu_linear.py) equal F.linear for every row count, the padded ones included."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu_linear import EXACT_ROWS, bucket_rows, pack_linears, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200, bias=bias, dtype=dtype))
    assert pack_linears(model) == 1
    layer = model[0]
    # Exact row counts, ones on a bucket and ones between buckets (padded).
    for rows in (1, 7, EXACT_ROWS, EXACT_ROWS + 1, 33, 100, 256, 257, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        out = layer(x)
        assert out.shape == (rows, 200) and out.is_contiguous() and out.dtype == dtype
        expected = nn.functional.linear(x, layer.weight, layer.bias)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, expected, **tol)


def test_padding_rows_do_not_leak_into_the_output():
    torch.manual_seed(1)
    layer = nn.Linear(32, 8, bias=True)
    pack_linears(nn.Sequential(layer))
    x = torch.randn(257, 32)
    out = layer(x)
    # Each row depends on its own input only: the same rows alone give the same values.
    torch.testing.assert_close(out[:5], layer(x[:5]), atol=1e-5, rtol=1e-5)
    assert out.shape[0] == 257


def test_row_buckets_are_few_and_tight():
    buckets = {bucket_rows(r) for r in range(1, 2049)}
    assert len(buckets) <= 80  # one oneDNN primitive per bucket and layer shape
    for rows in range(1, 2049):
        b = bucket_rows(rows)
        assert rows <= b <= rows * 1.125 and bucket_rows(b) == b
    assert [bucket_rows(r) for r in (16, 17, 32, 33, 1500, 2048)] == [16, 18, 32, 36, 1536, 2048]
