// CPU cache ops: byte copies of rows and blocks, so any dtype works.
#include <cstring>

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key/value cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
}

}  // namespace

void reshape_and_cache(
    const at::Tensor& key,           // [num_tokens, num_kv_heads, head_size]
    const at::Tensor& value,         // [num_tokens, num_kv_heads, head_size]
    at::Tensor& key_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    at::Tensor& value_cache,         // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& slot_mapping)  // [num_tokens] int64
{
  check_cache_pair(key_cache, value_cache);
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value shapes differ");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "key/value dtype must match the cache dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "slot_mapping must be int64 [num_tokens]");
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  TORCH_CHECK(slot_mapping.size(0) == num_tokens, "slot_mapping has ", slot_mapping.size(0), " slots for ", num_tokens, " tokens");
  TORCH_CHECK(key_cache.size(1) == num_kv_heads && key_cache.size(3) == head_size, "key/value do not match the cache's heads");
  // Key and value are often column slices of one qkv projection: rows may be
  // strided, but each head's vector must be contiguous.
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value head vectors must be contiguous");

  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(2);
  const int64_t elem = key.element_size();
  const int64_t row_bytes = head_size * elem;
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(slot_ptr[i] < num_blocks * block_size, "slot ", slot_ptr[i], " is outside the cache");
  }
  const auto* key_ptr = static_cast<const char*>(key.data_ptr());
  const auto* value_ptr = static_cast<const char*>(value.data_ptr());
  auto* kc_ptr = static_cast<char*>(key_cache.data_ptr());
  auto* vc_ptr = static_cast<char*>(value_cache.data_ptr());

#pragma omp parallel for schedule(static) if (num_tokens > 64)
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slot_ptr[i];
    if (slot < 0) continue;  // padding token: nothing to cache
    const int64_t block = slot / block_size;
    const int64_t offset = slot % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row_bytes;
      std::memcpy(kc_ptr + dst, key_ptr + (i * key.stride(0) + h * key.stride(1)) * elem, row_bytes);
      std::memcpy(vc_ptr + dst, value_ptr + (i * value.stride(0) + h * value.stride(1)) * elem, row_bytes);
    }
  }
}

void copy_blocks(
    std::vector<at::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    std::vector<at::Tensor>& value_caches,  // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_mapping)        // [num_pairs, 2] int64 (src, dst)
{
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many key caches as value caches");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must be int64 [num_pairs, 2]");
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;
  for (int64_t l = 0; l < num_layers; ++l) {
    check_cache_pair(key_caches[l], value_caches[l]);
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes(), "every layer's cache must have the same shape");
  }
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t num_blocks = key_caches[0].size(0);
  for (int64_t p = 0; p < 2 * num_pairs; ++p) {
    TORCH_CHECK(pairs[p] >= 0 && pairs[p] < num_blocks, "block ", pairs[p], " is outside the cache");
  }
  const int64_t block_bytes = key_caches[0][0].numel() * key_caches[0].element_size();
  std::vector<char*> bases;
  for (int64_t l = 0; l < num_layers; ++l) {
    bases.push_back(static_cast<char*>(key_caches[l].data_ptr()));
    bases.push_back(static_cast<char*>(value_caches[l].data_ptr()));
  }
  const int64_t num_tensors = static_cast<int64_t>(bases.size());

#pragma omp parallel for schedule(static) if (num_tensors * num_pairs > 16)
  for (int64_t t = 0; t < num_tensors; ++t) {
    // Pairs stay in order inside one tensor: a block may be a destination and
    // later a source (copy-on-write chains), and that order is the caller's.
    for (int64_t p = 0; p < num_pairs; ++p) {
      std::memcpy(bases[t] + pairs[2 * p + 1] * block_bytes, bases[t] + pairs[2 * p] * block_bytes, block_bytes);
    }
  }
}

void swap_blocks(
    const std::vector<at::Tensor>& srcs,  // num_tensors x [num_src_blocks, ...]
    std::vector<at::Tensor>& dsts,        // num_tensors x [num_dst_blocks, ...] same block shape and dtype
    const at::Tensor& block_mapping)      // [num_pairs, 2] int64 (src, dst)
{
  TORCH_CHECK(srcs.size() == dsts.size(), "swap_blocks: ", srcs.size(), " sources but ", dsts.size(), " destinations");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must be int64 [num_pairs, 2]");
  const int64_t num_pairs = block_mapping.size(0), num_tensors = static_cast<int64_t>(srcs.size());
  if (num_pairs == 0 || num_tensors == 0) return;
  const at::Tensor& first = srcs[0];
  for (int64_t t = 0; t < num_tensors; ++t) {
    const at::Tensor &src = srcs[t], &dst = dsts[t];
    TORCH_CHECK(src.scalar_type() == first.scalar_type() && dst.scalar_type() == first.scalar_type(),
                "swap_blocks: every tensor must have one dtype");
    TORCH_CHECK(src.dim() >= 1 && src.sizes() == first.sizes() && dst.sizes().slice(1) == first.sizes().slice(1) &&
                    dst.size(0) == dsts[0].size(0),
                "swap_blocks: every source (and every destination) must have one shape, with the same blocks");
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: tensors must be contiguous");
  }
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(pairs[2 * p] >= 0 && pairs[2 * p] < first.size(0), "source block ", pairs[2 * p], " is outside src");
    TORCH_CHECK(pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < dsts[0].size(0), "destination block ", pairs[2 * p + 1],
                " is outside dst");
  }
  const int64_t block_bytes = first.numel() / first.size(0) * first.element_size();

#pragma omp parallel for collapse(2) schedule(static) if (num_tensors * num_pairs > 16)
  for (int64_t t = 0; t < num_tensors; ++t) {
    for (int64_t p = 0; p < num_pairs; ++p) {
      std::memcpy(static_cast<char*>(dsts[t].data_ptr()) + pairs[2 * p + 1] * block_bytes,
                  static_cast<const char*>(srcs[t].data_ptr()) + pairs[2 * p] * block_bytes, block_bytes);
    }
  }
}

}  // namespace cpu
}  // namespace pagedserve
