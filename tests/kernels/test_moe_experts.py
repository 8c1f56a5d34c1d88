"""The fused mixture-of-experts op (csrc/cpu/moe.cpp) equals its pure-torch reference (engine/ops/reference.py
ref_moe, HF's per-expert loop) over the packed experts of engine/model_executor/layers/moe.py: float32, bfloat16
and Q8_0 (int8) weights, 1 to 64 rows, top-1/2/8 of 8 or 16 experts, experts no token chose (never read: their
packed weights are NaN here), and the router's softmax / top-k / renormalisation against HF's arithmetic; a GGUF's
K-quant experts in their own blocks (attach_gguf_experts: Q4_K gate | up over Q6_K down, Q5_0 over Q8_0, Q8_0 over
Q5_K) on every kquant_gemm path, against the dequantized experts in float32, and the bytes moe_bytes_read counts."""
from __future__ import annotations

import functools

import pytest
import torch

from engine import ops
from engine.distributed.group import TPGroup
from engine.model_executor.layers.formats import FORMATS
from engine.model_executor.layers.ggml_quantize import quantize_rows
from engine.model_executor.layers.moe import MoEArgs, MoEMLP, attach_gguf_experts, pack_experts
from engine.model_executor.layers.quant import dequantize_q8_0, q8_available, quantize_q8_0
from engine.ops.reference import ref_moe

pytestmark = pytest.mark.skipif(ops.small_gemm_isa() == 0, reason="no compiled small-row kernels on this CPU")

HIDDEN, INTER = 64, 48  # INTER not a multiple of 16: the float path's glu falls back to gemm + silu_and_mul


def _layer(experts: int, top_k: int, dtype: torch.dtype, inter: int = INTER, seed: int = 0) -> MoEMLP:
    gen = torch.Generator().manual_seed(seed)
    args = MoEArgs(experts, top_k, inter, renormalize=True, round_weights=True, sparse_layers=(True,))
    layer = MoEMLP(HIDDEN, args, dtype, TPGroup.single())
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(experts, HIDDEN, generator=gen))
        layer.w13.copy_(torch.randn(experts, 2 * inter, HIDDEN, generator=gen) * 0.1)
        layer.w2.copy_(torch.randn(experts, HIDDEN, inter, generator=gen) * 0.1)
    return layer


def _fused(layer: MoEMLP, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    return ops.moe_experts(out, x, ids, weights, *layer.packed, layer.inter)


@pytest.mark.parametrize("dtype,quantized", [(torch.float32, False), (torch.bfloat16, False),
                                             (torch.float32, True), (torch.bfloat16, True)])
@pytest.mark.parametrize("experts,top_k,inter", [(8, 2, INTER), (16, 8, 64), (8, 1, 32)])
def test_fused_equals_reference(dtype, quantized, experts, top_k, inter):
    if quantized and not q8_available():
        pytest.skip("no int8 kernels")
    layer = _layer(experts, top_k, dtype, inter)
    w13, w2 = layer.w13.detach().clone(), layer.w2.detach().clone()
    if quantized:  # the reference multiplies the Q8_0 weights, dequantized
        w13 = torch.stack([dequantize_q8_0(*quantize_q8_0(w), HIDDEN) for w in w13]).to(dtype)
        w2 = torch.stack([dequantize_q8_0(*quantize_q8_0(w), inter) for w in w2]).to(dtype)
    assert pack_experts(layer, quantized) == 1 and layer.w13.numel() == 0
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 7, 16, 33, 64):
        x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        ids, weights = layer.route(x)
        ref = ref_moe(x.float(), ids, weights, w13.float(), w2.float())
        tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 and not quantized else dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(_fused(layer, x, ids, weights).float(), ref, **tol)
        # The layer's forward runs the fused op with the router in C++ (moe_route): the same choice wherever the
        # k-th and (k+1)-th probabilities differ (bfloat16 logits tie often; which of equal ones wins is the sort's)
        probs = torch.softmax(layer.gate(x).float(), dim=-1).sort(dim=-1, descending=True).values
        clear = probs[:, top_k - 1] > probs[:, top_k] if top_k < experts else torch.ones(rows, dtype=torch.bool)
        torch.testing.assert_close(layer(x).float()[clear], ref[clear], **tol)


def test_unchosen_experts_are_never_read():
    layer = _layer(8, 2, torch.float32)
    w13 = layer.w13.detach().clone()
    w2 = layer.w2.detach().clone()
    pack_experts(layer, False)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])  # experts 1, 2, 4, 6, 7 get no rows
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]])
    for e in (1, 2, 4, 6, 7):
        layer.packed[0][e].fill_(float("nan"))
        layer.packed[1][e].fill_(float("nan"))
    x = torch.randn(3, HIDDEN)
    out = _fused(layer, x, ids, weights)
    torch.testing.assert_close(out, ref_moe(x, ids, weights, w13, w2), atol=2e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="out of"):
        _fused(layer, x, torch.tensor([[0, 8], [1, 2], [3, 4]]), weights)


