"""The KV cache: per-layer key/value blocks on the device plus a host swap pool; the only code that moves KV bytes.

Use (the engine, once per process):

    num_gpu, num_cpu = determine_num_blocks(config, hf_config, dtype, device, profile=runner.profile_run)
    cache = CacheEngine(config.block_size, hf_config, num_gpu, num_cpu, device, dtype)
    ...each step:
    cache.apply(out)                              # swap out, swap in, copy: in that order
    logits, prompt_logits = runner.execute(out, cache.device_cache)
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Callable, Optional

import torch

from engine import ops
from engine.core.block_manager import max_admissible_tokens
from engine.config import EngineConfig
from engine.worker.cuda_graphs import graph_memory_bytes

logger = logging.getLogger(__name__)

GiB = 1 << 30
KVCache = tuple[torch.Tensor, torch.Tensor]  # [num_blocks, num_kv_heads, block_size, head_size] each


def kv_shape(hf_config, tp_size: int = 1) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of one rank's KV cache: under tensor parallelism each of the
    tp_size ranks holds its share of the key/value heads (one head when they are fewer than the ranks)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return hf_config.num_hidden_layers, max(1, kv_heads // tp_size), head_size  # one replicated head when N > kv


def cache_block_bytes(block_size: int, hf_config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block over all layers, keys and values, on one rank."""
    layers, kv_heads, head_size = kv_shape(hf_config, tp_size)
    return 2 * layers * kv_heads * block_size * head_size * torch.empty((), dtype=dtype).element_size()


