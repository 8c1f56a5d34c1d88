"""pagedserve's ops: each dispatches to the compiled kernel for its tensors' device, else to its reference.

Loading lives in engine/ops/build.py, the pure-torch references in engine/ops/reference.py.
Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_size]; a slot is
block_id * block_size + offset and a negative slot is skipped.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from engine.ops.build import (CUDA_HEAD_SIZES, BackendUnavailable, OpsBackend, backend, check_attention_geometry,  # noqa: F401
                               load as _load, require_backend)
from engine.ops.reference import (BlockMapping, _as_mapping, ref_argmax_logsumexp, ref_copy_blocks, ref_fused_add_rms_norm,
                            ref_paged_attention, ref_prefill_attention, ref_reshape_and_cache, ref_rms_norm,
                            ref_gelu_tanh_and_mul, ref_rms_norm_heads,
                            ref_rotary_embedding, ref_silu_and_mul, softcap_, ref_small_gemm, ref_small_gemm_argmax_lse, ref_small_gemm_glu,
                            ref_swap_blocks)


def _compiled_for(*tensors: torch.Tensor):
    """The compiled module if it serves these tensors' device, else None."""
    module = _load()
    if module is None:
        return None
    if any(t.is_cuda for t in tensors) and backend() is not OpsBackend.COMPILED_CUDA:
        return None
    return module


def _compiled_cpu_for(*tensors: torch.Tensor):
    """The compiled module for CPU-only ops (the elementwise ones), else None: CUDA tensors use the reference."""
    if any(t.is_cuda for t in tensors):
        return None
    return _load()


# ---------------------------------------------------------------- the ops


def paged_attention(
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
    """Decode attention of one query token per sequence over its paged context (with a window: its last
    sliding_window tokens, the query's own included; earlier blocks are never read); writes out. softcap (Gemma 2):
    scores = tanh(scores / softcap) * softcap; the CPU kernel caps, CUDA runs the torch reference for it."""
    module = _compiled_for(out, query, key_cache)
    if module is None or (softcap is not None and query.is_cuda):
        return ref_paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale,
                                   sliding_window, softcap)
    module.paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, float(scale),
                           _window_arg(sliding_window), _softcap_arg(softcap))


def prefill_attention(
    out: torch.Tensor,  # [q_len, num_heads, head_size], heads contiguous
    query: torch.Tensor,  # [q_len, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size] (a strided view is fine)
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    block_table: torch.Tensor,  # [num_seq_blocks] int32
    context_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of one sequence's q_len new tokens over the first context_len tokens of its blocks
    (a cached prefix, then the new ones), each over its last sliding_window tokens when given; GQA without
    K/V copies; softcap as paged_attention's. CPU kernel; CUDA runs the reference."""
    module = _compiled_cpu_for(query, key_cache)
    if module is None or query.dtype not in (*_ELEMENTWISE_DTYPES, torch.float16):
        return ref_prefill_attention(out, query, key_cache, value_cache, block_table, context_len, scale,
                                     sliding_window, softcap)
    module.prefill_attention(out, query, key_cache, value_cache, block_table, int(context_len), float(scale),
                             _window_arg(sliding_window), _softcap_arg(softcap))
    return out


def _window_arg(sliding_window: Optional[int]) -> int:
    """The kernels' encoding of a window: its length in tokens, 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return int(sliding_window)


def _softcap_arg(softcap: Optional[float]) -> float:
    """The kernels' encoding of a soft-cap: the cap, 0 for none."""
    if softcap is None:
        return 0.0
    if softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return float(softcap)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Writes each token's K/V rows into its cache slot; negative slots are skipped."""
    module = _compiled_for(key, key_cache)
    if module is None:
        return ref_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    value_caches: list[torch.Tensor],  # num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst), or {src: dst} / [(src, dst)]
) -> None:
    """Copies blocks src -> dst inside every layer's key and value cache, in pair order."""
    mapping = _as_mapping(block_mapping)
    if mapping.numel() == 0 or not key_caches:
        return
    module = _compiled_for(*key_caches[:1])
    if module is None:
        return ref_copy_blocks(key_caches, value_caches, mapping)
    module.copy_blocks(list(key_caches), list(value_caches), mapping)


