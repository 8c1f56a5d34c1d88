"""The load-time repack in C++ (csrc/cpu/kquant_pack.cpp) against its torch reference (formats.pack_kquant and
pack_parts with compiled=False, quant.pack_q8 for Q8_0), byte for byte: every GGML type the kernels read, N not a
multiple of the 16-column block (and enough blocks for two threads), K of 1 to 3 blocks, random codes and
sub-scales with finite float16 scales, rows with a stride, parts written at a row offset."""
from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.model_executor.layers import quant
from engine.model_executor.layers.formats import FORMATS, pack_kquant, pack_parts, pack_q8_parts, random_raw

pytestmark = pytest.mark.skipif(ops.kquant_gemm_isa() == 0, reason="no compiled kernels")
KQUANTS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = ((1, 1), (5, 3), (16, 2), (37, 1), (200, 1))  # (N, blocks along K); 200 rows: 13 column blocks, 2 threads


@pytest.mark.parametrize("name", KQUANTS + ["Q8_0"])
def test_compiled_pack_equals_the_torch_pack(name):
    fmt = FORMATS[name]
    for n, blocks in SHAPES:
        k = blocks * fmt.block_weights
        raw = random_raw(fmt, n, k, seed=n + blocks, scale=1e-3 if fmt.block_weights == 256 else 0.01)
        size = quant.q8_numel(n, k) if name == "Q8_0" else fmt.packed_bytes(n, k)
        got = torch.full((size,), 0xA5, dtype=torch.uint8)  # every byte must be written, padding included
        assert ops.kquant_pack(raw, fmt.ggml_type, got)
        if name == "Q8_0":
            q, d, _, _, _ = fmt.components(raw)
            ref = quant.pack_q8(q, d.half())
        else:
            ref = pack_kquant(fmt, raw, compiled=False)
        assert torch.equal(got, ref), (name, n, k)
        wide = torch.cat([raw, torch.zeros(n, 7, dtype=torch.uint8)], dim=1)  # rows 7 bytes apart from the next
        assert torch.equal(pack_kquant(fmt, wide[:, :raw.shape[1]]) if name != "Q8_0"
                           else pack_q8_parts([(fmt, wide[:, :raw.shape[1]])]), ref), (name, n, k, "strided")


@pytest.mark.parametrize("rows", [(32, 16, 7), (5, 11, 3)])
def test_q8_parts_of_one_weight_equal_one_pack(rows):
    """An all-Q8_0 qkv: parts written at their row offsets (or, where a part ends inside a column block, as one)."""
    fmt = FORMATS["Q8_0"]
    parts = [(fmt, random_raw(fmt, n, 64, seed=n)) for n in rows]
    assert torch.equal(pack_q8_parts(parts), pack_q8_parts(parts, compiled=False))


def test_mixed_blob_equals_the_torch_blob():
    """A Q4_K_M-like linear: Q4_K, Q6_K, Q5_0 and Q8_0 parts of odd rows, one blob."""
    k = 256
    parts = [(FORMATS[name], random_raw(FORMATS[name], n, k, seed=n, scale=1e-3))
             for name, n in (("Q4_K", 48), ("Q6_K", 19), ("Q5_0", 33), ("Q8_0", 21), ("Q5_K", 3))]
    assert torch.equal(pack_parts(parts), pack_parts(parts, compiled=False))


def test_bad_rows_and_sizes_are_refused():
    fmt = FORMATS["Q4_K"]
    raw = random_raw(fmt, 20, 256)
    out = torch.empty(fmt.packed_bytes(40, 256), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="row"):
        ops.kquant_pack(raw, fmt.ggml_type, out, row0=8, total_rows=40)  # not on a 16-row block
    with pytest.raises(RuntimeError, match="bytes"):
        ops.kquant_pack(raw, fmt.ggml_type, out[:-1], row0=16, total_rows=36)
    with pytest.raises(RuntimeError, match="no packed layout"):
        ops.kquant_pack(raw, 10, out)  # Q2_K
