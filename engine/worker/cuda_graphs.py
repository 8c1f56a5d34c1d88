"""CUDA graphs for decode-only steps: the model's forward and head, captured once per batch size, replayed.

A decode step of a small model on a GPU is launch-bound: ~10 kernels a layer, each a few microseconds of GPU
work behind tens of microseconds of Python and launch. A graph replays the whole step as one launch. As in
vLLM and nano-vllm: static input buffers sized once for the largest batch, graphs captured largest batch first
into one shared memory pool, and a step replayed on the smallest captured size that holds its rows. Padding rows
write no cache (slot -1) and attend to nothing (context 0); the paged decode kernel's result for a sequence
depends on its own context only (csrc/cuda/paged_decode.cuh), so a replay gives the eager step's tokens.

Use (ModelRunner, after the KV cache exists; again after an engine reset, which allocates a new cache):

    graphs = DecodeGraphs.capture(model, kv_caches, config, device)
    if graphs.serves(input_ids, meta):
        logits = graphs.run(input_ids, positions, meta, kv_caches)  # [num_rows, vocab] float32, until the next replay
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from engine.config import EngineConfig
from engine.model_executor.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to max_num_seqs (which is captured too)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def graph_memory_bytes(config: EngineConfig, hf_config, dtype_bytes: int) -> int:
    """Device bytes the captured graphs' pool can hold beside the profiled forward, for the memory plan: the
    largest batch's activations (a generous per-token count of the layer's live tensors), its float32 logits and
    the paged decode kernel's workspace at the block tables' full width."""
    batch = max(capture_sizes(config.max_num_seqs))
    hidden, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
    heads = int(hf_config.num_attention_heads)
    head_size = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    per_token = (8 * hidden + 2 * (heads + 2 * kv_heads) * head_size + 3 * inter) * dtype_bytes
    max_len = config.max_model_len or int(hf_config.max_position_embeddings)
    partitions = -(-max_len // 256)  # csrc/cuda/launchers.h kPartitionSize
    workspace = batch * heads * partitions * (head_size + 2) * 4 if partitions > 1 else 0
    return batch * (per_token + 2 * int(hf_config.vocab_size) * 4) + workspace


class DecodeGraphs:
    """One captured graph per batch size over static inputs; see the module docstring."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, config: EngineConfig, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(config.max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-config.max_model_len // config.block_size)
        n = self.max_batch
        # The step's inputs, written before each replay (each contiguous: the kernels take them as they are):
        # [ids, positions, slots] int64, context lengths and block tables int32; pinned host copies to stage them.
        self._longs = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._lens = torch.zeros(n, dtype=torch.int32, device=device)
        self._tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self._host = (torch.zeros(3, n, dtype=torch.int64, pin_memory=True),
                      torch.zeros(n, dtype=torch.int32, pin_memory=True),
                      torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True))
        self._host_np = tuple(t.numpy() for t in self._host)  # written through NumPy: ~1 us a write, not ~8
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # [size, vocab] float32 in the graphs' pool
        self.replays = 0  # steps served by a graph (tests, benchmarks)

    @classmethod
    def capture(cls, model: torch.nn.Module, kv_caches: list, config: EngineConfig,
                device: torch.device) -> "DecodeGraphs":
        graphs = cls(model, kv_caches, config, device)
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        with torch.inference_mode():
            graphs._capture_all()
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s, %.0f MiB",
                    len(graphs.sizes), graphs.max_batch, time.perf_counter() - start, used / 2**20)
        return graphs

    def _forward(self, size: int) -> torch.Tensor:  # -> [size, vocab] float32
        ids, positions, slots = self._longs[0, :size], self._longs[1, :size], self._longs[2, :size]
        meta = AttentionMetadata(slot_mapping=slots, decode_block_tables=self._tables[:size],
                                 decode_context_lens=self._lens[:size])
        hidden = self.model(ids, positions, self.kv_caches, meta)  # [size, hidden]
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        self._longs[2].fill_(-1)  # no cache writes while capturing: every row is padding
        self._lens.zero_()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(self.max_batch)  # warm-up outside the graph: lazy tables, library handles
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._logits[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph

    def serves(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step (no prefill rows) of at most the largest captured batch, with this cache."""
        return (not meta.num_prefill_tokens and meta.decode_context_lens is not None
                and 0 < input_ids.shape[0] == meta.num_decode_tokens <= self.max_batch
                and meta.decode_block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list) -> torch.Tensor:
        """Replays the smallest graph that holds the step's rows; -> [num_rows, vocab] float32, valid until the
        next replay. Inputs on the CPU are staged through pinned memory, three copies."""
        assert kv_caches is self.kv_caches, "the KV cache was reallocated: capture the graphs again"
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        width = tables.shape[1]
        if input_ids.device.type == "cpu":  # NumPy writes into the pinned buffers, then three copies
            longs, lens_buf, tables_buf = self._host_np
            longs[0, :n] = input_ids.numpy()
            longs[1, :n] = positions.numpy()
            longs[2, :n] = meta.slot_mapping.numpy()
            longs[2, n:size] = -1  # padding rows: no cache write ...
            lens_buf[:n] = lens.numpy()
            lens_buf[n:size] = 0  # ... and no context
            tables_buf[:n, :width] = tables.numpy()  # columns past width: stale ids past each context, never read
            # The host buffers are read before the step's results come back, so before they are written again.
            self._longs.copy_(self._host[0], non_blocking=True)
            self._lens[:size].copy_(self._host[1][:size], non_blocking=True)
            self._tables[:size].copy_(self._host[2][:size], non_blocking=True)
        else:
            self._longs[:, :n].copy_(torch.stack([input_ids, positions, meta.slot_mapping]))
            self._longs[2, n:size].fill_(-1)
            self._lens[:n].copy_(lens)
            self._lens[n:size].zero_()
            self._tables[:n, :width].copy_(tables)
        self._graphs[size].replay()
        self.replays += 1
        return self._logits[size][:n]


def maybe_capture(model: torch.nn.Module, kv_caches: list, config: EngineConfig, device: torch.device,
                  tp_world_size: int) -> Optional[DecodeGraphs]:
    """Graphs where they serve: CUDA, one rank, not --enforce-eager, a cache to capture against, and no attention
    soft-cap (Gemma 2: the ops' torch reference runs it, reading context lengths on the host). A capture that
    fails (an op of a model that cannot be captured, memory) leaves the engine eager, with a warning that says so."""
    args = getattr(model, "args", None)
    if (device.type != "cuda" or config.enforce_eager or tp_world_size > 1 or not kv_caches
            or kv_caches[0][0].numel() == 0 or getattr(args, "attn_softcap", None) is not None):
        return None
    try:
        return DecodeGraphs.capture(model, kv_caches, config, device)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        logger.warning("CUDA graphs: capture failed, every step runs eagerly (as --enforce-eager): %s", exc)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return None
