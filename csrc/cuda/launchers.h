// Raw-pointer launchers of the CUDA kernels. Needs only CUDA headers, so the
// .cu files compile with plain nvcc (scripts/check_cuda.sh) on a machine with
// no GPU and no CUDA torch; torch_bindings.cpp adapts tensors to these.
// Cache layout: [num_blocks, num_kv_heads, block_size, head_size].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pagedserve {
namespace cuda_kernels {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Context tokens one thread block handles in the paged decode kernel (paged_decode.cuh): a sequence whose
// attended span is longer is split into partitions that a second kernel merges. Fixed, so that a
// sequence's result never depends on the batch it is in.
constexpr int kPartitionSize = 256;
// Partitions whose merge weights the reduce keeps in shared memory (longer contexts recompute them).
constexpr int kMaxReducePartitions = 512;

// Partitions of the longest attended span (max_context_len may be an upper bound: the block table's width
// times the block size, which avoids reading context_lens back to the host).
inline int paged_decode_partitions(int max_context_len) {
  return max_context_len <= 0 ? 1 : (max_context_len + kPartitionSize - 1) / kPartitionSize;
}

// Bytes of float32 scratch the attention launch needs (0 when every sequence fits one partition).
size_t paged_attention_workspace_bytes(int num_seqs, int num_heads, int head_size, int max_context_len,
                                       int sliding_window);

// One paged decode launch's arguments (paged_attention_launch fills them).
struct PagedDecodeArgs {
  void* out;                    // [num_seqs, num_heads, head_size] contiguous
  const void* query;            // [num_seqs, num_heads, head_size] rows strided by q_stride_*
  const void* key_cache;        // [num_blocks, num_kv_heads, block_size, head_size]
  const void* value_cache;      // [num_blocks, num_kv_heads, block_size, head_size]
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens;  // [num_seqs]
  float* workspace;             // paged_attention_workspace_bytes(...) bytes, or null when that is 0
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int max_context_len;          // bounds every attended span (a window's length when it is shorter)
  int64_t q_stride_seq, q_stride_head;
  float scale;
  int sliding_window;           // > 0: each query sees its last sliding_window tokens; 0: the whole context
};

// The per-dtype launchers (attention_{f32,f16,bf16}.cu).
cudaError_t paged_decode_f32(const PagedDecodeArgs& args, cudaStream_t stream);
cudaError_t paged_decode_f16(const PagedDecodeArgs& args, cudaStream_t stream);
cudaError_t paged_decode_bf16(const PagedDecodeArgs& args, cudaStream_t stream);

cudaError_t paged_attention_launch(
    DType dtype,
    void* out,                  // [num_seqs, num_heads, head_size] contiguous
    const void* query,          // [num_seqs, num_heads, head_size] rows strided by q_stride_*
    const void* key_cache,      // [num_blocks, num_kv_heads, block_size, head_size]
    const void* value_cache,    // [num_blocks, num_kv_heads, block_size, head_size]
    const int32_t* block_tables,  // [num_seqs, max_blocks_per_seq]
    const int32_t* context_lens,  // [num_seqs]
    float* workspace,           // paged_attention_workspace_bytes(...) bytes, or null when that is 0
    int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
    int max_context_len, int64_t q_stride_seq, int64_t q_stride_head, float scale,
    int sliding_window,         // > 0: each query sees its last sliding_window tokens; 0: the whole context
    cudaStream_t stream);

cudaError_t reshape_and_cache_launch(
    const void* key,            // [num_tokens, num_kv_heads, head_size] rows strided by key_stride_*
    const void* value,          // [num_tokens, num_kv_heads, head_size] rows strided by value_stride_*
    void* key_cache,            // [num_blocks, num_kv_heads, block_size, head_size]
    void* value_cache,          // [num_blocks, num_kv_heads, block_size, head_size]
    const int64_t* slot_mapping,  // [num_tokens] on the device
    int num_tokens, int num_kv_heads, int head_size, int block_size, int elem_bytes,
    int64_t key_stride_token, int64_t key_stride_head, int64_t value_stride_token, int64_t value_stride_head,
    cudaStream_t stream);

// One launch for every layer. Pairs run in parallel: a block must not be both
// a source and a destination in one call.
cudaError_t copy_blocks_launch(
    const int64_t* key_cache_ptrs,    // [num_layers] device array of layer base addresses
    const int64_t* value_cache_ptrs,  // [num_layers] device array of layer base addresses
    const int64_t* block_mapping,     // [num_pairs, 2] (src, dst) on the device
    int num_layers, int num_pairs, int64_t bytes_per_block, bool aligned16, cudaStream_t stream);

// Async block copies between any two of device / pinned host memory, queued on
// stream: pair p of tensor t copies srcs[t] block mapping[p][0] to dsts[t] block
// mapping[p][1]. All num_tensors * num_pairs copies go in one
// cudaMemcpyBatchAsync (CUDA >= 12.8, stream not the legacy default stream),
// else one cudaMemcpyAsync each. The copies of one call run in no set order:
// a block must not be both a destination and a source in one call.
cudaError_t swap_blocks_launch(
    const void* const* srcs,          // [num_tensors] host array of [num_src_blocks, ...] bases
    void* const* dsts,                // [num_tensors] host array of [num_dst_blocks, ...] bases
    int num_tensors,
    const int64_t* block_mapping,     // [num_pairs, 2] (src, dst) in host memory
    int num_pairs, int64_t bytes_per_block, cudaStream_t stream);

// Elementwise ops of a Llama block, one launch each (elementwise_kernels.cu);
// same numerics as engine/ops/reference.py. Rows are contiguous, row strides in elements.

// out = weight * x / rms(x), per row.
cudaError_t rms_norm_launch(DType dtype,
                            void* out,            // [num_tokens, hidden]
                            const void* input,    // [num_tokens, hidden]
                            const void* weight,   // [hidden]
                            int num_tokens, int hidden, int64_t in_stride, int64_t out_stride, float eps,
                            cudaStream_t stream);

// In place: residual += input, then input = rms_norm(residual).
cudaError_t fused_add_rms_norm_launch(DType dtype,
                                      void* input,         // [num_tokens, hidden]
                                      void* residual,      // [num_tokens, hidden]
                                      const void* weight,  // [hidden]
                                      int num_tokens, int hidden, int64_t in_stride, int64_t res_stride, float eps,
                                      cudaStream_t stream);

// out = silu(input[:, :d]) * input[:, d:].
cudaError_t silu_and_mul_launch(DType dtype,
                                void* out,          // [num_tokens, d]
                                const void* input,  // [num_tokens, 2 * d]
                                int num_tokens, int d, int64_t in_stride, int64_t out_stride, cudaStream_t stream);

// Neox RoPE in place on each head of x; a position outside [0, max_position) leaves its token unrotated.
cudaError_t rotary_embedding_launch(DType dtype,
                                    const int64_t* positions,    // [num_tokens] on the device
                                    void* x,                     // [num_tokens, num_heads, head_size] strided
                                    const float* cos_sin_cache,  // [max_position, head_size]: cos | sin halves
                                    int num_tokens, int num_heads, int head_size, int max_position,
                                    int64_t stride_token, int64_t stride_head, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace pagedserve
