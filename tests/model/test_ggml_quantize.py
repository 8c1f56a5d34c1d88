"""engine/model_executor/layers/ggml_quantize.py (issue 53): float weights into GGUF block bytes.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the bytes gguf-py's quantizer writes, byte for byte. Q4_K, Q5_K, Q6_K: libggml's own
bytes from csrc/cpu/ggml_quantize.cpp (checked where llama.cpp is built), and from either path (gguf-py has no
quantizer for them): gguf-py dequantizes our bytes back within the error llama.cpp's make_qkx2_quants /
make_qx_quants reach (measured against libggml's quantize_row_*_ref on the same weights: relative RMS error
0.0964 / 0.0487 / 0.0260 for ours and llama.cpp's alike, 2048-wide rows of N(0, 0.02) with every 7th weight x4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model_executor.layers.ggml_quantize import BLOCKS, fallback_type, quantize_rows, row_bytes


def _weights(k: int = 512, rows: int = 48) -> torch.Tensor:
    """Gaussian rows with the corner cases: zeros, a constant row, one-signed rows, ties of |max|, an outlier."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, k, generator=g) * 0.05
    w[0] = 0
    w[1, :64] = 0
    w[2] = 0.25
    w[3] = w[3].abs()
    w[4] = -w[4].abs()
    w[5, :32] = torch.tensor([0.5, -0.5] * 16)  # two equal magnitudes: the first one's sign is the scale's
    w[6, 7] = 4.0
    w[7] = w[7].bfloat16().float() * 1e-3
    return w


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_legacy_blocks_are_gguf_pys_bytes(name):
    import gguf

    w = _weights()
    ours = quantize_rows(w, name)
    assert ours.shape == (w.shape[0], row_bytes(name, w.shape[1])) and ours.dtype == torch.uint8
    expected = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(ours.numpy(), expected)
    # any float dtype in: quantized from its float32 value
    np.testing.assert_array_equal(quantize_rows(w.bfloat16(), name).numpy(),
                                  gguf.quants.quantize(w.bfloat16().float().numpy(), gguf.GGMLQuantizationType[name]))


@pytest.mark.parametrize("name, bound", [("Q4_K", 0.085), ("Q5_K", 0.043), ("Q6_K", 0.022), ("Q4_0", 0.11)])
def test_k_quant_bytes_dequantize_back_within_their_error(name, bound):
    """gguf-py reads our bytes: Gaussian rows come back within the type's relative RMS error; zero rows as zeros,
    a constant row within half a step; Q4_K beats Q4_0 (its per-32 min and searched scale)."""
    import gguf

    w = _weights(k=1024, rows=64)
    raw = quantize_rows(w, name)
    back = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name])).view_as(w)
    gauss = slice(8, None)
    rel = float(((back[gauss] - w[gauss]) ** 2).mean().sqrt() / w[gauss].std())
    assert rel < bound, rel
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    assert torch.equal(back[1, :64], torch.zeros(64))
    assert (back[2] - 0.25).abs().max() < 0.25 / 14
    assert (back[6, 7] - 4.0).abs() < 4.0 / 14
    assert torch.isfinite(back).all()


def test_k_quant_layout_per_super_block():
    """A 256-weight row is one block: Q4_K 144 bytes, Q5_K 176, Q6_K 210; the float16 d sits where gguf-py reads
    it (Q4_K / Q5_K first, Q6_K last), and the levels use the whole range (a 4-bit row of a ramp holds 0 and 15)."""
    ramp = torch.linspace(-1, 1, 256).view(1, 256)
    for name, nbytes in (("Q4_K", 144), ("Q5_K", 176), ("Q6_K", 210)):
        raw = quantize_rows(ramp, name)
        assert raw.shape == (1, nbytes) and BLOCKS[name] == (256, nbytes)
    q4 = quantize_rows(ramp, "Q4_K")[0]
    nibbles = torch.cat([q4[16:] & 0xF, q4[16:] >> 4])
    assert int(nibbles.min()) == 0 and int(nibbles.max()) == 15
    d = q4[:2].view(torch.float16).float()
    assert 0 < float(d) < 1


def test_fallback_types_are_llama_cpps():
    assert fallback_type("Q4_K", 576) == "Q5_0" and fallback_type("Q4_K", 1536) == "Q4_K"
    assert fallback_type("Q5_K", 576) == "Q5_1" and fallback_type("Q6_K", 576) == "Q8_0"
    assert fallback_type("Q4_0", 576) == "Q4_0"
    with pytest.raises(ValueError):
        fallback_type("Q4_0", 100)
    with pytest.raises(ValueError):
        quantize_rows(torch.zeros(2, 100), "Q4_K")


K_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
LIBGGML = sorted(__import__("pathlib").Path.home().glob(".cache/pagedserve/llama.cpp-*/build/bin/libggml-base.so"))


def _compiled_or_skip():
    from engine import ops

    if ops.backend() is not ops.OpsBackend.COMPILED_CPU:
        pytest.skip("needs the compiled CPU ops (csrc/cpu/ggml_quantize.cpp)")


@pytest.mark.parametrize("name", sorted(K_TYPES))
def test_k_quants_in_cpp_match_the_torch_port(name):
    """csrc/cpu/ggml_quantize.cpp (the default where the kernels are built) against the torch port: the same
    blocks but where the port's pairwise sums flip a near-tie between two candidate scales (9 % of Q4_K blocks
    here), and the same error."""
    _compiled_or_skip()
    w = _weights(k=1024, rows=64)
    fast, port = quantize_rows(w, name), quantize_rows(w, name, compiled=False)
    assert fast.shape == port.shape and fast.dtype == torch.uint8
    per_block = BLOCKS[name][1]
    same = (fast.view(-1, per_block) == port.view(-1, per_block)).all(dim=1).float().mean()
    assert same > 0.85, float(same)  # measured: Q4_K 91 %
    import gguf

    kind = gguf.GGMLQuantizationType[name]
    errors = [float(((torch.from_numpy(gguf.quants.dequantize(raw.numpy(), kind)).view_as(w) - w)[8:] ** 2).mean())
              for raw in (fast, port)]
    assert errors[0] < errors[1] * 1.01, errors


@pytest.mark.skipif(not LIBGGML, reason="llama.cpp's libggml-base is not built (benchmarks/peers.sh builds it)")
@pytest.mark.parametrize("name", sorted(K_TYPES))
def test_k_quants_are_llama_quantizes_bytes(name):
    """The C++ quantizer writes libggml's own bytes (ggml_quantize_chunk without an imatrix: quantize_row_*_ref,
    what llama-quantize writes), block for block."""
    import ctypes

    _compiled_or_skip()
    lib = ctypes.CDLL(str(LIBGGML[-1]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    w = _weights(k=1024, rows=64)
    w[8::7] *= 4  # outliers in some rows
    x = np.ascontiguousarray(w.numpy())
    expected = np.zeros(w.shape[0] * row_bytes(name, w.shape[1]), dtype=np.uint8)
    lib.ggml_quantize_chunk(K_TYPES[name], x.ctypes.data, expected.ctypes.data, 0, w.shape[0], w.shape[1], None)
    np.testing.assert_array_equal(quantize_rows(w, name).numpy().ravel(), expected)
