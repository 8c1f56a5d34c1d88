"""paged_attention equals its pure-torch reference, and the reference equals SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops

from engine.ops import reference as ref_ops
from tests.kernels.conftest import CUDA_ONLY, DEVICES, random_block_tables, tolerances, torch_threads

CONTEXT_LENS = [1, 17, 100, 33]  # 1 token, crossing block edges, several blocks


def make_case(num_kv_heads, group, head_size, block_size, context_lens, dtype, device, seed, draw_on_device=False):
    """Random query and paged caches; draw_on_device draws the tensors there (large cases), else on the CPU."""
    gen = torch.Generator(device if draw_on_device else "cpu").manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in context_lens) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape, generator=gen, device=gen.device).to(dtype).to(device)
    value_cache = torch.randn(shape, generator=gen, device=gen.device).to(dtype).to(device)
    query = torch.randn(len(context_lens), num_kv_heads * group, head_size, generator=gen,
                        device=gen.device).to(dtype).to(device)
    tables = random_block_tables(context_lens, block_size, num_blocks, torch.Generator().manual_seed(seed)
                                 if draw_on_device else gen).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables, lens


def run_both(query, key_cache, value_cache, tables, lens):
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))  # every row must be written
    ref = torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache, tables, lens, scale)
    ref_ops.ref_paged_attention(ref, query, key_cache, value_cache, tables, lens, scale)
    return out, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_reference(device, dtype, group, block_size, head_size, seed):
    if device == "cuda" and block_size > 32:
        pytest.skip("128-token blocks are a CPU block size (engine/config.py)")
    case = make_case(2, group, head_size, block_size, CONTEXT_LENS, dtype, device, seed)
    out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_paged_attention_other_head_sizes_float16(device, head_size):
    case = make_case(2, 2, head_size, 16, [5, 40], torch.float16, device, seed=3)
    out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(torch.float16))


@pytest.mark.parametrize("device", DEVICES)
def test_long_context_uses_partitions_and_matches(device):
    # Past the CUDA kernel's partition size (256), so its partitions and their merge are exercised there.
    case = make_case(1, 4, 64, 16, [1500, 3, 700], torch.float32, device, seed=5)
    out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


# Every context length that sits on an edge: one token, around a 16-token block, around the CUDA kernel's
# 256-token partition, long, past the reduce's 512 partitions kept in shared memory, and empty.
EDGE_CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 4096, 140000, 0]
KERNELS = {
    # partitioned: the long sequences are merged from their partitions by the reduce kernel; the short and
    # empty ones are finished by their one partition in the same launch.
    "partitioned": (EDGE_CONTEXTS, 1),
    # one partition: no sequence is longer than 256 tokens, so the launch needs no workspace and no reduce.
    "one-partition": ([n for n in EDGE_CONTEXTS if n <= 256], 18),
}
CUDA_HEAD_SIZES = [64, 80, 96, 128, 256]


def check_kernel_case(kernel, num_kv_heads, group, head_size, block_size, dtype, device, seed=0):
    query, key_cache, value_cache, tables, lens = make_case(
        num_kv_heads, group, head_size, block_size, KERNELS[kernel][0], dtype, device, seed, draw_on_device=True)
    if device == "cuda":  # the launch takes the path this case is for
        width = tables.shape[1] * block_size
        workspace = ops._load().paged_attention_workspace_bytes(query.shape[0], query.shape[1], head_size, width, 0)
        assert (workspace > 0) == (kernel == "partitioned")
    out, ref = run_both(query, key_cache, value_cache, tables, lens)
    empty = lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@CUDA_ONLY
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_every_dtype_head_and_block_size_on_both_kernels(kernel, block_size, head_size, dtype):
    check_kernel_case(kernel, KERNELS[kernel][1] * 4, 1, head_size, block_size, dtype, "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("group", [1, 3, 4, 7, 8, 12, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_ratios_over_edge_contexts(device, kernel, group, dtype):
    # Groups of 1, 2-4 and 5-8 heads each have a kernel of their own on CUDA; 12 and 16 are cut into tiles of 8.
    if device == "cpu" and (dtype != torch.float32 or group != 4):
        pytest.skip("the CPU kernel's dtypes and groups are covered above; one CPU run keeps the suite fast")
    kv_heads = max(1, KERNELS[kernel][1] * 8 // group) if device == "cuda" else 1
    check_kernel_case(kernel, kv_heads, group, 64 if device == "cpu" else 128, 16, dtype, device, seed=group)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_cuda_sequence_result_does_not_depend_on_its_batch(dtype, window):
    # A CUDA graph replays a decode step at a padded batch with the widest block table; its tokens must be the
    # eager step's. So a sequence's output is bit-identical alone, in a batch, beside padding rows (context 0)
    # and under a wider table: its partitions depend on its own context alone.
    lens = [700, 3, 256, 1500]
    query, key_cache, value_cache, tables, ctx = make_case(2, 4, 128, 16, lens, dtype, "cuda", seed=11)
    scale = 128 ** -0.5
    batch = torch.empty_like(query)
    ops.paged_attention(batch, query, key_cache, value_cache, tables, ctx, scale, window)
    for i in range(len(lens)):
        alone = torch.empty_like(query[i:i + 1])
        width = (lens[i] + 15) // 16
        ops.paged_attention(alone, query[i:i + 1], key_cache, value_cache, tables[i:i + 1, :width].contiguous(),
                            ctx[i:i + 1], scale, window)
        assert torch.equal(alone, batch[i:i + 1])
    padded_q = torch.cat([query, torch.zeros_like(query[:3])])
    padded_tables = torch.zeros(len(lens) + 3, 4 * tables.shape[1], dtype=torch.int32, device="cuda")
    padded_tables[: len(lens), : tables.shape[1]] = tables
    padded_ctx = torch.cat([ctx, torch.zeros(3, dtype=torch.int32, device="cuda")])
    padded = torch.full_like(padded_q, float("nan"))
    ops.paged_attention(padded, padded_q, key_cache, value_cache, padded_tables, padded_ctx, scale, window)
    assert torch.equal(padded[: len(lens)], batch)
    assert torch.equal(padded[len(lens):], torch.zeros_like(padded[len(lens):]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_gqa_groups_over_long_split_contexts(dtype, group, block_size, threads):
    # Fewer (sequence, kv head) items than threads can share and enough work: with 2 threads the CPU
    # kernel cuts each context into spans (merged by max logit and sum), some past a short sequence's end.
    case = make_case(1, group, 64, block_size, [17001, 37, 0], dtype, "cpu", seed=group * block_size)
    with torch_threads(threads):
        out, ref = run_both(*case)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("lens", [[300], [130, 65], [257]])
def test_one_streams_decode_contexts_split_into_short_spans(dtype, block_size, lens):
    # The contexts of a decode step at one or two streams: with 8 query heads of 64 on one kv head each case is
    # past 64k multiply-adds, so with 2 threads each context is cut into spans of 64 tokens (rounded up to whole
    # blocks): spans past a context's end, a last span of one or two tokens, each merged by its max logit and sum.
    case = make_case(1, 8, 64, block_size, lens, dtype, "cpu", seed=block_size + len(lens))
    with torch_threads(2):
        out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("kv_heads, group, lens", [
    (3, 3, [0, 1, 200, 0, 0, 63, 64, 65, 129, 3, 0, 700, 127, 128, 2, 0] * 2),
    (1, 8, [3000, 5, 0, 1]),
])
def test_threads_take_items_ahead(dtype, block_size, kv_heads, group, lens):
    # On 2 threads each thread takes its next item as it starts one and reads ahead into it (parallel.h
    # share_items_ahead, attention_item.h Lookahead): every item must still be done once. 32 sequences: lengths
    # shorter than the lookahead, across block ends, empty ones between long ones. Four sequences: contexts cut
    # into spans, most past the short sequences' ends (spans that begin after they end).
    case = make_case(kv_heads, group, 64, block_size, lens, dtype, "cpu", seed=block_size + len(lens))
    with torch_threads(2):
        out, ref = run_both(*case)
    zero = torch.tensor(lens) == 0
    assert torch.equal(out[zero], torch.zeros_like(out[zero]))
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [16, 20, 40, 80])
def test_head_sizes_off_the_vector_width(dtype, head_size):
    # 16 and 80 fill whole 16-lane vectors (80: a masked bf16 pair on AVX-512); 20 and 40 take the one-lane path there.
    case = make_case(2, 3, head_size, 16, [1, 19, 64], dtype, "cpu", seed=head_size)
    out, ref = run_both(*case)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_context_gives_zeros_and_large_logits_stay_finite(device):
    query, key_cache, value_cache, tables, lens = make_case(2, 2, 64, 8, [0, 20], torch.float32, device, seed=7)
    query *= 1e3  # logits around 1e4: a softmax without max subtraction overflows
    out, ref = run_both(query, key_cache, value_cache, tables, lens)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_view(device):
    # The model hands over q as a column slice of the fused qkv projection.
    query, key_cache, value_cache, tables, lens = make_case(2, 2, 64, 16, [9, 30], torch.float32, device, seed=11)
    qkv = torch.cat([query, torch.randn_like(query)], dim=1)
    strided = qkv[:, : query.shape[1]]
    assert not strided.is_contiguous()
    out, ref = run_both(strided, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


@pytest.mark.parametrize("group", [1, 4])
def test_reference_equals_sdpa_over_contiguous_cache(group):
    """The oracle itself: gathering the paged cache and running SDPA gives the same answer."""
    query, key_cache, value_cache, tables, lens = make_case(2, group, 64, 8, [13, 40], torch.float32, "cpu", seed=2)
    ref = torch.empty_like(query)
    ref_ops.ref_paged_attention(ref, query, key_cache, value_cache, tables, lens, 64 ** -0.5)
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i].long()
        k = key_cache[blocks].transpose(0, 1).reshape(2, -1, 64)[:, :n]  # [kv_heads, n, head_size]
        v = value_cache[blocks].transpose(0, 1).reshape(2, -1, 64)[:, :n]
        expect = F.scaled_dot_product_attention(
            query[i].unsqueeze(1), k.repeat_interleave(group, 0), v.repeat_interleave(group, 0))
        torch.testing.assert_close(ref[i], expect.squeeze(1), atol=1e-5, rtol=1e-5)


def test_bad_block_id_is_an_error_not_a_crash():
    query, key_cache, value_cache, tables, lens = make_case(1, 1, 64, 8, [9], torch.float32, "cpu", seed=0)
    tables[0, 1] = key_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_attention(torch.empty_like(query), query, key_cache, value_cache, tables, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 128])
def test_cpu_rows_do_not_depend_on_the_batch(dtype, block_size):
    """A row's result is the same bits alone or among others (long contexts, split into spans, included):
    speculative decoding verifies k + 1 rows of one sequence in a step and must match one row a step."""
    lens = [700, 701, 702, 703, 704, 90, 300]
    query, key_cache, value_cache, tables, context = make_case(3, 3, 64, block_size, lens, dtype, "cpu", seed=5)
    scale = 64 ** -0.5
    with torch_threads(2):
        together = torch.empty_like(query)
        ops.paged_attention(together, query, key_cache, value_cache, tables, context, scale)
        for i in range(len(lens)):
            alone = torch.empty_like(query[i:i + 1])
            ops.paged_attention(alone, query[i:i + 1], key_cache, value_cache, tables[i:i + 1], context[i:i + 1],
                                scale)
            assert torch.equal(alone[0], together[i]), i
