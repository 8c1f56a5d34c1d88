// Argument checks shared by the CPU ops (cpu/*.cpp) and the CUDA bindings
// (cuda/torch_bindings.cpp): one contract per op, checked the same way on
// both devices. Checks that read tensor data (block ids, slots) take host
// pointers, so the CUDA side runs them only where the data is already on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace pagedserve {
namespace checks {

// key/value cache of one layer: [num_blocks, num_kv_heads, block_size, head_size], contiguous.
inline void cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key/value cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
}

// [num_pairs, 2] int64 (src, dst).
inline void block_mapping(const at::Tensor& mapping) {
  TORCH_CHECK(mapping.scalar_type() == at::kLong && mapping.dim() == 2 && mapping.size(1) == 2,
              "block_mapping must be int64 [num_pairs, 2]");
}

inline void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "out/query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: the whole context)");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key/value cache must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous(),
              "out and the caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query head vectors must be contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "out, query and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == head_size, "cache head_size ", key_cache.size(3), " != query head_size ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs, "context_lens must be [num_seqs]");
}

inline void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  cache_pair(key_cache, value_cache);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value shapes differ");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "key/value dtype must match the cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping must be int64 [num_tokens]");
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping has ", slot_mapping.size(0), " slots for ",
              key.size(0), " tokens");
  TORCH_CHECK(key_cache.size(1) == key.size(1) && key_cache.size(3) == key.size(2),
              "key/value do not match the cache's heads");
  // Key and value are often column slices of one qkv projection: rows may be
  // strided, but each head's vector must be contiguous.
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value head vectors must be contiguous");
}

// Checks shapes and returns the number of layers; the block ids are checked by block_ids.
inline int64_t copy_blocks(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                           const at::Tensor& mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many key caches as value caches");
  block_mapping(mapping);
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  for (int64_t l = 0; l < num_layers; ++l) {
    cache_pair(key_caches[l], value_caches[l]);
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes() && key_caches[l].device() == key_caches[0].device(),
                "every layer's cache must have the same shape and device");
  }
  return num_layers;
}

// Every id of the (src, dst) pairs (host memory) inside [0, num_blocks).
inline void block_ids(const int64_t* pairs, int64_t num_pairs, int64_t num_blocks) {
  for (int64_t p = 0; p < 2 * num_pairs; ++p) {
    TORCH_CHECK(pairs[p] >= 0 && pairs[p] < num_blocks, "block ", pairs[p], " is outside the cache");
  }
}

// Each source tensor copies to its destination: one dtype, one block shape, as many
// blocks in every source (and in every destination). Returns the number of tensors.
inline int64_t swap_blocks(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                           const at::Tensor& mapping) {
  TORCH_CHECK(srcs.size() == dsts.size(), "swap_blocks: ", srcs.size(), " sources but ", dsts.size(), " destinations");
  block_mapping(mapping);
  const int64_t num_tensors = static_cast<int64_t>(srcs.size());
  for (int64_t t = 0; t < num_tensors; ++t) {
    const at::Tensor &src = srcs[t], &dst = dsts[t], &src0 = srcs[0], &dst0 = dsts[0];
    TORCH_CHECK(src.scalar_type() == src0.scalar_type() && dst.scalar_type() == src0.scalar_type(),
                "swap_blocks: every tensor must have one dtype");
    TORCH_CHECK(src.dim() >= 1 && src.sizes() == src0.sizes() && dst.sizes() == dst0.sizes() &&
                    dst.sizes().slice(1) == src0.sizes().slice(1),
                "swap_blocks: every source (and every destination) must have one shape, with the same blocks");
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: tensors must be contiguous");
  }
  return num_tensors;
}

// The (src, dst) pairs (host memory) inside src's and dst's blocks.
inline void swap_ids(const int64_t* pairs, int64_t num_pairs, int64_t src_blocks, int64_t dst_blocks) {
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(pairs[2 * p] >= 0 && pairs[2 * p] < src_blocks, "source block ", pairs[2 * p], " is outside src");
    TORCH_CHECK(pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < dst_blocks, "destination block ", pairs[2 * p + 1],
                " is outside dst");
  }
}

// ---- elementwise ops; device is where the kernel runs (CPU or CUDA).

inline void rows(const at::Tensor& t, const at::Tensor& weight, const char* name, at::DeviceType device) {
  TORCH_CHECK(t.device().type() == device && t.dim() == 2 && t.stride(1) == 1, name, " must be a ",
              c10::DeviceTypeName(device), " [num_tokens, hidden] tensor with contiguous rows");
  TORCH_CHECK(t.size(1) == weight.numel() && t.scalar_type() == weight.scalar_type() && t.device() == weight.device(),
              name, ": hidden size, dtype or device differs from the weight");
}

inline void rms_norm(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, at::DeviceType device) {
  rows(input, weight, "rms_norm input", device);
  rows(out, weight, "rms_norm out", device);
  TORCH_CHECK(weight.is_contiguous() && out.size(0) == input.size(0), "rms_norm: bad weight or out shape");
}

inline void fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                               at::DeviceType device) {
  rows(input, weight, "fused_add_rms_norm input", device);
  rows(residual, weight, "fused_add_rms_norm residual", device);
  TORCH_CHECK(weight.is_contiguous() && residual.size(0) == input.size(0), "fused_add_rms_norm: bad shapes");
}

inline void silu_and_mul(const at::Tensor& out, const at::Tensor& input, at::DeviceType device) {
  TORCH_CHECK(input.device().type() == device && input.dim() == 2 && input.stride(1) == 1 && out.dim() == 2 &&
                  out.stride(1) == 1 && out.device() == input.device(),
              "silu_and_mul: ", c10::DeviceTypeName(device),
              " [num_tokens, 2 * d] input and [num_tokens, d] out with contiguous rows");
  TORCH_CHECK(input.size(1) == 2 * out.size(1) && input.size(0) == out.size(0) &&
                  input.scalar_type() == out.scalar_type(),
              "silu_and_mul: out must be [num_tokens, d] of the input's dtype");
}

inline void rotary_embedding(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin_cache,
                             at::DeviceType device) {
  TORCH_CHECK(x.device().type() == device && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding: x must be a ", c10::DeviceTypeName(device),
              " [num_tokens, num_heads, head_size] view, head vectors contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "rotary_embedding: positions must be [num_tokens] int64, contiguous");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == x.size(2) && cos_sin_cache.device() == x.device(),
              "rotary_embedding: cos_sin_cache must be [max_position, head_size] float32, contiguous, on x's device");
}

}  // namespace checks
}  // namespace pagedserve
