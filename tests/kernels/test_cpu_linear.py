"""Prepacked linears (engine/model_executor/layers/cpu_linear.py) equal F.linear for every row count, the padded ones included, and
hold their weights once: the original is released, and a head tied to the embedding is held once (the embedding
reads its rows from the head's small-row copy)."""
from __future__ import annotations

import copy
import os
import weakref

import pytest
import torch
from torch import nn

from engine.model_executor.layers import cpu_linear
from engine.model_executor.layers.attention import AttentionMetadata, PrefillSpan
from engine.model_executor.layers.cpu_linear import (EXACT_ROWS, SMALL_ROWS, bucket_rows, pack_linears, pack_small_rows, packed_dtypes,
                               packed_linear_available, small_rows_available, small_rows_of)
from engine.model_executor.models.llama import LlamaForCausalLM
from tiny_models import tiny_llama_config

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch has no oneDNN packed linear")


# oneDNN packs bfloat16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2 CPU the small-row kernel
# alone serves them, and without that (no AVX2, or switched off) F.linear keeps them.
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.bfloat16 not in packed_dtypes(), reason="neither oneDNN nor the small-row kernel packs bfloat16 here"))]


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200, bias=bias, dtype=dtype))
    layer = model[0]
    weight, bias_ = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    assert pack_linears(model) == 1
    # Exact row counts, ones on a bucket and ones between buckets (padded).
    for rows in (1, 7, EXACT_ROWS, EXACT_ROWS + 1, 33, 100, 256, 257, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        out = layer(x)
        assert out.shape == (rows, 200) and out.is_contiguous() and out.dtype == dtype
        expected = nn.functional.linear(x, weight, bias_)
        torch.testing.assert_close(out, expected, **_tolerance(dtype))


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


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _tiny_llama(dtype: torch.dtype, tied: bool) -> LlamaForCausalLM:
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=512, tie_word_embeddings=tied), dtype=dtype)
    model.init_dummy_weights(seed=0)
    return model.eval()


def _logits(model: LlamaForCausalLM, lens: list[int]) -> torch.Tensor:  # [num_tokens, vocab] float32
    """A cache-less prefill of random prompts of these lengths, one flattened batch."""
    gen = torch.Generator().manual_seed(0)
    spans, offset = [], 0
    for n in lens:
        spans.append(PrefillSpan(offset, offset + n, n))
        offset += n
    meta = AttentionMetadata(slot_mapping=torch.full((offset,), -1, dtype=torch.int64), prefills=spans,
                             num_prefill_tokens=offset)
    input_ids = torch.randint(0, model.args.vocab_size, (offset,), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, None, meta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tied", [False, True])
def test_packed_llama_matches_unpacked(dtype, tied):
    ref = _tiny_llama(dtype, tied)
    model = copy.deepcopy(ref)
    assert pack_linears(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    lens = [5, 17, 1, 40]
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), **_tolerance(dtype))
    # A second call repacks only the weights still held: a tied head's, unless the embedding reads its packed copy.
    assert pack_linears(model) == (1 if tied and not small_rows_available() else 0)
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), **_tolerance(dtype))


