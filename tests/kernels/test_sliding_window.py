"""Sliding-window attention (Mistral): the kernels see only each query's last `window` tokens, equal the
reference, and never read the blocks before the window (the block manager releases them)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops

from engine.ops import reference as ref_ops
from tests.kernels.conftest import DEVICES, tolerances, torch_threads
from tests.kernels.test_attention import make_case
from tests.kernels.test_prefill_attention import fused_qkv, one_block_case, paged_case


def poison_released(key_cache, value_cache, tables, first_read):
    """A NaN block appended to the caches; each table's entries wholly before first_read[i] point at it,
    as released entries would. A kernel that read one would put NaN in its output."""
    nan = torch.full_like(key_cache[:1], float("nan"))
    key_cache, value_cache = torch.cat([key_cache, nan]), torch.cat([value_cache, nan])
    tables = tables.clone()
    for i, start in enumerate(first_read):
        tables[i, : start // key_cache.shape[2]] = key_cache.shape[0] - 1
    return key_cache, value_cache, tables


def decode_both(query, key_cache, value_cache, tables, lens, window):
    scale = query.shape[-1] ** -0.5
    first_read = [max(0, n - window) for n in lens.tolist()]
    key_cache, value_cache, tables = poison_released(key_cache, value_cache, tables, first_read)
    out, ref = torch.full_like(query, float("nan")), torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache, tables, lens, scale, window)
    ref_ops.ref_paged_attention(ref, query, key_cache, value_cache, tables, lens, scale, window)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    return out, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_decode_window_matches_reference(device, dtype, group, block_size, window):
    case = make_case(2, group, 64, block_size, [1, 17, 100, 33, 0], dtype, device, seed=window)
    out, ref = decode_both(*case, window)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_window_differs_from_full_attention(device):
    # The window must change the answer where the context is longer than it (else the tests above prove nothing).
    query, key_cache, value_cache, tables, lens = make_case(1, 2, 64, 16, [100], torch.float32, device, seed=3)
    scale = 64 ** -0.5
    full, windowed = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention(full, query, key_cache, value_cache, tables, lens, scale)
    ops.paged_attention(windowed, query, key_cache, value_cache, tables, lens, scale, 20)
    assert (full - windowed).abs().max() > 1e-2
    wide = torch.empty_like(query)  # a window as long as the context is full attention
    ops.paged_attention(wide, query, key_cache, value_cache, tables, lens, scale, 100)
    torch.testing.assert_close(wide, full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_window_with_partitions(device):
    # Contexts past the CUDA kernel's 512-token partitions, windows that cut across them.
    case = make_case(1, 4, 64, 16, [1500, 3, 700], torch.float32, device, seed=5)
    out, ref = decode_both(*case, 600)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_window_over_split_spans(dtype, threads):
    # Few items and much work (8037 windowed tokens x 3 heads x 64 > the kernel's 2^20 threshold): with 2 threads
    # the CPU kernel cuts the 8000-token window into spans that start mid-block, and merges them.
    case = make_case(1, 3, 64, 16, [17001, 37, 0], dtype, "cpu", seed=11)
    with torch_threads(threads):
        out, ref = decode_both(*case, 8000)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


def test_reference_decode_window_equals_sdpa_over_the_last_tokens():
    """The oracle itself: a window of w is attention over the context's last w tokens."""
    query, key_cache, value_cache, tables, lens = make_case(2, 2, 64, 8, [13, 40], torch.float32, "cpu", seed=2)
    ref = torch.empty_like(query)
    ref_ops.ref_paged_attention(ref, query, key_cache, value_cache, tables, lens, 64 ** -0.5, 10)
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i].long()
        k = key_cache[blocks].transpose(0, 1).reshape(2, -1, 64)[:, n - 10:n]  # [kv_heads, 10, head_size]
        v = value_cache[blocks].transpose(0, 1).reshape(2, -1, 64)[:, n - 10:n]
        expect = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0))
        torch.testing.assert_close(ref[i], expect.squeeze(1), atol=1e-5, rtol=1e-5)


def prefill_both(query, key_cache, value_cache, table, ctx, window):
    scale = query.shape[-1] ** -0.5
    first_read = max(0, ctx - query.shape[0] - window + 1)  # the first query's window
    key_cache, value_cache, tables = poison_released(key_cache, value_cache, table[None], [first_read])
    out, ref = torch.full_like(query, float("nan")), torch.empty_like(query)
    ops.prefill_attention(out, query, key_cache, value_cache, tables[0], ctx, scale, window)
    ref_ops.ref_prefill_attention(ref, query, key_cache, value_cache, tables[0], ctx, scale, window)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [1, 6, 16, 50])
@pytest.mark.parametrize("q_len", [7, 100])
def test_prefill_window_without_prefix_matches_reference(dtype, group, window, q_len):
    q, k, v, table, ctx = one_block_case(q_len, 2, group, 64, dtype, seed=q_len + window)
    out, ref = torch.full_like(q, float("nan")), torch.empty_like(q)
    ops.prefill_attention(out, q, k, v, table, ctx, 0.125, window)
    ref_ops.ref_prefill_attention(ref, q, k, v, table, ctx, 0.125, window)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("window", [3, 16, 29])