def swap_blocks(
    srcs: list[torch.Tensor],  # num_tensors x [num_src_blocks, num_kv_heads, block_size, head_size]
    dsts: list[torch.Tensor],  # num_tensors x [num_dst_blocks, num_kv_heads, block_size, head_size]
    block_mapping: BlockMapping,  # [num_pairs, 2] int64 (src, dst), or {src: dst} / [(src, dst)]
) -> None:
    """Copies blocks from each source tensor into its destination (device <-> host swap pool): every layer's
    key and value cache in one call.

    On CUDA all the copies go in one batched memcpy on the current stream (CacheEngine uses a side stream);
    the host side must be pinned. The copies of one call run in no set order.
    """
    mapping = _as_mapping(block_mapping)
    if mapping.numel() == 0 or not srcs:
        return
    module = _compiled_for(*srcs[:1], *dsts[:1])
    if module is None:
        return ref_swap_blocks(srcs, dsts, mapping)
    module.swap_blocks(list(srcs), list(dsts), mapping)


# Elementwise ops of a Llama block: one pass each (one launch on CUDA), float32 math inside, on the calling
# thread for decode-sized CPU batches (an OpenMP wake-up costs more than the work).


def _compiled_elementwise(x: torch.Tensor, *others: torch.Tensor):
    """The compiled module if it has an elementwise kernel for x's device and dtype, else None (the reference)."""
    module = _compiled_for(x, *others)
    dtypes = _CUDA_ELEMENTWISE_DTYPES if x.is_cuda else _ELEMENTWISE_DTYPES
    return module if module is not None and x.dtype in dtypes else None


def rms_norm(
    out: torch.Tensor,  # [num_tokens, hidden], rows contiguous
    x: torch.Tensor,  # [num_tokens, hidden], rows contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """out = weight * x / rms(x) row by row, as HF's LlamaRMSNorm rounds it; returns out."""
    module = _compiled_elementwise(x, out, weight)
    if module is None:
        return ref_rms_norm(out, x, weight, eps)
    module.rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]; overwritten with the normalised sum
    residual: torch.Tensor,  # [num_tokens, hidden]; overwritten with residual + x
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> None:
    """In place: residual += x, then x = rms_norm(residual) (the two halves of a Llama block's hand-off)."""
    module = _compiled_elementwise(x, residual, weight)
    if module is None:
        return ref_fused_add_rms_norm(x, residual, weight, eps)
    module.fused_add_rms_norm(x, residual, weight, float(eps))


def silu_and_mul(
    out: torch.Tensor,  # [num_tokens, d]
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate | up
) -> torch.Tensor:
    """out = silu(gate) * up; returns out."""
    module = _compiled_elementwise(x, out)
    if module is None:
        return ref_silu_and_mul(out, x)
    module.silu_and_mul(out, x)
    return out


def gelu_tanh_and_mul(
    out: torch.Tensor,  # [num_tokens, d]
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate | up
) -> torch.Tensor:
    """out = gelu_tanh(gate) * up (Gemma's gated MLP); returns out. CPU kernel; CUDA runs the reference."""
    module = _compiled_cpu_for(x, out)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_gelu_tanh_and_mul(out, x)
    module.gelu_tanh_and_mul(out, x)
    return out