def test_cpp_router_equals_torch():
    """moe_forward's router (softmax, top-k, renormalised, rounded) picks the experts and weights route() does."""
    layer = _layer(16, 4, torch.float32, 32)
    pack_experts(layer, False)
    x = torch.randn(40, HIDDEN)
    ids, weights = layer.route(x)
    torch.testing.assert_close(layer(x), _fused(layer, x, ids, weights), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("renormalize,round_weights", [(True, False), (False, True)])
def test_router_matches_hf(renormalize, round_weights):
    """Mixtral's router (renormalised, float32 weights) and Qwen3-MoE's without norm_topk_prob (rounded)."""
    args = MoEArgs(8, 2, INTER, renormalize, round_weights, (True,))
    layer = MoEMLP(HIDDEN, args, torch.bfloat16, TPGroup.single())
    torch.nn.init.normal_(layer.gate.weight)
    x = torch.randn(5, HIDDEN, dtype=torch.bfloat16)
    ids, weights = layer.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x, layer.gate.weight).float(), dim=-1)
    top, idx = torch.topk(probs, 2, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    if round_weights:
        top = top.to(torch.bfloat16).float()
    assert torch.equal(ids, idx) and torch.equal(weights, top) and weights.dtype == torch.float32


KQ_ISAS = [isa for isa in (ops.KQUANT_PLAIN, ops.KQUANT_AVX2, ops.KQUANT_AVX512, ops.KQUANT_VNNI)
           if isa <= ops.kquant_gemm_isa()] + [ops.KQUANT_PANEL]
# |out - the float product| of kquant_gemm over |x| @ |W|^T: its two int8 parts carry x to 1 / 64516 of each block's
# largest |x| (tests/kernels/test_kquant_gemm.py TWO_PART_BOUND, measured 1.2e-5), float32 rounding besides.
TWO_PART_BOUND = 4e-5


@functools.lru_cache(maxsize=None)  # one layer per type mix, shared by its ISA paths (read-only)
def _kquant_experts(kinds: tuple[str, str, str], experts: int, hidden: int, inter: int, seed: int = 0):
    """An 8-expert layer whose gate / up / down experts are `kinds`' blocks of random weights (the C++ / gguf-py
    quantizers), attached as a GGUF's are, and those blocks dequantized (float32 w13 [E, 2 inter, hidden], w2)."""
    gen = torch.Generator().manual_seed(seed)
    args = MoEArgs(experts, 2, inter, renormalize=True, round_weights=False, sparse_layers=(True,))
    layer = MoEMLP(hidden, args, torch.float32, TPGroup.single())
    raws = [quantize_rows(torch.randn(experts * n, k, generator=gen) * 0.1, kind)
            for kind, (n, k) in zip(kinds, ((inter, hidden), (inter, hidden), (hidden, inter)))]
    attach_gguf_experts(layer, *[(FORMATS[kind], raw) for kind, raw in zip(kinds, raws)])
    gate, up, down = (FORMATS[kind].dequantize(raw) for kind, raw in zip(kinds, raws))
    w13 = torch.cat([gate.view(experts, inter, hidden), up.view(experts, inter, hidden)], dim=1)
    return layer, w13, down.view(experts, hidden, inter)


def _bound(x, ids, weights, w13, w2):
    """Per output, a bound of what the activations' int8 parts can move it: each linear's error within
    TWO_PART_BOUND * |in| @ |W|^T, the gate | up's carried through silu(g) * u (|d/dg| <= 1.1 |u|, |d/du| =
    |silu(g)|) into down's input, then down's own."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = x[token] @ w13[e].T
        dh = TWO_PART_BOUND * (x[token].abs() @ w13[e].abs().T)
        g, u = h[:, :inter], h[:, inter:]
        act = torch.nn.functional.silu(g) * u
        dact = 1.1 * u.abs() * dh[:, :inter] + torch.nn.functional.silu(g).abs() * dh[:, inter:]
        dy = dact @ w2[e].abs().T + TWO_PART_BOUND * (act.abs() @ w2[e].abs().T)
        out.index_add_(0, token, dy * weights[token, slot, None])
    return out


@pytest.mark.skipif(ops.kquant_gemm_isa() == 0, reason="no compiled kquant_gemm")
@pytest.mark.parametrize("isa", KQ_ISAS)
@pytest.mark.parametrize("kinds,hidden,inter", [(("Q4_K", "Q4_K", "Q6_K"), 256, 256),
                                                (("Q5_0", "Q5_0", "Q8_0"), 64, 96),
                                                (("Q8_0", "Q8_0", "Q5_K"), 64, 256)])
def test_kquant_experts_equal_dequantized_reference(kinds, hidden, inter, isa):
    """A Q4_K_M file's experts (Q4_K gate | up blobs, Q6_K down), Q5_0 blobs over Q8_0 (uint8) down rows, Q8_0
    gate | up over Q5_K: moe_experts on each kquant_gemm path equals ref_moe over the dequantized blocks in float32,
    within the int8 activations' bound; each expert chosen is counted once, at its packed bytes."""
    experts = 8
    layer, w13, w2 = _kquant_experts(kinds, experts, hidden, inter)
    a13, a2 = layer.packed
    assert a13.dtype == (torch.uint8 if kinds[0] == "Q8_0" else torch.int8)
    assert a2.dtype == (torch.uint8 if kinds[2] == "Q8_0" else torch.int8)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, hidden, generator=gen)
        ids, weights = layer.route(x)
        ops.moe_bytes_read(reset=True)
        got = ops.moe_experts(torch.empty_like(x), x, ids, weights, a13, a2, inter, isa)
        assert ops.moe_bytes_read(reset=True) == len(torch.unique(ids)) * (a13[0].nbytes + a2[0].nbytes)
        ref = ref_moe(x, ids, weights, w13, w2)
        bound = _bound(x, ids, weights, w13, w2)
        err = (got - ref).abs()
        assert (err <= bound + 1e-5 * bound.max() + 1e-6).all(), (rows, (err / bound).max().item())
    # bfloat16 activations through the default path: one bfloat16 rounding per linear
    xb = torch.randn(5, hidden, generator=gen).bfloat16()
    ids, weights = layer.route(xb.float())
    got = ops.moe_experts(torch.empty_like(xb), xb, ids, weights, a13, a2, inter)
    torch.testing.assert_close(got.float(), ref_moe(xb.float(), ids, weights, w13, w2), atol=3e-2, rtol=3e-2)
