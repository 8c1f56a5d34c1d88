"""The weight-format registry (engine/model_executor/layers/formats.py): each GGML block type's dequantize() equals
gguf-py's (llama.cpp's dequantize_row_*) bit for bit on random blocks, its geometry is gguf's, and a linear given
parts of mixed formats (attach_quantized_linear) multiplies like its dequantized weight and says what it holds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from engine.model_executor.layers.formats import (FORMATS, attach_quantized_linear, format_of,  # noqa: E402
                                                  get_format, random_raw)

def random_rows(name: str, n: int, k: int, seed: int = 0, scale: float = 0.01) -> torch.Tensor:
    """n rows of k weights of a format: random codes and scales, finite float16 fields: uint8 [n, row_bytes]."""
    return random_raw(FORMATS[name], n, k, seed, scale)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_equals_gguf(name):
    fmt = FORMATS[name]
    raw = random_rows(name, 9, 3 * fmt.block_weights, seed=len(name))
    ref = gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).astype(np.float32)
    got = fmt.dequantize(raw)
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
    assert np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_geometry_is_gguf(name):
    fmt = FORMATS[name]
    qtype = gguf.GGMLQuantizationType[name]
    assert fmt.ggml_type == int(qtype)
    assert (fmt.block_weights, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[qtype]
    assert fmt.row_bytes(2 * fmt.block_weights) == 2 * fmt.block_bytes
    assert get_format(name) is fmt and get_format(int(qtype)) is fmt and get_format(qtype) is fmt
    assert get_format("IQ2_XS") is None and get_format("Q2_K") is None


def test_mixed_linear_multiplies_like_its_dequantized_weight():
    """A Q4_K_M file's qkv: q and k Q4_K, v Q6_K; the output rows are the parts' in order."""
    k = 512
    parts = [(FORMATS["Q4_K"], random_rows("Q4_K", 48, k, 1)), (FORMATS["Q4_K"], random_rows("Q4_K", 16, k, 2)),
             (FORMATS["Q6_K"], random_rows("Q6_K", 16, k, 3))]
    linear = nn.Linear(k, 80, bias=True)
    bias = linear.bias.detach().clone()
    attach_quantized_linear(linear, parts)
    assert linear.weight.numel() == 0
    assert [(f.name, n) for f, n in format_of(linear)] == [("Q4_K", 48), ("Q4_K", 16), ("Q6_K", 16)]
    w = torch.cat([f.dequantize(raw) for f, raw in parts]).double()
    for rows in (1, 5, 33):
        x = torch.randn(rows, k)
        ref = x.double() @ w.T + bias.double()
        torch.testing.assert_close(linear(x).double(), ref, atol=3e-2 * ref.abs().max().item(), rtol=0)
    assert format_of(nn.Linear(4, 4)) is None
