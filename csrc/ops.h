// pagedserve compiled ops: the one header that declares them.
//
// Cache layout (every layer, key and value alike):
//   [num_blocks, num_kv_heads, block_size, head_size]
// A slot is block_id * block_size + offset; a negative slot is skipped.
// bindings.cpp registers these with Python and dispatches on the device of the
// tensors; engine/ops/__init__.py is the only Python module that loads them.
#pragma once

// Only the light ATen header: the kernels' files compile in seconds, and the
// heavy torch/extension.h (pybind) is paid once, in bindings.cpp.
#include <ATen/core/Tensor.h>

#include <vector>

namespace pagedserve {

namespace cpu {

// Decode attention: one query token per sequence over its first
// context_lens[i] cached tokens, GQA by num_heads / num_kv_heads.
// sliding_window > 0: only the last sliding_window of them (the query's own
// included, as HF's Mistral masks); block table entries wholly before that are
// never read (the block manager may have released them). 0: the whole context.
void paged_attention(
    at::Tensor& out,                  // [num_seqs, num_heads, head_size]
    const at::Tensor& query,          // [num_seqs, num_heads, head_size]
    const at::Tensor& key_cache,      // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& value_cache,    // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_tables,   // [num_seqs, max_blocks_per_seq] int32
    const at::Tensor& context_lens,   // [num_seqs] int32
    double scale,
    int64_t sliding_window,
    double softcap = 0.0);  // > 0: scores = tanh(scores / softcap) * softcap (Gemma 2); CPU only

// Prefill attention of one sequence: its q_len new tokens, causally, over the
// first context_len tokens of its blocks (the new ones last, after a cached
// prefix). GQA by num_heads / num_kv_heads. The caches may be any strided view
// with contiguous head vectors: a step's own K/V rows pass as one block.
// sliding_window as for paged_attention, per query token.
// CPU only (engine/ops/__init__.py runs the torch reference for CUDA tensors).
void prefill_attention(
    at::Tensor& out,                 // [q_len, num_heads, head_size], heads contiguous
    const at::Tensor& query,         // [q_len, num_heads, head_size] (rows may be strided)
    const at::Tensor& key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_table,   // [num_seq_blocks] int32
    int64_t context_len,
    double scale,
    int64_t sliding_window,
    double softcap = 0.0);  // as paged_attention's

// Writes each token's key/value row into its slot of the cache.
void reshape_and_cache(
    const at::Tensor& key,            // [num_tokens, num_kv_heads, head_size]
    const at::Tensor& value,          // [num_tokens, num_kv_heads, head_size]
    at::Tensor& key_cache,            // [num_blocks, num_kv_heads, block_size, head_size]
    at::Tensor& value_cache,          // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& slot_mapping);  // [num_tokens] int64

// Copies whole blocks inside each layer's cache, every layer in one call.
void copy_blocks(
    std::vector<at::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    std::vector<at::Tensor>& value_caches,  // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_mapping);       // [num_pairs, 2] int64 (src, dst)

// Copies whole blocks from each source tensor to its destination (device <->
// host pool): every layer's key and value cache in one call.
void swap_blocks(
    const std::vector<at::Tensor>& srcs,  // num_tensors x [num_src_blocks, ...]
    std::vector<at::Tensor>& dsts,        // num_tensors x [num_dst_blocks, ...] same block shape and dtype
    const at::Tensor& block_mapping);     // [num_pairs, 2] int64 (src, dst)

// ---- elementwise ops of a Llama block (CUDA kernels in the cuda namespace).
// float32 and bfloat16 (CUDA: float16 too), float32 math inside.

// out = weight * x / rms(x), per row (HF LlamaRMSNorm numerics).
void rms_norm(
    at::Tensor& out,           // [num_tokens, hidden], rows contiguous
    const at::Tensor& input,   // [num_tokens, hidden], rows contiguous (any row stride)
    const at::Tensor& weight,  // [hidden]
    double eps);

// In place: residual += input, then input = rms_norm(residual).
void fused_add_rms_norm(
    at::Tensor& input,         // [num_tokens, hidden]
    at::Tensor& residual,      // [num_tokens, hidden]
    const at::Tensor& weight,  // [hidden]
    double eps);

// out = silu(input[:, :d]) * input[:, d:].
void silu_and_mul(
    at::Tensor& out,           // [num_tokens, d]
    const at::Tensor& input);  // [num_tokens, 2 * d]

// out = gelu_tanh(input[:, :d]) * input[:, d:] (Gemma's gated MLP; torch's tanh-approximated GELU). CPU only.
void gelu_tanh_and_mul(
    at::Tensor& out,           // [num_tokens, d]
    const at::Tensor& input);  // [num_tokens, 2 * d]

// In place: each head vector of x normed as rms_norm does its rows (Qwen3's and Gemma 3's q/k norms). CPU only.
void rms_norm_heads(
    at::Tensor& x,             // [num_tokens, num_heads, head_size], head vectors contiguous (a strided view is fine)
    const at::Tensor& weight,  // [head_size]
    double eps);

// Neox-style RoPE in place on each head of x.
void rotary_embedding(
    const at::Tensor& positions,       // [num_tokens] int64
    at::Tensor& x,                     // [num_tokens, num_heads, head_size], head vectors contiguous
    const at::Tensor& cos_sin_cache);  // [max_position, head_size] float32: cos halves | sin halves

// ---- sampling (CPU only).

// Per row: the first index of the largest logit (torch.argmax) and
// log(sum(exp(logits))) (torch.logsumexp), in one read of the row.
void argmax_logsumexp(
    const at::Tensor& logits,  // [rows, vocab] float32 or bfloat16, rows contiguous
    at::Tensor& argmax,        // [rows] int64
    at::Tensor& logsumexp);    // [rows] float32

// ---- small-row linear (CPU only; csrc/cpu/small_gemm.cpp has the packed layouts).

// out = x @ W^T (+ bias) for a few rows, W packed by engine/model_executor/layers/cpu_linear.py's pack_small_rows.
void small_gemm(
    at::Tensor& out,                           // [M, N] x's dtype, rows contiguous; float32 for a bfloat16 x holds
                                               // the bfloat16 result widened (F.linear(...).float())
    const at::Tensor& x,                       // [M, K] same dtype, rows contiguous
    const at::Tensor& packed,                  // [blocks * 16 * K'] same dtype (1-D)
    const c10::optional<at::Tensor>& bias,     // [N] or None
    int64_t isa);                              // 0: the best this build has; 2 AVX2, 3 AVX-512F, 4 AVX-512 BF16

// A gated MLP's first linear and its activation in one pass: out = silu(gate) * up where [gate | up] = x @ W^T
// (+ bias), bit for bit small_gemm into a [M, 2N] buffer then silu_and_mul, without the buffer. Returns false,
// writing nothing, where the path has no fused tiles (AVX2) or N is not a multiple of 16: the caller runs the two.
bool small_gemm_glu(
    at::Tensor& out,                           // [M, N] float32 or bfloat16, rows contiguous
    const at::Tensor& x,                       // [M, K] same dtype, rows contiguous
    const at::Tensor& packed,                  // pack_small_rows(W [2N, K]): gate rows, then up rows
    const c10::optional<at::Tensor>& bias,     // [2N] or None
    int64_t isa);                              // as small_gemm's

// A head's greedy statistics without its logits: per row of x @ W^T (+ bias), W packed as small_gemm's with n
// output columns, the first index of the largest output, that output, and log(sum(exp(outputs))), the same values
// as small_gemm into [M, n] float32 then argmax_logsumexp (up to the order of the sum). The outputs are reduced
// a cache-sized panel of columns at a time and never written to memory.
void small_gemm_argmax_lse(
    const at::Tensor& x,                       // [M, K] float32 or bfloat16, rows contiguous
    const at::Tensor& packed,                  // pack_small_rows(W [n, K]), x's dtype
    const c10::optional<at::Tensor>& bias,     // [n] or None
    int64_t n,                                 // W's rows (the vocabulary)
    at::Tensor& argmax,                        // [M] int64
    at::Tensor& max,                           // [M] float32
    at::Tensor& logsumexp,                     // [M] float32
    int64_t isa);                              // as small_gemm's

// The best small_gemm path this build has (the isa codes above), 0 when none.
int64_t small_gemm_isa();

// ---- int8 (Q8_0) linear (CPU only; csrc/cpu/q8_gemm.cpp has the packed layout, engine/model_executor/layers/quant.py packs it).

// out = x @ W^T (+ bias) for any row count, W as llama.cpp's Q8_0 blocks packed by engine/model_executor/layers/quant.py's pack_q8.
void q8_gemm(
    at::Tensor& out,                           // [M, N] float32 or bfloat16, rows contiguous
    const at::Tensor& x,                       // [M, K] float32 or bfloat16, rows contiguous
    const at::Tensor& packed,                  // uint8, engine/model_executor/layers/quant.py q8_numel(N, K) bytes (1-D)
    const c10::optional<at::Tensor>& bias,     // [N] or None
    int64_t isa);                              // 0: the default; 2 AVX2 (x in two int8 parts per 32-block,
                                               // vpmaddwd), 3 AVX-512 (x in float32), 5 AVX-512 VNNI (x in two
                                               // int8 parts, vpdpbusd), 7 dequantized panels into torch's GEMM

// The best q8_gemm path (the isa codes above), 0 when none.
int64_t q8_gemm_isa();

// ---- GGML block-format linears (CPU only; csrc/cpu/kquant_gemm.cpp has the layout, formats.py packs it).

// out = x @ W^T (+ bias), W's row parts each in a GGML block format (Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K Q8_0).
void kquant_gemm(
    at::Tensor& out,                           // [M, N] float32 or bfloat16, rows contiguous
    const at::Tensor& x,                       // [M, K] float32 or bfloat16, rows contiguous
    const at::Tensor& blob,                    // int8, engine/model_executor/layers/formats.py pack_parts (1-D)
    const c10::optional<at::Tensor>& bias,     // [N] or None
    int64_t isa);                              // 0 the best; 1 plain C++, 2 AVX2, 3 AVX-512, 5 AVX-512 VNNI

// The best kquant_gemm path (the isa codes above; 1 when only plain C++).
int64_t kquant_gemm_isa();

// weight float32 [N, K] (K a multiple of 256) as llama.cpp's blocks of ggml type 12 (Q4_K), 13 (Q5_K) or 14
// (Q6_K): uint8 [N, K / 256 * block bytes], quantize_row_*_ref's bytes (csrc/cpu/ggml_quantize.cpp).
at::Tensor ggml_quantize_k(const at::Tensor& weight, int64_t type);

// A part's GGUF rows in the layout its kernel reads (csrc/cpu/kquant_pack.cpp): rows [row0, row0 + N) of a
// [total_rows, K] weight of ggml type 2..14 (Q4_0 .. Q6_K: kquant_gemm.cpp's tiles; 8, Q8_0: q8_gemm.cpp's layout)
// written into out, the bytes of formats.py pack_kquant / quant.py pack_q8 (row0 a multiple of 16; N too, unless
// these are the last rows).
void kquant_pack(
    const at::Tensor& raw,                     // [N, K / block * block bytes] uint8, rows contiguous
    int64_t type,                              // ggml type
    at::Tensor& out,                           // uint8 (1-D), the whole weight's packed bytes
    int64_t row0,
    int64_t total_rows);

// ---- mixture-of-experts MLP (CPU only; csrc/cpu/moe.cpp).

// out = sum over each token's k experts of topk_weights * down(silu(gate(x)) * up(x)), the tokens grouped by
// expert so that each chosen expert's weights are read once. w13[e] is expert e's [gate | up] [2 * inter, hidden]
// and w2[e] its down [hidden, inter], each packed as the dense kernels read it (small_gemm's float32 / bfloat16
// form, q8_gemm's uint8 Q8_0 form, or kquant_gemm's int8 blob of GGML blocks): engine/model_executor/layers/moe.py
// packs them. w13 and w2 share a float dtype, or are both quantized (a uint8 and an int8 one may pair).
void moe_experts(
    at::Tensor& out,                  // [T, hidden] x's dtype
    const at::Tensor& x,              // [T, hidden] float32 or bfloat16, rows contiguous
    const at::Tensor& topk_ids,       // [T, k] int64
    const at::Tensor& topk_weights,   // [T, k] float32
    const at::Tensor& w13,            // [E, packed gate | up]
    const at::Tensor& w2,             // [E, packed down]
    int64_t inter,
    int64_t isa);                     // kquant_gemm's path for int8 blobs (0: the best; tests pick each)

// A router's choice from its logits: softmax in float32, the top_k largest (the first index among equals), divided
// by their sum when renormalize, rounded to bfloat16 when round_bf16 (HF's Qwen3-MoE in bfloat16).
void moe_route(
    const at::Tensor& logits,  // [T, E] float32 or bfloat16
    int64_t top_k, bool renormalize, bool round_bf16,
    at::Tensor& ids,           // [T, top_k] int64
    at::Tensor& weights);      // [T, top_k] float32

// Bytes of expert weights moe_experts has read since the last call with reset (a benchmark's counter).
int64_t moe_bytes_read(bool reset);

// moe_route over logits, then moe_experts (round_weights: to x's dtype). out may be x.
void moe_forward(at::Tensor& out, const at::Tensor& x, const at::Tensor& logits, const at::Tensor& w13,
                 const at::Tensor& w2, int64_t inter, int64_t top_k, bool renormalize, bool round_weights);

// ---- a CPU step's decoder layers in one call (csrc/cpu/decode_layers.cpp; CPU only).

// Runs every decoder layer of a Llama-family model on a step's T tokens with the kernels above, as
// engine/model_executor/models/llama.py's eager layers call them (gate_up and silu_and_mul fused into small_gemm_glu where it
// serves, the same bits), and returns the residual stream after the last layer (before
// the final norm): [T, hidden]. The tokens are laid out as the eager step's: the prefill spans first (each a
// (start, end, context_len) triple in `prefill_spans`; its table in `prefill_tables`, empty when the span has no
// cached prefix and attends over its own rows), then one decode token per sequence. Each layer's
// decode_layer_slots() tensors lie in `weights` in the order input norm, qkv, qkv bias, q norm, k norm, o, o bias,
// attention-output norm, pre-MLP norm, gate_up, gate_up bias, down, down bias, MLP-output norm, a shared expert's
// gate_up, down and gate (csrc/cpu/decode_layers.cpp Slot); linears as pack_small_rows weights, an absent bias or norm as an empty tensor.
// cos_sins: each layer's RoPE table (the same tensor for layers sharing one); mlp_act: 0 silu, 1 gelu_tanh;
// softcap: the attention scores' soft-cap (Gemma 2), 0 for none.
at::Tensor llama_decode_layers(
    const at::Tensor& embeddings,                 // [T, hidden]
    const at::Tensor& positions,                  // [T] int64
    const std::vector<at::Tensor>& cos_sins,      // num_layers x [max_position, head_size] float32
    const std::vector<at::Tensor>& weights,       // num_layers * decode_layer_slots()
    const std::vector<at::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const std::vector<at::Tensor>& value_caches,  // num_layers x the same
    const at::Tensor& slot_mapping,               // [T] int64
    const std::vector<int64_t>& prefill_spans,    // 3 per prefill: start, end, context_len
    const std::vector<at::Tensor>& prefill_tables,  // 1 per prefill: [num_seq_blocks] int32, or empty
    const at::Tensor& block_tables,               // [D, max_blocks_per_seq] int32 for the D decode tokens
    const at::Tensor& context_lens,               // [D] int32
    const std::vector<int64_t>& windows,          // per layer: its sliding window, 0 for the whole context
    int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t intermediate_size, double eps,
    double scale, int64_t mlp_act, double softcap);

// How many tensors each layer has in llama_decode_layers' `weights`.
int64_t decode_layer_slots();

}  // namespace cpu

#ifdef PAGEDSERVE_CUDA
// Same contracts as the CPU ops; the tensors live on a CUDA device
// (swap_blocks: one side may be pinned host memory). Implemented in
// cuda/torch_bindings.cpp on top of the raw launchers of cuda/launchers.h.
namespace cuda {

void paged_attention(
    at::Tensor& out,                  // [num_seqs, num_heads, head_size]
    const at::Tensor& query,          // [num_seqs, num_heads, head_size]
    const at::Tensor& key_cache,      // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& value_cache,    // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_tables,   // [num_seqs, max_blocks_per_seq] int32
    const at::Tensor& context_lens,   // [num_seqs] int32
    double scale,
    int64_t sliding_window);

void reshape_and_cache(
    const at::Tensor& key,            // [num_tokens, num_kv_heads, head_size]
    const at::Tensor& value,          // [num_tokens, num_kv_heads, head_size]
    at::Tensor& key_cache,            // [num_blocks, num_kv_heads, block_size, head_size]
    at::Tensor& value_cache,          // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& slot_mapping);  // [num_tokens] int64

void copy_blocks(
    std::vector<at::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    std::vector<at::Tensor>& value_caches,  // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_mapping);       // [num_pairs, 2] int64 (src, dst)

// All num_tensors * num_pairs copies in one cudaMemcpyBatchAsync (CUDA >= 12.8)
// on the current stream, which must not be the legacy default stream for that;
// there, and before 12.8, one cudaMemcpyAsync each.
void swap_blocks(
    const std::vector<at::Tensor>& srcs,  // num_tensors x [num_src_blocks, ...]
    std::vector<at::Tensor>& dsts,        // num_tensors x [num_dst_blocks, ...]
    const at::Tensor& block_mapping);     // [num_pairs, 2] int64 (src, dst), on the CPU

void rms_norm(
    at::Tensor& out,           // [num_tokens, hidden], rows contiguous
    const at::Tensor& input,   // [num_tokens, hidden], rows contiguous
    const at::Tensor& weight,  // [hidden]
    double eps);

void fused_add_rms_norm(
    at::Tensor& input,         // [num_tokens, hidden]
    at::Tensor& residual,      // [num_tokens, hidden]
    const at::Tensor& weight,  // [hidden]
    double eps);

void silu_and_mul(
    at::Tensor& out,           // [num_tokens, d]
    const at::Tensor& input);  // [num_tokens, 2 * d]

void rotary_embedding(
    const at::Tensor& positions,       // [num_tokens] int64
    at::Tensor& x,                     // [num_tokens, num_heads, head_size], head vectors contiguous
    const at::Tensor& cos_sin_cache);  // [max_position, head_size] float32: cos halves | sin halves

// Bytes of float32 scratch paged_attention allocates for this batch shape: 0
// when it runs the single-pass kernel, > 0 when it runs the partitioned (v2)
// kernel and its reduce. max_context_len: block table width times block_size.
int64_t paged_attention_workspace_bytes(int64_t num_seqs, int64_t num_heads, int64_t head_size,
                                        int64_t max_context_len, int64_t sliding_window);

}  // namespace cuda
#endif

}  // namespace pagedserve
