// CPU cache ops: byte copies of rows and blocks, so any dtype works.
#include <cstring>

#include "../checks.h"
#include "../ops.h"

namespace pagedserve {
namespace cpu {

void reshape_and_cache(
    const at::Tensor& key,           // [num_tokens, num_kv_heads, head_size]
    const at::Tensor& value,         // [num_tokens, num_kv_heads, head_size]
    at::Tensor& key_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    at::Tensor& value_cache,         // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& slot_mapping)  // [num_tokens] int64
{
  checks::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
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
  const int64_t num_layers = checks::copy_blocks(key_caches, value_caches, block_mapping);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  checks::block_ids(pairs, num_pairs, key_caches[0].size(0));
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
  const int64_t num_tensors = checks::swap_blocks(srcs, dsts, block_mapping);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || num_tensors == 0) return;
  const at::Tensor& first = srcs[0];
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  checks::swap_ids(pairs, num_pairs, first.size(0), dsts[0].size(0));
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