def rms_norm_heads(
    x: torch.Tensor,  # [num_tokens, num_heads, head_size], head vectors contiguous (a strided view is fine)
    weight: torch.Tensor,  # [head_size]
    eps: float,
) -> None:
    """In place: each head vector normed as rms_norm does a row (Qwen3's and Gemma 3's q/k norms). CPU kernel;
    CUDA runs the reference."""
    module = _compiled_cpu_for(x, weight)
    if module is None or x.dtype not in _ELEMENTWISE_DTYPES:
        return ref_rms_norm_heads(x, weight, eps)
    module.rms_norm_heads(x, weight, float(eps))


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    x: torch.Tensor,  # [num_tokens, num_heads, head_size], head vectors contiguous (a strided view is fine)
    cos_sin_cache: torch.Tensor,  # [max_position, head_size] float32: cos halves | sin halves
) -> None:
    """Neox-style RoPE in place on every head of x at its token's position."""
    module = _compiled_elementwise(x, cos_sin_cache)
    if module is None:
        return ref_rotary_embedding(positions, x, cos_sin_cache)
    module.rotary_embedding(positions, x, cos_sin_cache)


_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)  # the CPU kernels'
_CUDA_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@contextlib.contextmanager
def thread_omp_threads(n: int) -> Iterator[None]:
    """OpenMP threads of the parallel regions that THIS thread opens in the block (compiled ops and oneDNN GEMMs).
    Without the compiled module it changes nothing (torch.set_num_threads would change every thread)."""
    module = _load()
    if module is None:
        yield
        return
    previous = module.set_thread_omp_threads(n)
    try:
        yield
    finally:
        module.set_thread_omp_threads(previous)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [rows, vocab] logits: (the first index of the largest, int64 [rows]; logsumexp, float32 [rows]).

    Greedy decoding's token and the sampled token's logprob (logit - logsumexp) from one read of each row."""
    module = _compiled_cpu_for(logits)
    if module is None or logits.dtype not in _ELEMENTWISE_DTYPES or logits.dim() != 2 or logits.stride(-1) != 1:
        return ref_argmax_logsumexp(logits)
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    lse = torch.empty(logits.shape[0], dtype=torch.float32)
    module.argmax_logsumexp(logits, argmax, lse)
    return argmax, lse


# small_gemm's ISA paths (csrc/cpu/small_gemm.cpp); SMALL_GEMM_AUTO is the best one the build has.
SMALL_GEMM_AUTO, SMALL_GEMM_AVX2, SMALL_GEMM_AVX512, SMALL_GEMM_AVX512_BF16 = 0, 2, 3, 4


def small_gemm_isa() -> int:
    """The best small-row GEMM path of the compiled CPU kernels (SMALL_GEMM_*), 0 when there is none (no AVX2+FMA,
    or the reference backend): the caller then keeps oneDNN."""
    module = _load()
    return 0 if module is None else int(module.small_gemm_isa())


def small_gemm(out: torch.Tensor,  # [rows, N] x's dtype, or float32 for a bfloat16 x (the result widened)
               x: torch.Tensor,  # [rows, K] float32 or bfloat16, rows contiguous
               packed: torch.Tensor,  # engine/model_executor/layers/cpu_linear.py pack_small_rows(W [N, K])
               bias: Optional[torch.Tensor] = None,  # [N]
               isa: int = SMALL_GEMM_AUTO) -> torch.Tensor:
    """out = x @ W^T (+ bias), streaming W once for all rows: a decode step's linears (a few rows); the reference
    where no compiled CPU kernel serves (CUDA tensors, the torch backend). `isa` forces a path the build has (tests)."""
    module = _small_gemm_module(isa, out, x, packed)
    if module is None:
        return ref_small_gemm(out, x, packed, bias)
    module.small_gemm(out, x, packed, bias, isa)
    return out


def small_gemm_glu(out: torch.Tensor,  # [rows, N] float32 or bfloat16
                   x: torch.Tensor,  # [rows, K] same dtype, rows contiguous
                   packed: torch.Tensor,  # pack_small_rows(W [2N, K]): a gated MLP's gate rows, then its up rows
                   bias: Optional[torch.Tensor] = None,  # [2N]
                   isa: int = SMALL_GEMM_AUTO) -> bool:
    """out = silu(gate) * up where [gate | up] = x @ W^T (+ bias): small_gemm then silu_and_mul in one pass over the
    weights, the same bits. False (out untouched) where the path has no fused tiles (AVX2) or N % 16 != 0; the
    reference (always True) where no compiled CPU kernel serves."""
    module = _small_gemm_module(isa, out, x, packed)
    if module is None:
        return ref_small_gemm_glu(out, x, packed, bias)
    return bool(module.small_gemm_glu(out, x, packed, bias, isa))


def small_gemm_argmax_lse(x: torch.Tensor,  # [rows, K] float32 or bfloat16, rows contiguous
                          packed: torch.Tensor,  # pack_small_rows(W [n, K]), x's dtype
                          n: int,  # W's rows: the vocabulary of a head
                          bias: Optional[torch.Tensor] = None,  # [n]
                          isa: int = SMALL_GEMM_AUTO) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy head without its logits: per row of x @ W^T (+ bias) as small_gemm's float32 output, (the first
    index of the largest, int64 [rows]; that value, float32; logsumexp, float32). The [rows, n] outputs are reduced
    a cache-sized panel at a time and never written: at 256 rows of a 49,152 vocabulary, 50 MB not written to
    memory and read back by argmax_logsumexp."""
    module = _small_gemm_module(isa, x, packed)
    if module is None:
        return ref_small_gemm_argmax_lse(x, packed, n, bias)
    rows = x.shape[0]
    argmax = torch.empty(rows, dtype=torch.int64)
    best, lse = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    module.small_gemm_argmax_lse(x, packed, bias, n, argmax, best, lse, isa)
    return argmax, best, lse


