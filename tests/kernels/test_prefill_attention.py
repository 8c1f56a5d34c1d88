"""prefill_attention (CPU) equals its float32 SDPA reference: GQA groups, cached prefixes, strided views."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops

from engine.ops import reference as ref_ops
from tests.kernels.conftest import random_block_tables, tolerances, torch_threads


def fused_qkv(num_tokens, num_kv_heads, group, head_size, dtype, gen):
    """q, k, v as the model hands them over: column slices of one fused projection (strided rows)."""
    heads = num_kv_heads * group
    qkv = torch.randn(num_tokens, (heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return (q.view(num_tokens, heads, head_size), k.view(num_tokens, num_kv_heads, head_size),
            v.view(num_tokens, num_kv_heads, head_size))


def one_block_case(q_len, num_kv_heads, group, head_size, dtype, seed):
    """No cached prefix: the step's own K/V rows as a single block, as engine/model_executor/layers/attention.py passes them."""
    q, k, v = fused_qkv(q_len, num_kv_heads, group, head_size, dtype, torch.Generator().manual_seed(seed))
    table = torch.zeros(1, dtype=torch.int32)
    return q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), table, q_len


def paged_case(q_len, num_cached, num_kv_heads, group, head_size, block_size, dtype, seed):
    """The whole context in shuffled blocks of a paged cache, the new tokens' rows last."""
    gen = torch.Generator().manual_seed(seed)
    ctx = num_cached + q_len
    q, _, _ = fused_qkv(q_len, num_kv_heads, group, head_size, dtype, gen)
    num_blocks = (ctx + block_size - 1) // block_size + 2
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    table = random_block_tables([ctx], block_size, num_blocks, gen)[0]
    return q, key_cache, value_cache, table, ctx


def run_both(query, key_cache, value_cache, table, context_len):
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))  # every row must be written
    ref = torch.empty_like(query)
    ops.prefill_attention(out, query, key_cache, value_cache, table, context_len, scale)
    ref_ops.ref_prefill_attention(ref, query, key_cache, value_cache, table, context_len, scale)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("q_len", [1, 7, 100])
def test_prompt_without_prefix_matches_reference(dtype, group, head_size, q_len):
    out, ref = run_both(*one_block_case(q_len, 2, group, head_size, dtype, seed=q_len + group))
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("q_len,num_cached", [(1, 40), (33, 17), (20, 0), (70, 130)])
def test_cached_prefix_in_paged_blocks_matches_reference(dtype, group, block_size, q_len, num_cached):
    case = paged_case(q_len, num_cached, 2, group, 64, block_size, dtype, seed=block_size + group)
    out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [16, 20, 9, 80])
def test_head_sizes_off_the_vector_width(dtype, head_size):
    # 20 and 9 run P.V one lane at a time; 9 is odd, so bfloat16 keys cannot be packed in pairs.
    out, ref = run_both(*paged_case(13, 5, 3, 3, head_size, 16, dtype, seed=head_size))
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_prompt_same_on_any_thread_count(dtype, threads):
    # Enough work for the OpenMP path: keys packed by several threads, tiles scheduled dynamically.
    case = paged_case(300, 64, 3, 3, 64, 16, dtype, seed=9)
    with torch_threads(threads):
        out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


def test_bad_block_id_is_an_error_not_a_crash():
    query, key_cache, value_cache, table, ctx = paged_case(4, 20, 1, 2, 64, 8, torch.float32, seed=0)
    table[1] = key_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.prefill_attention(torch.empty_like(query), query, key_cache, value_cache, table, ctx, 0.125)


def test_reference_equals_causal_sdpa_without_prefix():
    """The oracle itself: with nothing cached it is SDPA's own causal attention."""
    query, key, value = fused_qkv(20, 2, 3, 64, torch.float32, torch.Generator().manual_seed(4))
    ref = torch.empty_like(query)
    ref_ops.ref_prefill_attention(ref, query, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                              torch.zeros(1, dtype=torch.int32), 20, 0.125)
    expect = F.scaled_dot_product_attention(query.transpose(0, 1), key.repeat_interleave(3, 1).transpose(0, 1),
                                            value.repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=0.125)
    torch.testing.assert_close(ref, expect.transpose(0, 1), atol=1e-5, rtol=1e-5)