class CacheEngine:
    """Per-layer key and value cache tensors on the device, and the same layout in a host swap pool."""

    def __init__(
        self, block_size: int, hf_config, num_device_blocks: int, num_cpu_blocks: int,
        device: torch.device, dtype: torch.dtype, tp_size: int = 1,
    ) -> None:
        self.block_size, self.num_device_blocks, self.num_cpu_blocks = block_size, num_device_blocks, num_cpu_blocks
        self.device, self.dtype = torch.device(device), dtype
        layers, kv_heads, head_size = kv_shape(hf_config, tp_size)
        self.num_layers = layers
        self.block_shape = (kv_heads, block_size, head_size)
        # torch.empty: the attention only reads slots it wrote, so zeroing gigabytes would be wasted time.
        self.device_cache: list[KVCache] = self._allocate(num_device_blocks, self.device, pin=False)
        pin = self.device.type == "cuda"  # pinned host memory makes device <-> host copies asynchronous
        self.cpu_cache: list[KVCache] = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pin)
        # CUDA: swaps run on a side stream, fenced by events against the compute stream both ways (see swap).
        self._swap_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._compute_done = torch.cuda.Event() if self._swap_stream is not None else None
        self._swaps_done = torch.cuda.Event() if self._swap_stream is not None else None

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> list[KVCache]:
        """Every layer's keys and values as views of one allocation [layers, 2, num_blocks, *block_shape].

        pin: the host pool is page-locked by one cudaHostRegister of exactly its bytes (torch's pinned
        allocator would round each tensor up to a power of two: up to 2x --swap-space), and unregistered
        when this engine goes."""
        pool = torch.empty((self.num_layers, 2, num_blocks, *self.block_shape), dtype=self.dtype, device=device)
        if pin and pool.numel():
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(pool.data_ptr(), pool.nbytes, 1))  # 1: cudaHostRegisterPortable
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of the {pool.nbytes / GiB:.2f} GiB swap pool failed "
                                   f"(cudaError {err}): lower --swap-space")
            weakref.finalize(self, cudart.cudaHostUnregister, pool.data_ptr())
        return [(pool[layer, 0], pool[layer, 1]) for layer in range(self.num_layers)]

    @staticmethod
    def _mapping(pairs) -> torch.Tensor:  # [num_pairs, 2] int64, on the CPU as engine.ops wants it
        return torch.tensor(list(pairs), dtype=torch.int64).view(-1, 2)

    def swap(self, to_host: dict[int, int], to_device: dict[int, int]) -> None:
        """Device -> host blocks ({device: host}), then host -> device blocks ({host: device}), every layer's
        keys and values in one batched copy per direction.

        In that order, so a device block swapped out and reused by a swap-in in one step leaves first. On CUDA
        the copies run on the side stream: they start after the compute stream's work so far (a swap-out reads
        what the last step wrote), and the compute stream's later work waits for them (the next step reads the
        swapped-in blocks and may overwrite the swapped-out ones). Neither side blocks the host."""
        if not to_host and not to_device:
            return
        if self._swap_stream is None:
            self._copy(self.device_cache, self.cpu_cache, to_host)
            self._copy(self.cpu_cache, self.device_cache, to_device)
            return
        compute = torch.cuda.current_stream(self.device)
        self._compute_done.record(compute)
        self._swap_stream.wait_event(self._compute_done)
        with torch.cuda.stream(self._swap_stream):
            self._copy(self.device_cache, self.cpu_cache, to_host)
            self._copy(self.cpu_cache, self.device_cache, to_device)
        self._swaps_done.record(self._swap_stream)
        compute.wait_event(self._swaps_done)

    def _copy(self, src: list[KVCache], dst: list[KVCache], mapping: dict[int, int]) -> None:
        if mapping:
            srcs, dsts = [t for kv in src for t in kv], [t for kv in dst for t in kv]  # every layer's k and v
            ops.swap_blocks(srcs, dsts, self._mapping(mapping.items()))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: (src, dst) device blocks, every layer."""
        if not pairs:
            return
        block_mapping = self._mapping(pairs)
        ops.copy_blocks([k for k, _ in self.device_cache], [v for _, v in self.device_cache], block_mapping)

    def apply(self, out) -> None:
        """A SchedulerOutput's cache moves, in the order the scheduler decided them: swap out, swap in, copy
        (the copies run on the compute stream, after the swaps)."""
        self.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        self.copy(out.blocks_to_copy)


def determine_num_blocks(
    config: EngineConfig, hf_config, dtype: torch.dtype, device: torch.device,
    profile: Optional[Callable[[], None]] = None,
) -> tuple[int, int]:
    """(num_device_blocks, num_cpu_blocks) for the config; ValueError naming the flag if max_model_len cannot fit.

    Device blocks: num_gpu_blocks_override, else on CPU kv_cache_space GiB, else on CUDA
    gpu_memory_utilization of the GPU minus the peak of `profile()` (a max-size forward) and the
    step's scratch that forward does not allocate (step_scratch_bytes).
    Host blocks: num_cpu_blocks_override, else swap_space GiB.
    """
    block_bytes = cache_block_bytes(config.block_size, hf_config, dtype, config.tensor_parallel_size)
    flag = "--num-gpu-blocks-override"
    if config.num_gpu_blocks_override is not None:
        num_gpu = config.num_gpu_blocks_override
    elif torch.device(device).type == "cuda":
        flag = "--gpu-memory-utilization"
        scratch = step_scratch_bytes(config, hf_config)
        logger.info("step scratch beyond the profiled forward: %s",
                    ", ".join(f"{name} {n / 2**20:.0f} MiB" for name, n in scratch.items()))
        num_gpu = _profile_cuda_blocks(config, block_bytes, device, profile, sum(scratch.values()))
    else:
        flag = "--kv-cache-space"
        num_gpu = int(config.kv_cache_space * GiB) // block_bytes
    if config.num_cpu_blocks_override is not None:
        num_cpu = config.num_cpu_blocks_override
    else:
        num_cpu = int(config.swap_space * GiB) // block_bytes
    max_len = config.max_model_len
    # The scheduler keeps a watermark of blocks free, so that much of the cache never holds a prompt.
    fits = max_admissible_tokens(config.block_size, max(num_gpu, 0), config.watermark)
    if max_len is not None and fits < max_len:
        raise ValueError(
            f"The KV cache holds {max(num_gpu, 0)} blocks of {config.block_size} tokens, of which "
            f"{fits} tokens can hold one sequence (beside the watermark), fewer than max_model_len "
            f"({max_len}): raise {flag} or lower --max-model-len."
        )
    logger.info("KV cache: %d device blocks, %d host blocks of %d tokens (%.1f KiB each)",
                num_gpu, num_cpu, config.block_size, block_bytes / 1024)
    return num_gpu, num_cpu


# The CUDA paged kernel's partition (csrc/cuda/launchers.h kPartitionSize): its v2 workspace holds, per
# sequence, head and partition, head_size + 2 floats.
_CUDA_PARTITION = 256


def step_scratch_bytes(config: EngineConfig, hf_config) -> dict[str, int]:
    """Device bytes a step can allocate at its largest that the profiled forward (logits of each
    sequence's last token, prefill attention) does not, by owner:

    - prompt_logprobs: float32 logits of every token of a step and their log-softmax;
    - paged_attention_v2: the partitioned decode kernel's workspace for max_num_seqs sequences at max_model_len;
    - sampler: per sequence, float32 logits, probabilities, log-probabilities and one sorted copy (top-p/top-k);
    - cuda_graphs: the decode graphs' pool (engine/worker/cuda_graphs.py), unless --enforce-eager or TP.
    """
    tokens = config.max_num_batched_tokens or 2048  # as ModelRunner.profile_run
    seqs = config.max_num_seqs
    vocab = int(hf_config.vocab_size)
    _, _, head_size = kv_shape(hf_config)
    partitions = math.ceil((config.max_model_len or hf_config.max_position_embeddings) / _CUDA_PARTITION)
    scratch = {
        "prompt_logprobs": 2 * tokens * vocab * 4,
        "paged_attention_v2": seqs * hf_config.num_attention_heads * partitions * (head_size + 2) * 4,
        "sampler": 4 * seqs * vocab * 4,
    }
    if not config.enforce_eager and config.tensor_parallel_size == 1:
        scratch["cuda_graphs"] = graph_memory_bytes(config, hf_config, dtype_bytes=4)  # float32: the largest
    return scratch


def _profile_cuda_blocks(config: EngineConfig, block_bytes: int, device, profile, scratch: int) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if profile is not None:
        profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    # What this process holds at its peak plus what others hold now; the rest, up to the fraction, is cache.
    peak = torch.cuda.max_memory_allocated(device) + (total - free - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    return int(total * config.gpu_memory_utilization - peak - scratch) // block_bytes