@pytest.mark.parametrize("q_len,num_cached", [(1, 40), (33, 17), (20, 70)])
def test_prefill_window_over_cached_prefix_matches_reference(dtype, block_size, window, q_len, num_cached):
    case = paged_case(q_len, num_cached, 2, 3, 64, block_size, dtype, seed=block_size + window)
    out, ref = prefill_both(*case, window)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [20, 80])
def test_prefill_window_head_sizes_off_the_vector_width(dtype, head_size):
    out, ref = prefill_both(*paged_case(13, 25, 3, 3, head_size, 16, dtype, seed=head_size), 9)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("threads", [1, 2])
def test_long_prefill_window_same_on_any_thread_count(threads):
    case = paged_case(300, 64, 3, 3, 64, 16, torch.bfloat16, seed=9)
    with torch_threads(threads):
        out, ref = prefill_both(*case, 57)
    torch.testing.assert_close(out, ref, **tolerances(torch.bfloat16))


def test_reference_prefill_window_equals_sdpa_with_hf_mask():
    """The oracle itself: HF's sliding-window causal mask (key j seen by query i when i - w < j <= i)."""
    query, key, value = fused_qkv(20, 2, 3, 64, torch.float32, torch.Generator().manual_seed(4))
    ref = torch.empty_like(query)
    ref_ops.ref_prefill_attention(ref, query, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                                  torch.zeros(1, dtype=torch.int32), 20, 0.125, 6)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    mask = (j <= i) & (j > i - 6)
    expect = F.scaled_dot_product_attention(query.transpose(0, 1), key.repeat_interleave(3, 1).transpose(0, 1),
                                            value.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask, scale=0.125)
    torch.testing.assert_close(ref, expect.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_bad_window_is_an_error():
    query, key_cache, value_cache, tables, lens = make_case(1, 1, 64, 8, [9], torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.paged_attention(torch.empty_like(query), query, key_cache, value_cache, tables, lens, 0.125, 0)


@pytest.mark.parametrize("num_cached", [0, 30])
def test_cuda_sdpa_prefill_path_applies_the_window(num_cached):
    """engine/model_executor/layers/attention.py's SDPA prefill (the CUDA path for windowed layers) run on CPU tensors: it equals the
    reference, and with a cached prefix it reads no block before the first query's window."""
    from engine.model_executor.layers.attention import Attention, PrefillSpan

    q_len, window, block_size = 20, 7, 8
    q, key_cache, value_cache, table, ctx = paged_case(q_len, num_cached, 2, 3, 64, block_size, torch.float32, seed=1)
    first_read = max(0, num_cached - window + 1)
    key_cache, value_cache, tables = poison_released(key_cache, value_cache, table[None], [first_read])
    key = ref_ops.gather_context(key_cache, tables[0], ctx, num_cached).transpose(0, 1)  # this step's rows
    value = ref_ops.gather_context(value_cache, tables[0], ctx, num_cached).transpose(0, 1)
    attn = Attention(6, 2, 64, 0.125, sliding_window=window)
    span = PrefillSpan(0, q_len, ctx, tables[0] if num_cached else None)
    out = attn._prefill_sdpa(q, key, value, (key_cache, value_cache), span)
    ref = torch.empty_like(q)
    ref_ops.ref_prefill_attention(ref, q, key_cache, value_cache, tables[0], ctx, 0.125, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# Gemma 2's attention soft-cap (scores = tanh(scores / cap) * cap before the mask), with and without a window: the
# CPU kernels against the reference, and the cap must change the answer. Scores are scaled up (x3 queries) so that
# a cap of 2 bites.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_softcap_matches_reference(dtype, window):
    query, key_cache, value_cache, tables, lens = make_case(2, 4, 64, 8, [1, 17, 100, 33], dtype, "cpu", seed=9)
    query = query * 3
    out, ref, uncapped = torch.empty_like(query), torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache, tables, lens, 0.125, window, 2.0)
    ref_ops.ref_paged_attention(ref, query, key_cache, value_cache, tables, lens, 0.125, window, 2.0)
    torch.testing.assert_close(out, ref, **tolerances(dtype))
    ops.paged_attention(uncapped, query, key_cache, value_cache, tables, lens, 0.125, window)
    assert (uncapped.float() - out.float()).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("q_len,num_cached", [(7, 0), (100, 0), (20, 33)])
def test_prefill_softcap_matches_reference(dtype, window, q_len, num_cached):
    if num_cached:
        q, k, v, table, ctx = paged_case(q_len, num_cached, 2, 3, 64, 8, dtype, seed=q_len)
    else:
        q, k, v, table, ctx = one_block_case(q_len, 2, 3, 64, dtype, seed=q_len)
    q = q * 3
    out, ref, uncapped = torch.full_like(q, float("nan")), torch.empty_like(q), torch.empty_like(q)
    ops.prefill_attention(out, q, k, v, table, ctx, 0.125, window, 2.0)
    ref_ops.ref_prefill_attention(ref, q, k, v, table, ctx, 0.125, window, 2.0)
    torch.testing.assert_close(out, ref, **tolerances(dtype))
    ops.prefill_attention(uncapped, q, k, v, table, ctx, 0.125, window)
    assert (uncapped.float() - out.float()).abs().max() > 1e-2
