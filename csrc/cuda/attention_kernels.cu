// CUDA paged decode attention: the dtype dispatch and the workspace size. The kernels are in
// paged_decode.cuh, instantiated once per cache dtype by attention_{f32,f16,bf16}.cu.
#include "launchers.h"

namespace pagedserve {
namespace cuda_kernels {

size_t paged_attention_workspace_bytes(int num_seqs, int num_heads, int head_size, int max_context_len,
                                       int sliding_window) {
  if (sliding_window > 0 && sliding_window < max_context_len) max_context_len = sliding_window;
  const int parts = paged_decode_partitions(max_context_len);
  if (parts <= 1) return 0;
  const size_t rows = static_cast<size_t>(num_seqs) * num_heads * parts;
  return rows * (head_size + 2) * sizeof(float);
}

cudaError_t paged_attention_launch(DType dtype, void* out, const void* query, const void* key_cache,
                                   const void* value_cache, const int32_t* block_tables,
                                   const int32_t* context_lens, float* workspace, int num_seqs, int num_heads,
                                   int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
                                   int max_context_len, int64_t q_stride_seq, int64_t q_stride_head, float scale,
                                   int sliding_window, cudaStream_t stream) {
  if (num_seqs == 0) return cudaSuccess;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || sliding_window < 0) return cudaErrorInvalidValue;
  // A query attends to at most sliding_window tokens: that bounds the partitions.
  if (sliding_window > 0 && sliding_window < max_context_len) max_context_len = sliding_window;
  if (paged_decode_partitions(max_context_len) > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const PagedDecodeArgs args{out, query, key_cache, value_cache, block_tables, context_lens, workspace,
                             num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq,
                             max_context_len, q_stride_seq, q_stride_head, scale, sliding_window};
  switch (dtype) {
    case DType::kFloat32:
      return paged_decode_f32(args, stream);
    case DType::kFloat16:
      return paged_decode_f16(args, stream);
    case DType::kBFloat16:
      return paged_decode_bf16(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_kernels
}  // namespace pagedserve
