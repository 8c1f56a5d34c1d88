"""The cache engine moves KV bytes exactly, and sizes the cache or refuses with the flag to change."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from tiny_models import tiny_llama_config
from engine.worker.cache_engine import CacheEngine, cache_block_bytes, determine_num_blocks, step_scratch_bytes
from engine.config import EngineConfig
from engine.core.scheduler import SchedulerOutput

HF_CONFIG = tiny_llama_config()  # 2 layers, 2 KV heads, head_dim 16


def _filled_engine(num_gpu=10, num_cpu=6, block_size=8) -> CacheEngine:
    engine = CacheEngine(block_size, HF_CONFIG, num_gpu, num_cpu, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    for k, v in engine.device_cache + engine.cpu_cache:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return engine


def test_layout_is_one_key_and_value_tensor_per_layer():
    engine = _filled_engine()
    assert len(engine.device_cache) == 2 and len(engine.cpu_cache) == 2
    assert engine.device_cache[0][0].shape == (10, 2, 8, 16)  # [num_blocks, num_kv_heads, block_size, head_size]
    assert engine.cpu_cache[1][1].shape == (6, 2, 8, 16)
    assert cache_block_bytes(8, HF_CONFIG, torch.float32) == 2 * 2 * 2 * 8 * 16 * 4


def test_swap_out_then_in_restores_the_bytes():
    engine = _filled_engine()
    before = [(k.clone(), v.clone()) for k, v in engine.device_cache]
    engine.swap({3: 0, 7: 5}, {})
    for (k, v), (k0, v0) in zip(engine.cpu_cache, before):
        assert torch.equal(k[0], k0[3]) and torch.equal(v[5], v0[7])
    for k, v in engine.device_cache:  # the device blocks are reused by others meanwhile
        k[3].zero_(), v[7].zero_()
    engine.swap({}, {0: 1, 5: 9})
    for (k, v), (k0, v0) in zip(engine.device_cache, before):
        assert torch.equal(k[1], k0[3]) and torch.equal(v[1], v0[3])
        assert torch.equal(k[9], k0[7]) and torch.equal(v[9], v0[7])
        assert torch.equal(k[2], k0[2])  # untouched blocks stay


def test_copy_on_write_copies_every_layer_and_apply_keeps_the_order():
    engine = _filled_engine()
    before = [(k.clone(), v.clone()) for k, v in engine.device_cache]
    engine.copy([(2, 4), (6, 8)])
    for (k, v), (k0, v0) in zip(engine.device_cache, before):
        assert torch.equal(k[4], k0[2]) and torch.equal(v[8], v0[6]) and torch.equal(k[2], k0[2])
    # Swap out block 1 before block 1 is overwritten by a swap in, then copy the swapped-in block.
    engine = _filled_engine()
    before_gpu = [(k.clone(), v.clone()) for k, v in engine.device_cache]
    before_cpu = [(k.clone(), v.clone()) for k, v in engine.cpu_cache]
    engine.apply(SchedulerOutput(blocks_to_swap_out={1: 0}, blocks_to_swap_in={2: 1}, blocks_to_copy=[(1, 3)]))
    for (k, _), (swapped_k, _), (gk, _), (ck, _) in zip(engine.device_cache, engine.cpu_cache, before_gpu, before_cpu):
        assert torch.equal(swapped_k[0], gk[1])  # block 1 left before it was overwritten
        assert torch.equal(k[1], ck[2]) and torch.equal(k[3], ck[2])  # swapped in, then copied


def test_cpu_blocks_come_from_kv_cache_space_and_swap_space():
    block = cache_block_bytes(16, HF_CONFIG, torch.float32)
    config = EngineConfig(kv_cache_space=0.01, swap_space=0.005, max_model_len=64, block_size=16)
    num_gpu, num_cpu = determine_num_blocks(config, HF_CONFIG, torch.float32, torch.device("cpu"))
    assert num_gpu == int(0.01 * 2**30) // block and num_cpu == int(0.005 * 2**30) // block
    config = EngineConfig(num_gpu_blocks_override=7, num_cpu_blocks_override=0, max_model_len=64, device="cpu")
    assert determine_num_blocks(config, HF_CONFIG, torch.float32, torch.device("cpu")) == (7, 0)


@pytest.mark.parametrize("fields, flag", [
    (dict(num_gpu_blocks_override=4), "--num-gpu-blocks-override"),
    (dict(kv_cache_space=1e-6), "--kv-cache-space"),
])
def test_max_model_len_that_cannot_fit_is_refused_naming_the_flag(fields, flag):
    config = EngineConfig(max_model_len=100, block_size=16, **fields)
    with pytest.raises(ValueError) as err:
        determine_num_blocks(config, HF_CONFIG, torch.float32, torch.device("cpu"))
    assert flag in str(err.value) and "max_model_len (100)" in str(err.value) and "--max-model-len" in str(err.value)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_one_block_swapped_out_and_in_in_one_step_is_fenced_both_ways(device):
    """Device block 1 is written by the last step, swapped out, and reused by a swap-in in the same step,
    which this step reads at once. On CUDA the swaps run on the side stream: the compute stream is held
    up before the write (so a swap-out that ran early would miss it) and the side stream before the
    swap-in (so a read that ran early would see stale bytes)."""
    engine = CacheEngine(8, HF_CONFIG, 10, 6, torch.device(device), torch.float32)
    for k, v in engine.device_cache + engine.cpu_cache:
        k.zero_(), v.zero_()
    for k, v in engine.cpu_cache:
        k[2].fill_(2.0), v[2].fill_(2.0)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the compute stream is busy; the write below comes after
    for k, v in engine.device_cache:  # "the last step" writes block 1 on the compute stream
        k[1].fill_(1.0), v[1].fill_(1.0)
    if cuda:
        with torch.cuda.stream(engine._swap_stream):
            torch.cuda._sleep(100_000_000)  # the side stream is late to swap in
    engine.apply(SchedulerOutput(blocks_to_swap_out={1: 0}, blocks_to_swap_in={2: 1}, blocks_to_copy=[(1, 3)]))
    seen = [(k[1] + 0, v[3] + 0) for k, v in engine.device_cache]  # "this step" reads at once
    if cuda:
        torch.cuda.synchronize()
    for (k1, v3), (host_k, host_v) in zip(seen, engine.cpu_cache):
        assert bool((host_k[0] == 1).all() and (host_v[0] == 1).all())  # left after the write, before the reuse
        assert bool((k1 == 2).all() and (v3 == 2).all())  # swapped in (then copied) before the read


@pytest.mark.parametrize("device", DEVICES)
def test_swap_pool_costs_what_swap_space_says(device):
    """The host pool is one allocation of exactly num_cpu_blocks blocks (pinned on CUDA by registering those
    bytes): torch's pinned allocator would round every layer's tensor up to a power of two."""
    num_cpu = 37  # blocks of 8 KiB: no power of two
    engine = CacheEngine(8, HF_CONFIG, 4, num_cpu, torch.device(device), torch.float32)
    storages = {t.untyped_storage().data_ptr() for kv in engine.cpu_cache for t in kv}
    assert len(storages) == 1
    pool = engine.cpu_cache[0][0].untyped_storage()
    assert pool.nbytes() == num_cpu * cache_block_bytes(8, HF_CONFIG, torch.float32)
    assert all(t.is_contiguous() and t.shape == (num_cpu, 2, 8, 16) for kv in engine.cpu_cache for t in kv)
    assert all(t.is_pinned() for kv in engine.cpu_cache for t in kv) == (device == "cuda")
    if device == "cuda":  # the registration goes with the engine
        ptr = engine.cpu_cache[0][0].data_ptr()
        del engine
        gc.collect()
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostUnregister(ptr)) != 0  # already unregistered

def test_cuda_memory_plan_reserves_the_step_scratch_the_profile_misses():
    """A full step of prompt-logprobs tokens, the v2 attention workspace at max_model_len and the sampler's
    vocab-wide rows are kept out of the KV cache (the profiled forward computes only last-token logits)."""
    config = EngineConfig(max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=1024)
    scratch = step_scratch_bytes(config, HF_CONFIG)
    vocab = HF_CONFIG.vocab_size
    assert scratch["prompt_logprobs"] >= 1024 * vocab * 4  # float32 logits of every token of a step
    assert scratch["sampler"] >= 64 * vocab * 4
    assert scratch["paged_attention_v2"] == 64 * 4 * (4096 // 256) * (16 + 2) * 4
    # The decode graphs' pool: at least the largest captured batch's float32 logits and its attention workspace.
    assert scratch["cuda_graphs"] >= 64 * vocab * 4 + scratch["paged_attention_v2"]
    assert "cuda_graphs" not in step_scratch_bytes(dataclasses.replace(config, enforce_eager=True), HF_CONFIG)
    if torch.cuda.is_available():  # the kernel's own sizing, for a head size it runs
        from engine import ops
        cfg64 = tiny_llama_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64)
        want = ops._load().paged_attention_workspace_bytes(64, 4, 64, 4096, 0)
        assert step_scratch_bytes(config, cfg64)["paged_attention_v2"] == want > 0
    bigger = step_scratch_bytes(EngineConfig(max_model_len=4096, max_num_seqs=128, max_num_batched_tokens=2048),
                                HF_CONFIG)
    assert all(bigger[k] > scratch[k] for k in scratch)
