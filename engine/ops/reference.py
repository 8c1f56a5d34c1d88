"""Pure-torch reference for every compiled op: the test oracle, and the backend where no kernels build.

Same signatures and cache layout as engine/ops/__init__.py: per layer [num_blocks, num_kv_heads,
block_size, head_size]; a slot is block_id * block_size + offset and a negative slot is skipped.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

BlockMapping = Union[torch.Tensor, Mapping[int, int], Sequence[tuple[int, int]]]


def _as_mapping(block_mapping: BlockMapping) -> torch.Tensor:
    if isinstance(block_mapping, torch.Tensor):
        return block_mapping.to(device="cpu", dtype=torch.int64).reshape(-1, 2)
    pairs = list(block_mapping.items()) if isinstance(block_mapping, Mapping) else list(block_mapping)
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def ref_rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, round to the input dtype, then scale (rounded again)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return out.copy_(weight * normed.to(x.dtype))


def ref_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x (in its dtype), then x = rms_norm(residual)."""
    residual.add_(x)
    ref_rms_norm(x, residual, weight, eps)


def ref_silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the input's dtype, as torch's F.silu(gate) * up rounds it."""
    gate, up = x.chunk(2, dim=-1)
    return out.copy_(torch.nn.functional.silu(gate) * up)


def ref_gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up in the input's dtype, as HF's gelu_pytorch_tanh(gate) * up rounds it (Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return out.copy_(torch.nn.functional.gelu(gate, approximate="tanh") * up)


def ref_rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Each head vector of x [num_tokens, num_heads, head_size] normed as ref_rms_norm does a row, in place."""
    x.copy_(ref_rms_norm(torch.empty_like(x), x, weight, eps))


def softcap_(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Gemma 2's soft-capping in place, as HF computes it: x = tanh(x / cap) * cap (None: x unchanged)."""
    return x if cap is None else x.div_(cap).tanh_().mul_(cap)


def ref_rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """HF's x * cos + rotate_half(x) * sin in x's dtype, written back into x."""
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_size // 2]
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def ref_argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), logits.float().logsumexp(dim=-1)


_SMALL_BLOCK = 16  # output columns per block of engine/model_executor/layers/cpu_linear.py's pack_small_rows layout