def _small_gemm_module(isa: int, *tensors: torch.Tensor):
    """The compiled module for a small_gemm call, None for the reference (which has no ISA path to force); a build
    without a small-row kernel (PAGEDSERVE_CPU_ISA=generic) serves an auto call on the reference too."""
    module = _compiled_cpu_for(*tensors)
    if module is not None and isa == SMALL_GEMM_AUTO and int(module.small_gemm_isa()) == 0:
        module = None
    if module is None and isa != SMALL_GEMM_AUTO:
        raise RuntimeError(f"small_gemm: ISA path {isa} is not in this build (the torch reference has none)")
    return module


# q8_gemm's paths (csrc/cpu/q8_gemm.cpp): AVX2 and VNNI (the defaults where the CPU has them) split x per 32-block into
# two int8 parts and sum exactly in int32 (vpmaddwd, vpdpbusd); AVX-512 without VNNI widens the int8 weights to float32
# (x in float32); X16 is AVX2's int16 product against a column block's weights widened once (csrc/cpu/kquant_x16.cpp:
# AVX2's default for a prefill); PANEL dequantizes the weights a panel at a time for torch's GEMM (the default from a
# few dozen rows on AMX and AVX-512 BF16 CPUs).
Q8_GEMM_AUTO, Q8_GEMM_AVX2, Q8_GEMM_AVX512, Q8_GEMM_VNNI, Q8_GEMM_X16, Q8_GEMM_PANEL = 0, 2, 3, 5, 6, 7


def q8_gemm_isa() -> int:
    """The best int8 (Q8_0) GEMM path of the compiled CPU kernels on this CPU (Q8_GEMM_*), 0 when there is none."""
    module = _load()
    return 0 if module is None or not hasattr(module, "q8_gemm_isa") else int(module.q8_gemm_isa())


def q8_gemm(out: torch.Tensor,  # [rows, N] float32 or bfloat16
            x: torch.Tensor,  # [rows, K] float32 or bfloat16, rows contiguous
            packed: torch.Tensor,  # engine/model_executor/layers/quant.py pack_q8(Q8_0 blocks of W [N, K]), uint8
            bias: Optional[torch.Tensor] = None,  # [N]
            isa: int = Q8_GEMM_AUTO) -> torch.Tensor:
    """out = x @ W^T (+ bias) over int8 weights in llama.cpp's Q8_0 blocks, any row count. CPU, compiled only
    (q8_gemm_isa() > 0); `isa` forces a path this CPU has (tests)."""
    _load().q8_gemm(out, x, packed, bias, isa)
    return out


