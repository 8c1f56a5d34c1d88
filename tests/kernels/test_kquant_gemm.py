"""The GGML block-format GEMM (csrc/cpu/kquant_gemm.cpp) against its pure-torch reference (formats.ref_kquant_gemm: x
quantized per block (per 32 on the x16 panels) in two int8 parts as the kernel does, exact integer sums in float64) and
against the float product with llama.cpp's dequantization (fmt.dequantize), on every ISA path this build runs (plain
C++, AVX2, AVX-512, AVX-512 VNNI, and the dequantized panels a prefill takes; `make test-avx2` runs the AVX2 build's),
for each format, odd shapes (N not a multiple of the 16-column block, K of 1 to 3 blocks), 1 to 300 rows, float32 and
bfloat16, with a bias, mixed-format parts (a Q4_K_M qkv, a Q8_0 part among them), and the same bits on one and two
threads."""
from __future__ import annotations

import pytest
import torch

from engine import ops
from engine.model_executor.layers.formats import FORMATS, pack_parts, quantize_activations, ref_kquant_gemm
from kernels.conftest import torch_threads
from kernels.test_formats import random_rows

BEST = ops.kquant_gemm_isa()
pytestmark = pytest.mark.skipif(BEST == 0, reason="no compiled kquant_gemm")
TILES = [isa for isa in (ops.KQUANT_PLAIN, ops.KQUANT_AVX2, ops.KQUANT_AVX512, ops.KQUANT_VNNI) if isa <= BEST]
TILES += [ops.KQUANT_X16] if BEST >= ops.KQUANT_AVX2 else []  # the x16 panels: AVX2 registers, any SIMD build
ISAS = TILES + [ops.KQUANT_PANEL]
KQUANTS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
SCALE = {"Q4_K": 1e-3, "Q5_K": 1e-3, "Q6_K": 1e-4}  # float16 d: weights of order 0.1 to 1
# the tiles' row blocks (kquant_wide.cpp: 8, 4, 3, 2, 1 rows a tile; the int8 tiles: 4 or 2 rows of x) and their
# remainders: 6 = 4 + 2, 9 = 8 + 1, 11 = 8 + 3, 16 = 2 x 8 (AVX2: 4 x 4)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 33, 300)
X32_ROWS = 16  # from these rows x is scaled per 32 for every format (kquant_gemm.cpp kX32Rows)
# |out - x @ W^T| of the int8 tiles, over max(|x| @ |W|^T): x's two parts are within 1 / 64516 of each block's
# largest |x| (measured: at most 1.2e-5 here); one part (1 / 254, llama.cpp's Q8_K / Q8_0 activations) ~1.6e-3.
TWO_PART_BOUND = 4e-5
# The panels multiply bfloat16 x with bfloat16 panels where x and out are bfloat16 and the CPU has bfloat16 dot
# products (AVX-512 BF16: Zen 4 / 5, Sapphire Rapids on), else float32 ones (csrc/cpu/kquant_panel.cpp).
BF16_DOT = BEST >= ops.KQUANT_AVX512 and "avx512_bf16" in open("/proc/cpuinfo").read()


