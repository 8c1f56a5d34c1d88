"""Attention over the paged KV cache: write new K/V, prefill (CPU kernel; on CUDA the kernel the engine probed,
engine/model_executor/layers/prefill_kernels.py, or SDPA per sequence), decode."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engine import ops

from engine.ops import reference as ref_ops
from engine.model_executor.layers.prefill_kernels import PrefillBatch, sdpa

KVCache = tuple[torch.Tensor, torch.Tensor]  # key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_size]
_ONE_BLOCK = torch.zeros(1, dtype=torch.int32)  # [1]: the block table of a prefill's own K/V seen as one block


@dataclass
class PrefillSpan:
    """One sequence computing several tokens: rows [start, end) of the batch, its last `end - start` of `context_len`."""

    start: int
    end: int
    context_len: int  # tokens of the sequence after this step (cached prefix + new)
    # [num_blocks] int32, only when a cached prefix must be read back (context_len > end - start).
    block_table: Optional[torch.Tensor] = None

    @property
    def num_cached(self) -> int:
        return self.context_len - (self.end - self.start)


@dataclass
class AttentionMetadata:
    """Where each token of a flattened batch goes: prefill spans first, then one token per decoding sequence."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; negative: do not write (profiling)
    prefills: list[PrefillSpan] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_block_tables: Optional[torch.Tensor] = None  # [num_decodes, max_blocks] int32
    decode_context_lens: Optional[torch.Tensor] = None  # [num_decodes] int32
    # The spans as the engine's batched prefill kernel takes them, built once per step (ModelRunner.forward);
    # None where the step has a cached prefix or the engine has no such kernel (the CPU).
    prefill_batch: Optional[PrefillBatch] = None

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode_context_lens is None else self.decode_context_lens.shape[0]


class Attention(torch.nn.Module):
    """Multi-head attention with GQA for the tokens of one layer, reading and writing that layer's cache.

    With a sliding window each token attends to the last sliding_window tokens, its own included (HF's
    Mistral mask); cache blocks wholly before that are never read, so the block manager may release them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # Gemma 2: scores = tanh(scores / softcap) * softcap (the ops' reference runs it)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: Optional[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        if kv_cache is not None and kv_cache[0].numel() > 0:
            ops.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = torch.empty_like(query)
        n_pre = meta.num_prefill_tokens
        if meta.prefills:
            if meta.prefill_batch is not None and self.sliding_window is None and self.softcap is None:
                out[:n_pre] = meta.prefill_batch.run(query[:n_pre], key[:n_pre], value[:n_pre], self.scale)
            elif query.is_cuda and self.softcap is None:
                for span in meta.prefills:
                    out[span.start:span.end] = self._prefill_sdpa(query, key, value, kv_cache, span)
            else:
                for span in meta.prefills:
                    self._prefill_cpu(out, query, key, value, kv_cache, span)
        if meta.num_decode_tokens:
            ops.paged_attention(
                out[n_pre:], query[n_pre:], kv_cache[0], kv_cache[1],
                meta.decode_block_tables, meta.decode_context_lens, self.scale, self.sliding_window, self.softcap,
            )
        return out

    def _prefill_cpu(self, out, query, key, value, kv_cache: Optional[KVCache], span: PrefillSpan) -> None:
        # One kernel, GQA without K/V copies, writing its rows of out in place (SDPA's CPU flash kernel
        # took 2-3x longer, plus repeat_interleave copies for GQA and a gather for a cached prefix).
        rows = slice(span.start, span.end)
        if span.num_cached == 0:  # this step's own K/V rows, seen as one block: [1, num_kv_heads, q_len, head_size]
            k, v = key[rows].transpose(0, 1).unsqueeze(0), value[rows].transpose(0, 1).unsqueeze(0)
            table = _ONE_BLOCK
        else:  # the blocks hold the prefix and, just written, this step's K/V
            k, v, table = kv_cache[0], kv_cache[1], span.block_table
        ops.prefill_attention(out[rows], query[rows], k, v, table, span.context_len, self.scale, self.sliding_window,
                              self.softcap)

    def _prefill_sdpa(self, query, key, value, kv_cache: Optional[KVCache], span: PrefillSpan) -> torch.Tensor:
        q = query[span.start:span.end].transpose(0, 1)  # [num_heads, q_len, head_size]
        q_len, mask = span.end - span.start, None
        if span.num_cached == 0:
            k = key[span.start:span.end].transpose(0, 1)  # [num_kv_heads, q_len, head_size]
            v = value[span.start:span.end].transpose(0, 1)
            if self.sliding_window is not None:
                mask = ref_ops.causal_window_mask(q_len, q_len, 0, self.sliding_window, q.device)
        else:
            # The prefix cache already holds the first tokens: read the context back from the blocks, from the
            # first query's window on (this step's K/V were just written there too), under an offset causal mask.
            start = ref_ops.window_start(span.num_cached, self.sliding_window)
            k = ref_ops.gather_context(kv_cache[0], span.block_table, span.context_len, start)  # [kv_heads, n, hs]
            v = ref_ops.gather_context(kv_cache[1], span.block_table, span.context_len, start)
            mask = ref_ops.causal_window_mask(q_len, span.context_len, start, self.sliding_window, q.device)
        return sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, self.scale)  # [q_len, heads, hs]
