// CUDA cache ops: slot writes, block copies for every layer in one launch, and
// async block swaps. They move bytes, so they work in element-sized words and
// are dtype-agnostic (same as csrc/cpu/cache.cpp).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "launchers.h"

namespace pagedserve {
namespace cuda_kernels {

namespace {

// One thread block per token; threads cover (kv head, dim).
template <typename Word>
__global__ void reshape_and_cache_kernel(
    const Word* __restrict__ key,           // [num_tokens, num_kv_heads, head_size] strided rows
    const Word* __restrict__ value,         // [num_tokens, num_kv_heads, head_size] strided rows
    Word* __restrict__ key_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    Word* __restrict__ value_cache,         // [num_blocks, num_kv_heads, block_size, head_size]
    const int64_t* __restrict__ slot_mapping,  // [num_tokens]
    int num_kv_heads, int head_size, int block_size, int64_t key_stride_token, int64_t key_stride_head,
    int64_t value_stride_token, int64_t value_stride_head) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_size + d;
    key_cache[dst] = key[token * key_stride_token + h * key_stride_head + d];
    value_cache[dst] = value[token * value_stride_token + h * value_stride_head + d];
  }
}

// Grid (layer, pair): copies block src -> dst of one layer's key and value cache.
template <typename Word>
__global__ void copy_blocks_kernel(
    const int64_t* __restrict__ key_cache_ptrs,    // [num_layers]
    const int64_t* __restrict__ value_cache_ptrs,  // [num_layers]
    const int64_t* __restrict__ block_mapping,     // [num_pairs, 2]
    int64_t words_per_block) {
  const int layer = blockIdx.x, pair = blockIdx.y;
  Word* key_cache = reinterpret_cast<Word*>(key_cache_ptrs[layer]);
  Word* value_cache = reinterpret_cast<Word*>(value_cache_ptrs[layer]);
  const int64_t src = block_mapping[2 * pair] * words_per_block;
  const int64_t dst = block_mapping[2 * pair + 1] * words_per_block;
  for (int64_t i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    key_cache[dst + i] = key_cache[src + i];
    value_cache[dst + i] = value_cache[src + i];
  }
}

template <typename Word>
cudaError_t launch_reshape(const void* key, const void* value, void* key_cache, void* value_cache,
                           const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                           int block_size, int64_t ks_tok, int64_t ks_head, int64_t vs_tok, int64_t vs_head,
                           cudaStream_t stream) {
  const int threads = num_kv_heads * head_size < 512 ? num_kv_heads * head_size : 512;
  reshape_and_cache_kernel<Word><<<num_tokens, threads, 0, stream>>>(
      static_cast<const Word*>(key), static_cast<const Word*>(value), static_cast<Word*>(key_cache),
      static_cast<Word*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, ks_tok, ks_head, vs_tok,
      vs_head);
  return cudaGetLastError();
}

}  // namespace

cudaError_t reshape_and_cache_launch(const void* key, const void* value, void* key_cache, void* value_cache,
                                     const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                                     int block_size, int elem_bytes, int64_t key_stride_token,
                                     int64_t key_stride_head, int64_t value_stride_token,
                                     int64_t value_stride_head, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (elem_bytes) {
    case 1:
      return launch_reshape<uint8_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
                                     head_size, block_size, key_stride_token, key_stride_head, value_stride_token,
                                     value_stride_head, stream);
    case 2:
      return launch_reshape<uint16_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
                                      head_size, block_size, key_stride_token, key_stride_head, value_stride_token,
                                      value_stride_head, stream);
    case 4:
      return launch_reshape<uint32_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads,
                                      head_size, block_size, key_stride_token, key_stride_head, value_stride_token,
                                      value_stride_head, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t copy_blocks_launch(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int num_pairs, int64_t bytes_per_block,
                               bool aligned16, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0) return cudaSuccess;
  const dim3 grid(num_layers, num_pairs);
  constexpr int kThreads = 256;
  if (aligned16 && bytes_per_block % 16 == 0) {
    copy_blocks_kernel<uint4><<<grid, kThreads, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping,
                                                             bytes_per_block / 16);
  } else if (bytes_per_block % 4 == 0) {
    copy_blocks_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping,
                                                                bytes_per_block / 4);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping,
                                                               bytes_per_block);
  }
  return cudaGetLastError();
}

cudaError_t swap_blocks_launch(const void* const* srcs, void* const* dsts, int num_tensors,
                               const int64_t* block_mapping, int num_pairs, int64_t bytes_per_block,
                               cudaStream_t stream) {
  const size_t count = static_cast<size_t>(num_tensors) * num_pairs;
  if (count == 0) return cudaSuccess;
  std::vector<const void*> src_ptrs(count);
  std::vector<void*> dst_ptrs(count);
  for (int t = 0; t < num_tensors; ++t) {
    for (int p = 0; p < num_pairs; ++p) {
      const size_t i = static_cast<size_t>(t) * num_pairs + p;
      src_ptrs[i] = static_cast<const char*>(srcs[t]) + block_mapping[2 * p] * bytes_per_block;
      dst_ptrs[i] = static_cast<char*>(dsts[t]) + block_mapping[2 * p + 1] * bytes_per_block;
    }
  }
#if CUDART_VERSION >= 12080
  if (stream != nullptr && stream != cudaStreamLegacy) {  // the batch API refuses the legacy default stream
    std::vector<size_t> sizes(count, static_cast<size_t>(bytes_per_block));
    // One attribute set for every copy: read the sources in stream order (after the work queued before).
    cudaMemcpyAttributes attrs = {};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attrs.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attrs_idx = 0;
#if CUDART_VERSION >= 13000
    return cudaMemcpyBatchAsync(dst_ptrs.data(), src_ptrs.data(), sizes.data(), count, &attrs, &attrs_idx, 1, stream);
#else
    size_t fail_idx = 0;
    return cudaMemcpyBatchAsync(dst_ptrs.data(), const_cast<void**>(src_ptrs.data()), sizes.data(), count, &attrs,
                                &attrs_idx, 1, &fail_idx, stream);
#endif
  }
#endif
  for (size_t i = 0; i < count; ++i) {
    // cudaMemcpyDefault: unified addressing tells device from (pinned) host.
    const cudaError_t err = cudaMemcpyAsync(dst_ptrs[i], src_ptrs[i], bytes_per_block, cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda_kernels
}  // namespace pagedserve