# kquant_gemm's paths (csrc/cpu/kquant_gemm.cpp): PLAIN C++, AVX2 (vpmaddwd on x's parts joined in int16:
# kquant_wide.cpp), AVX-512 (the same on zmm), VNNI (vpdpbusd; vpdpwssd for Q6_K from 8 rows), X16 (the same int16
# products against a column block's codes widened once: kquant_x16.cpp; AUTO takes it for a prefill on AVX2), PANEL
# (dequantized panels into torch's GEMM; AUTO takes it from a row threshold elsewhere).
KQUANT_AUTO, KQUANT_PLAIN, KQUANT_AVX2, KQUANT_AVX512, KQUANT_VNNI, KQUANT_X16, KQUANT_PANEL = 0, 1, 2, 3, 5, 6, 7


def kquant_gemm_isa() -> int:
    """The best path of the GGML block-format GEMM (KQUANT_*) in the compiled CPU kernels, 0 when none."""
    module = _load()
    return 0 if module is None or not hasattr(module, "kquant_gemm_isa") else int(module.kquant_gemm_isa())


def kquant_gemm(out: torch.Tensor,  # [rows, N] float32 or bfloat16, rows contiguous
                x: torch.Tensor,  # [rows, K] float32 or bfloat16, rows contiguous
                blob: torch.Tensor,  # int8, engine/model_executor/layers/formats.py pack_parts(parts of W [N, K])
                bias: Optional[torch.Tensor] = None,  # [N]
                isa: int = KQUANT_AUTO) -> torch.Tensor:
    """out = x @ W^T (+ bias), W's row parts each in its GGML block format (Q4_0 .. Q6_K, Q8_0), x quantized to
    int8 per block. CPU, compiled only (kquant_gemm_isa() > 0); `isa` forces a path the build has (tests)."""
    _load().kquant_gemm(out, x, blob, bias, isa)
    return out


def ggml_quantize_k(weight: torch.Tensor,  # [N, K] float32, contiguous, K a multiple of 256
                    ggml_type: int) -> Optional[torch.Tensor]:
    """weight as llama.cpp's K-quant blocks (ggml type 12 Q4_K, 13 Q5_K, 14 Q6_K): uint8 [N, K / 256 * block
    bytes], quantize_row_*_ref's bytes; None without the compiled CPU kernels (the caller runs its torch port)."""
    module = _load()
    if module is None or not hasattr(module, "ggml_quantize_k"):
        return None
    return module.ggml_quantize_k(weight, ggml_type)


def kquant_pack(raw: torch.Tensor,  # [N, K / block * block bytes] uint8, a GGUF part's rows, rows contiguous
                ggml_type: int,
                out: torch.Tensor,  # uint8 (1-D): the whole [total_rows, K] weight's packed bytes
                row0: int = 0,
                total_rows: Optional[int] = None) -> bool:
    """Writes raw, rows [row0, row0 + N) of a weight of ggml_type (Q4_0 .. Q6_K, Q8_0), into out in the layout its
    kernel reads: formats.py pack_kquant's bytes (quant.py pack_q8's for Q8_0). False without the compiled CPU
    kernels (the caller runs the torch form)."""
    module = _load()
    if module is None or not hasattr(module, "kquant_pack"):
        return False
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    module.kquant_pack(raw, int(ggml_type), out, int(row0), raw.shape[0] if total_rows is None else int(total_rows))
    return True


def decode_layer_slots() -> int:
    """Tensors per layer in llama_decode_layers' weights (the compiled module's count)."""
    return int(_load().decode_layer_slots())


