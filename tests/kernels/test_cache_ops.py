"""reshape_and_cache, copy_blocks and swap_blocks equal their pure-torch references."""
from __future__ import annotations

import pytest
import torch

from engine import ops

from engine.ops import reference as ref_ops
from tests.kernels.conftest import DEVICES

NUM_KV_HEADS, HEAD_SIZE = 2, 64


def random_cache(num_blocks, block_size, dtype, device, gen):
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_SIZE)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_reshape_and_cache_matches_reference(device, dtype, block_size, seed):
    if device == "cuda" and block_size > 32:
        pytest.skip("128-token blocks are a CPU block size (engine/config.py)")
    gen = torch.Generator().manual_seed(seed)
    num_blocks, num_tokens = 6, 23
    key_cache = random_cache(num_blocks, block_size, dtype, device, gen)
    value_cache = random_cache(num_blocks, block_size, dtype, device, gen)
    # k and v as column slices of one fused projection: strided rows.
    kv = torch.randn(num_tokens, 2 * NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype).to(device)
    key, value = kv[:, :NUM_KV_HEADS], kv[:, NUM_KV_HEADS:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 10]] = -1  # padding tokens are skipped
    slots = slots.to(device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    ref_ops.ref_reshape_and_cache(key, value, ref_k, ref_v, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    # A spot check the reference cannot share a bug with: token 0 sits at its slot.
    s = int(slots[0])
    assert torch.equal(key_cache[s // block_size, :, s % block_size], key[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_copy_blocks_matches_reference_all_layers(device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_layers, num_blocks, block_size = 3, 8, 16
    key_caches = [random_cache(num_blocks, block_size, dtype, device, gen) for _ in range(num_layers)]
    value_caches = [random_cache(num_blocks, block_size, dtype, device, gen) for _ in range(num_layers)]
    originals = [c.clone() for c in key_caches + value_caches]
    ref_k = [c.clone() for c in key_caches]
    ref_v = [c.clone() for c in value_caches]
    mapping = torch.tensor([[1, 5], [6, 0], [2, 3]], dtype=torch.int64)
    ops.copy_blocks(key_caches, value_caches, mapping)
    ref_ops.ref_copy_blocks(ref_k, ref_v, mapping)
    for got, want, orig in zip(key_caches + value_caches, ref_k + ref_v, originals):
        assert torch.equal(got, want)
        # src -> dst, never the other way round; other blocks untouched.
        assert torch.equal(got[5], orig[1]) and torch.equal(got[1], orig[1])
        assert torch.equal(got[0], orig[6]) and torch.equal(got[3], orig[2])
        assert torch.equal(got[[4, 7]], orig[[4, 7]])


def _pools(device, dtype, gen):
    """A device cache with 7 blocks and a host swap pool with 4: different sizes on purpose."""
    dev = random_cache(7, 16, dtype, device, gen)
    host = random_cache(4, 16, dtype, "cpu", gen)
    if device == "cuda":
        host = host.pin_memory()
    return dev, host


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_device_to_host(device, dtype):
    dev, host = _pools(device, dtype, torch.Generator().manual_seed(0))
    ref_host = host.clone()
    before = host.clone()
    mapping = {6: 0, 2: 3}  # gpu block -> cpu block; reversed it would index past the pool
    ops.swap_blocks([dev], [host], mapping)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_ops.ref_swap_blocks([dev], [ref_host], mapping)
    assert torch.equal(host, ref_host)
    assert torch.equal(host[0], dev[6].cpu()) and torch.equal(host[3], dev[2].cpu())
    assert torch.equal(host[[1, 2]], before[[1, 2]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_in_host_to_device(device, dtype):
    dev, host = _pools(device, dtype, torch.Generator().manual_seed(1))
    ref_dev = dev.clone()
    before = dev.clone()
    mapping = torch.tensor([[0, 5], [3, 1]], dtype=torch.int64)  # cpu block -> gpu block
    ops.swap_blocks([host], [dev], mapping)
    if device == "cuda":
        torch.cuda.synchronize()
    ref_ops.ref_swap_blocks([host], [ref_dev], mapping)
    assert torch.equal(dev, ref_dev)
    assert torch.equal(dev[5].cpu(), host[0]) and torch.equal(dev[1].cpu(), host[3])
    assert torch.equal(dev[[0, 2, 3, 4, 6]], before[[0, 2, 3, 4, 6]])


def test_swap_rejects_a_block_outside_the_pool():
    gen = torch.Generator().manual_seed(2)
    dev, host = _pools("cpu", torch.float32, gen)
    with pytest.raises(RuntimeError, match="outside"):
        ops.swap_blocks([dev], [host], {2: 4})  # the host pool has blocks 0..3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_every_layer_in_one_call(device, dtype):
    """Keys and values of three layers, both directions: each tensor gets its own blocks, nothing else moves."""
    gen = torch.Generator().manual_seed(3)
    pools = [_pools(device, dtype, gen) for _ in range(6)]  # 3 layers x (key, value)
    devs, hosts = [d for d, _ in pools], [h for _, h in pools]
    dev_before, host_before = [d.clone() for d in devs], [h.clone() for h in hosts]
    ops.swap_blocks(devs, hosts, {6: 0, 2: 3})
    ops.swap_blocks(hosts, devs, {1: 5})  # a host block the first call did not write
    if device == "cuda":
        torch.cuda.synchronize()
    for dev, host, d0, h0 in zip(devs, hosts, dev_before, host_before):
        assert torch.equal(host[0], d0[6].cpu()) and torch.equal(host[3], d0[2].cpu())
        assert torch.equal(host[[1, 2]], h0[[1, 2]])
        assert torch.equal(dev[5].cpu(), h0[1]) and torch.equal(dev[[0, 1, 2, 3, 4, 6]], d0[[0, 1, 2, 3, 4, 6]])


def test_swap_rejects_mismatched_lists():
    dev, host = _pools("cpu", torch.float32, torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="sources but"):
        ops.swap_blocks([dev, dev], [host], {0: 0})
    with pytest.raises(RuntimeError, match="one shape"):
        ops.swap_blocks([dev, dev[:3]], [host, host], {0: 0})