def unpack_small_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [n, k] back from pack_small_rows' layout (float32 [N/16][K][16], bfloat16 [N/16][K/2][16][2], zero-padded);
    RuntimeError, as the kernel's, when the element count does not fit n and k."""
    depth = k if packed.dtype == torch.float32 else k + k % 2  # bfloat16: K padded to whole pairs
    blocks = -(-n // _SMALL_BLOCK)
    if packed.dim() != 1 or packed.numel() != blocks * _SMALL_BLOCK * depth:
        raise RuntimeError(f"small_gemm: packed weight has {packed.numel()} elements, expected "
                           f"{blocks * _SMALL_BLOCK * depth} for N={n} K={k}")
    if packed.dtype == torch.float32:
        w = packed.view(blocks, depth, _SMALL_BLOCK).transpose(1, 2)
    else:
        w = packed.view(blocks, depth // 2, _SMALL_BLOCK, 2).permute(0, 2, 1, 3)
    return w.reshape(blocks * _SMALL_BLOCK, depth)[:n, :k]


def ref_small_gemm(out: torch.Tensor,  # [rows, N] x's dtype, or float32 for a bfloat16 x (the result widened)
                   x: torch.Tensor,  # [rows, K] float32 or bfloat16
                   packed: torch.Tensor,  # pack_small_rows(W [N, K])
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # [N]
    """out = x @ W^T (+ bias), summed in float32 and rounded once to x's dtype, as the kernel does."""
    if x.dtype != packed.dtype or out.dtype not in (x.dtype, torch.float32):
        raise RuntimeError(f"small_gemm: x, out and the packed weight share one dtype (or a bfloat16 GEMM's out is "
                           f"float32), got {x.dtype}, {out.dtype}, {packed.dtype}")
    weight = unpack_small_rows(packed, out.shape[-1], x.shape[-1])
    result = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.copy_(result.to(x.dtype))


def ref_small_gemm_argmax_lse(x: torch.Tensor,  # [rows, K] float32 or bfloat16
                              packed: torch.Tensor,  # pack_small_rows(W [n, K])
                              n: int,
                              bias: Optional[torch.Tensor] = None,  # [n]
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(argmax int64, max float32, logsumexp float32) per row of the head's float32 outputs (ref_small_gemm's)."""
    logits = ref_small_gemm(torch.empty(x.shape[0], n, dtype=torch.float32), x, packed, bias)
    argmax, lse = ref_argmax_logsumexp(logits)
    return argmax, logits.gather(1, argmax.unsqueeze(1)).squeeze(1), lse


def ref_small_gemm_glu(out: torch.Tensor,  # [rows, N] x's dtype
                       x: torch.Tensor,  # [rows, K]
                       packed: torch.Tensor,  # pack_small_rows(W [2N, K]): gate rows, then up rows
                       bias: Optional[torch.Tensor] = None) -> bool:  # [2N]
    """silu(gate) * up of [gate | up] = x @ W^T (+ bias): the two ops the kernel fuses. Always serves (True)."""
    gate_up = ref_small_gemm(x.new_empty(x.shape[0], 2 * out.shape[-1]), x, packed, bias)
    ref_silu_and_mul(out, gate_up)
    return True


def gather_context(
    cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
    start: int = 0,
) -> torch.Tensor:  # [num_kv_heads, context_len - start, head_size]
    """One sequence's cached K (or V) rows [start, context_len), in order, copied out of its blocks.

    Blocks wholly before `start` are not read: under a sliding window they may have been released."""
    block_size = cache.shape[2]
    first = start // block_size
    table = block_table[first:(context_len + block_size - 1) // block_size]
    blocks = cache[table.long().to(cache.device)]  # [num_read_blocks, num_kv_heads, block_size, head_size]
    num_kv_heads, head_size = blocks.shape[1], blocks.shape[3]
    rows = blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_size)
    return rows[:, start - first * block_size:context_len - first * block_size]


def window_start(last_position: int, sliding_window: Optional[int]) -> int:
    """The first context token a query at last_position attends to: HF's window holds the query and the
    sliding_window - 1 tokens before it (key j is seen when last_position - sliding_window < j <= last_position)."""
    return 0 if sliding_window is None else max(0, last_position - sliding_window + 1)


def ref_paged_attention(
    out: torch.Tensor,  # [num_seqs, num_heads, head_size]
    query: torch.Tensor,  # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> None:
    """Plain-torch paged decode attention, float32 math, one sequence at a time; with a window,
    over the last sliding_window tokens only; with a softcap, the scores capped first (Gemma 2)."""
    group = query.shape[1] // key_cache.shape[1]
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:  # nothing cached: defined as zeros
            out[i].zero_()
            continue
        start = window_start(n - 1, sliding_window)

        def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_heads, n - start, head_size]
            return gather_context(cache, block_tables[i], n, start).float().repeat_interleave(group, dim=0)

        scores = softcap_(torch.einsum("hd,hnd->hn", query[i].float(), gather(key_cache)) * scale, softcap)
        probs = torch.softmax(scores, dim=-1)  # softmax subtracts the max: safe
        out[i] = torch.einsum("hn,hnd->hd", probs, gather(value_cache)).to(out.dtype)


def ref_prefill_attention(
    out: torch.Tensor,  # [q_len, num_heads, head_size]
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """SDPA in float32 over the gathered context, with GQA copies and a causal mask offset by the cached
    prefix (and, with a window, cut to each query's last sliding_window tokens); with a softcap (Gemma 2) the
    scores are capped before the mask, as HF's eager attention does."""
    q_len, group = query.shape[0], query.shape[1] // key_cache.shape[1]
    start = window_start(context_len - q_len, sliding_window)  # the first query's window: nothing earlier is read

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [num_heads, context_len - start, head_size]
        return gather_context(cache, block_table, context_len, start).float().repeat_interleave(group, dim=0)

    mask = causal_window_mask(q_len, context_len, start, sliding_window, query.device)
    q, k, v = query.float().transpose(0, 1), gather(key_cache), gather(value_cache)
    if softcap is None:
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = softcap_(q @ k.transpose(1, 2) * scale, softcap).masked_fill_(~mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ v
    return out.copy_(attn.transpose(0, 1))


def causal_window_mask(q_len: int, context_len: int, start: int, sliding_window: Optional[int],
                       device: torch.device) -> torch.Tensor:  # [q_len, context_len - start] bool
    """Which of the keys [start, context_len) each of the last q_len tokens of the context sees."""
    query_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    key_pos = torch.arange(start, context_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def ref_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Plain-torch slot writes."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(key_cache.device)
    blocks, offsets = slots // block_size, slots % block_size
    # Indices split by a slice put the token dim first: [n, num_kv_heads, head_size].
    key_cache[blocks, :, offsets] = key[keep.to(key.device)]
    value_cache[blocks, :, offsets] = value[keep.to(value.device)]


def ref_copy_blocks(
    key_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    value_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Plain-torch block copies, pair by pair, every layer."""
    for src, dst in _as_mapping(block_mapping).tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst].copy_(cache[src])


def ref_swap_blocks(
    srcs: list[torch.Tensor],  # num_tensors x [num_src_blocks, ...]
    dsts: list[torch.Tensor],  # num_tensors x [num_dst_blocks, ...]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Plain-torch block copies from each source tensor to its destination (any devices)."""
    for s, d in _as_mapping(block_mapping).tolist():
        for src, dst in zip(srcs, dsts, strict=True):
            dst[d].copy_(src[s])