def llama_decode_layers(
    embeddings: torch.Tensor,  # [T, hidden]: the prefill spans' tokens, then one decode token per sequence
    positions: torch.Tensor,  # [T] int64
    cos_sins: list[torch.Tensor],  # per layer [max_position, head_size] float32 (layers share their RoPE's table)
    weights: list[torch.Tensor],  # num_layers * decode_layer_slots() (engine/model_executor/models/compiled_decode.py)
    key_caches: list[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, head_size]
    value_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,  # [T] int64
    prefill_spans: list[int],  # 3 per prefill span: start, end, context_len (rows from 0, in order)
    prefill_tables: list[torch.Tensor],  # 1 per span: [num_seq_blocks] int32 with a cached prefix, else empty
    block_tables: torch.Tensor,  # [D, max_blocks] int32 for the D decode tokens (any [0, 1] tensor when none)
    context_lens: torch.Tensor,  # [D] int32
    windows: list[int],  # per layer, 0 for none
    num_heads: int, num_kv_heads: int, head_size: int, intermediate_size: int, eps: float, scale: float,
    mlp_act: int = 0,  # the MLP's activation: 0 silu, 1 gelu_tanh (llama_args.MLP_ACTS' index)
    softcap: Optional[float] = None,  # the attention scores' soft-cap (Gemma 2)
) -> torch.Tensor:
    """Every decoder layer of a CPU step in one compiled call (csrc/cpu/decode_layers.cpp), for any family of the
    spec: the residual stream after the last layer, [T, hidden], bit-identical to the eager layers'. CPU, compiled
    only."""
    return _load().llama_decode_layers(embeddings, positions, cos_sins, weights, key_caches, value_caches,
                                       slot_mapping, prefill_spans, prefill_tables, block_tables, context_lens,
                                       windows, num_heads, num_kv_heads, head_size, intermediate_size, float(eps),
                                       float(scale), int(mlp_act), _softcap_arg(softcap))


def moe_experts(out: torch.Tensor,  # [T, hidden] x's dtype
                x: torch.Tensor,  # [T, hidden] float32 or bfloat16, rows contiguous
                topk_ids: torch.Tensor,  # [T, k] int64
                topk_weights: torch.Tensor,  # [T, k] float32
                w13: torch.Tensor,  # [E, packed [gate | up] of [2 * inter, hidden]] (small-row float, Q8_0 uint8 or
                                    # a formats.pack_parts int8 blob of GGML blocks)
                w2: torch.Tensor,  # [E, packed down of [hidden, inter]], w13's float dtype or also quantized
                inter: int,
                isa: int = KQUANT_AUTO) -> torch.Tensor:  # kquant_gemm's path for int8 blobs (KQUANT_*)
    """A mixture-of-experts MLP (csrc/cpu/moe.cpp): sum over each token's k experts of its weight times the expert's
    down(silu(gate) * up), the tokens grouped by expert so each chosen expert's packed weights are read once
    (engine/model_executor/layers/moe.py packs them). CPU, compiled only; ref_moe is its reference."""
    _load().moe_experts(out, x, topk_ids.contiguous(), topk_weights.contiguous(), w13, w2, int(inter), int(isa))
    return out


def moe_forward(out: torch.Tensor,  # [T, hidden] x's dtype; may be x itself
                x: torch.Tensor,  # [T, hidden] float32 or bfloat16, rows contiguous
                logits: torch.Tensor,  # [T, E] the router's (float32 or bfloat16)
                w13: torch.Tensor, w2: torch.Tensor, inter: int,  # as moe_experts
                top_k: int, renormalize: bool, round_weights: bool) -> torch.Tensor:
    """HF's router on the logits (softmax in float32, top-k, renormalised when asked, rounded to x's dtype when
    round_weights), then moe_experts: the one call a CPU MoE layer makes, eager and compiled alike."""
    _load().moe_forward(out, x, logits, w13, w2, int(inter), int(top_k), bool(renormalize), bool(round_weights))
    return out


def moe_bytes_read(reset: bool = False) -> int:
    """Bytes of expert weights ops.moe_experts has read since the last reset (benchmarks/profile_step.py)."""
    return int(_load().moe_bytes_read(bool(reset)))