def _rows(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    return random_rows(name, n, k, seed, SCALE.get(name, 0.01))


def _float_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the dequantized model's product, float64
    return x.double() @ w.double().T


def _ref(x: torch.Tensor, fmt, raw: torch.Tensor, bias, isa: int) -> torch.Tensor:
    """The integer paths' reference: x in two int8 parts per fmt's block, per 32 on the x16 panels and from
    X32_ROWS rows (any format)."""
    per_32 = isa == ops.KQUANT_X16 or x.shape[0] >= X32_ROWS
    return ref_kquant_gemm(x, fmt, raw, bias, x_block=32 if per_32 else None)


def _check(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """float32 rounding of the block sums (each |D S1| + |M S2| at most a few |x| . |w|); bfloat16: one rounding."""
    bound = x.double().abs() @ w.double().abs().T
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * bound.max().item() + 1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * bound.max().item() + 1e-6, rtol=8e-3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_gemm_matches_reference(name, isa):
    fmt = FORMATS[name]
    for n, blocks in ((16, 1), (37, 2), (5, 3), (100, 1)):
        k = blocks * fmt.block_weights
        raw = _rows(name, n, k, seed=n + blocks)
        blob, w = pack_parts([(fmt, raw)]), fmt.dequantize(raw)
        gen = torch.Generator().manual_seed(n)
        for rows in ROWS if isa != ops.KQUANT_PLAIN or n < 50 else ROWS[:8]:
            x = torch.randn(rows, k, generator=gen)
            out = ops.kquant_gemm(torch.empty(rows, n), x, blob, None, isa)
            # the panels multiply the dequantized weights in float32: the float product is their reference
            _check(out, _float_ref(x, w) if isa == ops.KQUANT_PANEL else _ref(x, fmt, raw, None, isa), x, w)


@pytest.mark.parametrize("isa", TILES)
@pytest.mark.parametrize("name", KQUANTS)
def test_two_part_activations_track_the_float_product(name, isa):
    """The tiles' x in two int8 parts stays within TWO_PART_BOUND of the float product with llama.cpp's dequantized
    weights, a bound x in one part (the kernel before issue 53's fix) misses by far, checked here too."""
    fmt = FORMATS[name]
    k = 2 * fmt.block_weights
    raw = _rows(name, 53, k, seed=11)
    blob, w = pack_parts([(fmt, raw)]), fmt.dequantize(raw)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 7, 33):
        x = torch.randn(rows, k, generator=gen)
        bound = (x.double().abs() @ w.double().abs().T).max().item()
        out = ops.kquant_gemm(torch.empty(rows, 53), x, blob, None, isa)
        assert (out.double() - _float_ref(x, w)).abs().max().item() <= TWO_PART_BOUND * bound
        (xh, dx), _ = quantize_activations(x, fmt.block_weights)
        one_part = (xh.view(rows, -1, fmt.block_weights) * dx.unsqueeze(-1)).view(rows, k)
        assert (_float_ref(one_part, w) - _float_ref(x, w)).abs().max().item() > 5 * TWO_PART_BOUND * bound


def test_auto_takes_the_tiles_for_a_decode_step_and_the_panels_for_a_prefill():
    fmt = FORMATS["Q4_K"]
    raw = _rows("Q4_K", 40, 512, 3)
    blob = pack_parts([(fmt, raw)])
    # a float32 prefill: AVX2 the x16 panels; VNNI its tiles (never float32 panels there, as q8_gemm); else the panels
    prefill = {ops.KQUANT_AVX2: ops.KQUANT_X16, ops.KQUANT_VNNI: ops.KQUANT_VNNI}.get(BEST, ops.KQUANT_PANEL)
    cases = [(1, torch.float32, BEST), (300, torch.float32, prefill)]
    if BF16_DOT and BEST == ops.KQUANT_VNNI:
        cases.append((300, torch.bfloat16, ops.KQUANT_PANEL))  # bfloat16 panels where the CPU multiplies bfloat16
    for rows, dtype, path in cases:
        x = torch.randn(rows, 512).to(dtype)
        auto = ops.kquant_gemm(torch.empty(rows, 40, dtype=dtype), x, blob, None)
        assert torch.equal(auto, ops.kquant_gemm(torch.empty(rows, 40, dtype=dtype), x, blob, None, path))


@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_bias_and_strided_rows(isa):
    fmt = FORMATS["Q4_K"]
    n, k = 40, 512
    raw = _rows("Q4_K", n, k, 7)
    blob = pack_parts([(fmt, raw)])
    bias = torch.randn(n)
    wide = torch.randn(6, k + 24).bfloat16()
    x = wide[:, 8:8 + k]  # rows k + 24 apart
    ref = _ref(x.float(), fmt, raw, bias, isa)
    w = fmt.dequantize(raw)
    if isa == ops.KQUANT_PANEL and BF16_DOT:  # bfloat16 panels: the weights rounded to bfloat16 are the reference
        ref16 = x.double() @ w.bfloat16().double().T + bias.bfloat16().double()
    else:
        ref16 = _ref(x.float(), fmt, raw, bias.bfloat16().float(), isa)
    _check(ops.kquant_gemm(torch.empty(6, n, dtype=torch.bfloat16), x, blob, bias.bfloat16(), isa), ref16,
           x.float(), w)
    _check(ops.kquant_gemm(torch.empty(6, n), x, blob, bias, isa), ref, x.float(), fmt.dequantize(raw))


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_parts_write_their_columns(isa):
    """A Q4_K_M qkv (q, k Q4_K; v Q6_K) with a Q8_0 and a Q5_0 part after it: each part's columns are its own
    product (a Q8_0 part goes through q8_gemm, whose reference is the float product)."""
    k = 512
    names = [("Q4_K", 64), ("Q4_K", 21), ("Q6_K", 16), ("Q8_0", 19), ("Q5_0", 3)]
    if ops.q8_gemm_isa() == 0:  # a plain C++ build (PAGEDSERVE_CPU_ISA=generic) has no q8_gemm
        names.remove(("Q8_0", 19))
    parts = [(FORMATS[name], _rows(name, n, k, i)) for i, (name, n) in enumerate(names)]
    blob = pack_parts(parts)
    bias = torch.randn(sum(n for _, n in names))
    for rows in (1, 7, 8, 40):  # 8, 40: VNNI takes the wide tiles for the Q6_K part only
        x = torch.randn(rows, k)
        out = ops.kquant_gemm(torch.empty(rows, bias.numel()), x, blob, bias, isa)
        col = 0
        for fmt, raw in parts:
            n = raw.shape[0]
            w = fmt.dequantize(raw)
            if fmt.name == "Q8_0":
                ref = x.double() @ w.double().T + bias[col:col + n].double()
                torch.testing.assert_close(out[:, col:col + n].double(), ref, atol=2e-2, rtol=2e-2)
            else:
                _check(out[:, col:col + n], _ref(x, fmt, raw, bias[col:col + n], isa), x, w)
            col += n


@pytest.mark.parametrize("isa", TILES)  # the panels' bits are oneDNN's, whose sums may split by thread count
def test_same_bits_on_one_and_two_threads(isa):
    fmt = FORMATS["Q6_K"]
    raw = _rows("Q6_K", 250, 512, 9)  # 16 column blocks, the last partial
    blob = pack_parts([(fmt, raw)])
    for rows in (1, 5, 64):
        x = torch.randn(rows, 512)
        outs = []
        for threads in (1, 2):
            with torch_threads(threads):
                outs.append(ops.kquant_gemm(torch.empty(rows, 250), x, blob, None, isa))
        assert torch.equal(outs[0], outs[1])


def test_a_path_this_build_lacks_is_refused():
    blob = pack_parts([(FORMATS["Q4_0"], _rows("Q4_0", 16, 32, 0))])
    with pytest.raises(RuntimeError, match="ISA path"):
        ops.kquant_gemm(torch.empty(1, 16), torch.randn(1, 32), blob, None, 9)
