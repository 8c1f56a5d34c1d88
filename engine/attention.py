"""Attention over the paged KV cache: write new K/V, prefill (CPU kernel; xformers or SDPA on CUDA), decode."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from engine import ops, ref_ops

try:  # CUDA prefill; not installed on CPU machines.
    from xformers import ops as xops
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
except ImportError:  # pragma: no cover - depends on the machine
    xops = None

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
    # xformers' block-diagonal causal bias for the prefills, built once per step (CUDA only).
    prefill_bias: object = None

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode_context_lens is None else self.decode_context_lens.shape[0]


class Attention(torch.nn.Module):
    """Multi-head attention with GQA for the tokens of one layer, reading and writing that layer's cache.

    With a sliding window each token attends to the last sliding_window tokens, its own included (HF's
    Mistral mask); cache blocks wholly before that are never read, so the block manager may release them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale
        self.sliding_window = sliding_window

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
            if meta.prefill_bias is not None and xops is not None and self.sliding_window is None:
                out[:n_pre] = self._prefill_xformers(query[:n_pre], key[:n_pre], value[:n_pre], meta.prefill_bias)
            elif query.is_cuda:
                for span in meta.prefills:
                    out[span.start:span.end] = self._prefill_sdpa(query, key, value, kv_cache, span)
            else:
                for span in meta.prefills:
                    self._prefill_cpu(out, query, key, value, kv_cache, span)
        if meta.num_decode_tokens:
            ops.paged_attention(
                out[n_pre:], query[n_pre:], kv_cache[0], kv_cache[1],
                meta.decode_block_tables, meta.decode_context_lens, self.scale, self.sliding_window,
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
        ops.prefill_attention(out[rows], query[rows], k, v, table, span.context_len, self.scale, self.sliding_window)

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
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # explicit GQA copies: SDPA's enable_gqa falls back to its slow math kernel on CPU
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=self.scale
        )[0]
        return out.transpose(0, 1)  # [q_len, num_heads, head_size]

    def _prefill_xformers(self, query, key, value, bias) -> torch.Tensor:
        # [1, num_prefill_tokens, heads, head_size]; GQA through a broadcast 5-D view (no copy).
        groups = self.num_heads // self.num_kv_heads
        t = query.shape[0]
        q = query.view(1, t, self.num_kv_heads, groups, self.head_size)
        k = key[:, :, None, :].expand(t, self.num_kv_heads, groups, self.head_size).unsqueeze(0)
        v = value[:, :, None, :].expand(t, self.num_kv_heads, groups, self.head_size).unsqueeze(0)
        out = xops.memory_efficient_attention_forward(q, k, v, attn_bias=bias, scale=self.scale)
        return out.view(t, self.num_heads, self.head_size)


def make_prefill_bias(prefills: list[PrefillSpan]):
    """xformers' block-diagonal causal mask for prefills without a cached prefix; None where xformers cannot serve.
    Windowed layers do not use it (they take the SDPA path with a windowed mask)."""
    if xops is None or not prefills or any(p.num_cached for p in prefills):
        return None
    return BlockDiagonalCausalMask.from_seqlens([p.end - p.start for p in prefills])