@pytest.mark.skipif(not small_rows_available(), reason="no small-row kernel")
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_row_copies_are_one_stream_in_the_order_a_step_reads_them(dtype):
    model = _tiny_llama(dtype, tied=True)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    pack_linears(model)
    copies = [m._small_weight for m in linears]
    storage = copies[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == storage for c in copies), "one buffer holds every copy"
    starts = [c.data_ptr() for c in copies]
    assert starts[0] % cpu_linear.HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    for c, nxt in zip(copies, starts[1:]):  # layer by layer (qkv, o, gate_up, down), then the head; no overlap
        assert c.data_ptr() + c.numel() * c.element_size() <= nxt < c.data_ptr() + c.numel() * c.element_size() + 64
    lens = [5, 17, 1, 40]
    torch.testing.assert_close(_logits(model, lens), _logits(_tiny_llama(dtype, tied=True), lens), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_takes_any_leading_dims(dtype):
    torch.manual_seed(2)
    layer = nn.Linear(48, 40, bias=True, dtype=dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    pack_linears(nn.Sequential(layer))
    for shape in ((3, 7, 48), (2, 3, 20, 48), (48,), (0, 48)):
        x = torch.randn(shape, dtype=dtype)
        out = layer(x)
        assert out.shape == (*shape[:-1], 40) and out.dtype == dtype
        torch.testing.assert_close(out, nn.functional.linear(x, weight, bias), **_tolerance(dtype))


def _bfloat16_held_once() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny bfloat16 model and its packed copy, checked to hold each weight once, on the small-row kernel alone."""
    ref = _tiny_llama(torch.bfloat16, tied=False)
    model = copy.deepcopy(ref)
    assert pack_linears(model) == 2 * 4 + 1
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m._packed_weight is None and m._small_weight is not None for m in linears), "no oneDNN copy"
    assert all(m.weight.numel() == 0 for m in linears), "each weight held once"
    return ref, model


@pytest.mark.skipif(not small_rows_available(), reason="needs the compiled small-row kernel")
def test_bfloat16_goes_to_the_small_row_kernel_alone_where_onednn_cannot_pack_it(monkeypatch):
    # An AVX2-only CPU (Zen 3): oneDNN has no bfloat16 there, and F.linear ran it ~4x slower than float32. The
    # decision is simulated (this machine's kernels run); `make test-avx2` runs the AVX2 kernels themselves.
    from engine import ops
    from engine.model_executor.layers import cpu_linear

    monkeypatch.setattr(cpu_linear, "_onednn_packs_bf16", lambda: False)
    monkeypatch.setattr(cpu_linear, "_cpu_has_amx", lambda: False)  # nor AMX (this test ran on a Xeon with it)
    monkeypatch.setattr(ops, "small_gemm_isa", lambda: ops.SMALL_GEMM_AVX2)
    assert packed_dtypes() == (torch.float32, torch.bfloat16)
    ref, model = _bfloat16_held_once()
    lens = [5, 17, 1, 40]
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), **_tolerance(torch.bfloat16))
    monkeypatch.setattr(ops, "small_gemm_isa", lambda: 0)  # no AVX2 either: F.linear keeps bfloat16
    assert packed_dtypes() == (torch.float32,)


@pytest.mark.skipif(not small_rows_available() or cpu_linear._cpu_has_amx(),
                    reason="needs the compiled small-row kernel, and a CPU without AMX (oneDNN keeps bf16 there)")
def test_bfloat16_weights_are_held_once_even_where_onednn_packs_them(monkeypatch):
    # On a CPU with AVX-512 BF16 (Zen 4) oneDNN has a native bfloat16 GEMM, and its copy used to serve the prefill
    # beside the small-row copy: a second 256 MiB of SmolLM2's weights for no speed (docs/benchmarks.md,
    # "AVX-512 BF16"). Every row count, a prefill's included, now runs on the small-row kernel at this CPU's best path.
    from engine import ops

    ref, model = _bfloat16_held_once()
    calls = []
    small_gemm = ops.small_gemm

    def counting(out, x, *args, **kwargs):
        calls.append(x.shape[0])
        return small_gemm(out, x, *args, **kwargs)

    monkeypatch.setattr(ops, "small_gemm", counting)
    lens = [5, 17, 1, 40]
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), **_tolerance(torch.bfloat16))
    assert max(calls) >= 40, "the prefill rows went to the small-row kernel too"


@pytest.mark.skipif(not small_rows_available() or not cpu_linear._onednn_packs_bf16(),
                    reason="needs the small-row kernel and oneDNN's bfloat16 GEMM")
def test_bfloat16_keeps_onednn_for_many_rows_on_a_cpu_with_amx(monkeypatch):
    # AMX's tile GEMM (oneDNN) was never measured against the kernel: there the prefill stays on oneDNN. Simulated.
    monkeypatch.setattr(cpu_linear, "_cpu_has_amx", lambda: True)
    ref = _tiny_llama(torch.bfloat16, tied=False)
    model = copy.deepcopy(ref)
    assert pack_linears(model) == 2 * 4 + 1
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m._packed_weight is not None and m._small_max_rows == SMALL_ROWS for m in linears)
    lens = [5, 17, 1, 40]
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), **_tolerance(torch.bfloat16))


@pytest.mark.skipif(torch.bfloat16 in packed_dtypes(), reason="this CPU packs bfloat16 weights")
def test_bfloat16_stays_on_f_linear_where_nothing_packs_it():
    ref = _tiny_llama(torch.bfloat16, tied=False)
    model = copy.deepcopy(ref)
    assert pack_linears(model) == 0
    assert not any(hasattr(m, "_packed_weight") for m in model.modules())
    assert model.layers[0].mlp.down_proj.weight.numel() > 0  # nothing released
    lens = [5, 17, 1]
    torch.testing.assert_close(_logits(model, lens), _logits(ref, lens), atol=0, rtol=0)


def test_packed_linear_refuses_inputs_it_cannot_serve():
    layer = nn.Linear(16, 8)
    pack_linears(nn.Sequential(layer))
    for x in (torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 15)):
        with pytest.raises(RuntimeError, match="packed by pack_linears serves CPU .* only"):
            layer(x)


def test_untied_weights_are_released():
    model = _tiny_llama(torch.float32, tied=False)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    originals = [weakref.ref(m.weight) for m in linears]
    shapes = [(m.out_features, m.in_features) for m in linears]
    pack_linears(model)
    assert all(ref() is None for ref in originals)  # nothing kept the old Parameters (and so their storage) alive
    for m, shape in zip(linears, shapes):
        assert m.weight.numel() == 0 and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        assert (m.out_features, m.in_features) == shape
        assert m._packed_weight is not None or m._small_weight is not None
        assert m._packed_weight is None or tuple(m._packed_weight.shape) == shape
    state = model.state_dict()
    assert state["lm_head.weight"].numel() == 0 and state["embed_tokens.weight"].shape == (512, 64)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RSS is read from /proc")
def test_packing_does_not_keep_the_original():
    # 4 layers of 1024-wide linears: 4 * (3 + 1 + 8 + 4) * 1024 * 1024 * 4 bytes = 256 MiB of weights.
    config = tiny_llama_config(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(config)
    model.init_dummy_weights(seed=0)
    weight_mib = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear) / 2**20
    before = _rss_mib()
    pack_linears(model)
    grown = _rss_mib() - before
    # One or two packed forms (oneDNN's, the small-row kernel's), never the original as well.
    down = model.layers[0].mlp.down_proj
    copies = (down._small_weight is not None) + (down._packed_weight is not None)
    assert grown < (copies - 0.75) * weight_mib, f"RSS grew {grown:.0f} MiB packing {weight_mib:.0f} MiB of weights"


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_head_and_embedding_are_held_once(dtype):
    model = _tiny_llama(dtype, tied=True)
    embedding = model.embed_tokens.weight.detach().clone()
    pack_linears(model)
    ids = torch.tensor([0, 7, 511, 7, 15, 16])
    torch.testing.assert_close(model.embed_tokens(ids), embedding[ids], atol=0, rtol=0)
    torch.testing.assert_close(model.embed_tokens(ids.view(2, 3)), embedding[ids].view(2, 3, 64), atol=0, rtol=0)
    # The head multiplies with the same matrix the embedding reads.
    hidden = torch.randn(3, 64).to(dtype)
    torch.testing.assert_close(model.lm_head(hidden), (hidden.float() @ embedding.float().T).to(dtype),
                               **_tolerance(dtype))
    assert model.layers[0].mlp.down_proj.weight.numel() == 0  # the untied ones are released
    if small_rows_available():  # the embedding reads the head's small-row copy: no parameter holds the matrix
        assert model.embed_tokens.weight.numel() == 0 and model.lm_head.weight.numel() == 0
        with pytest.raises(IndexError, match="out of range"):
            model.embed_tokens(torch.tensor([512]))
    else:  # the embedding keeps the weight, which the head shares
        assert model.lm_head.weight is model.embed_tokens.weight and torch.equal(model.embed_tokens.weight, embedding)


@pytest.mark.skipif(not small_rows_available(), reason="no small-row kernel")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 33), (64, 32), (5, 8)])
def test_rows_read_back_from_the_small_row_layout(dtype, shape):
    weight = torch.randn(*shape).to(dtype)
    ids = torch.tensor([shape[0] - 1, 0, 3, 3, 1])
    assert torch.equal(small_rows_of(pack_small_rows(weight), ids, *shape), weight[ids])
