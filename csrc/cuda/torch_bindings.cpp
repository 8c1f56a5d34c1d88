// Adapts torch tensors to the raw-pointer CUDA launchers (cuda/launchers.h).
// Compiled only in the CUDA build (PAGEDSERVE_CUDA); bindings.cpp dispatches here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "../ops.h"
#include "launchers.h"

namespace pagedserve {
namespace cuda {

namespace {

namespace ck = pagedserve::cuda_kernels;

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", cudaGetErrorString(err));
}

ck::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ck::DType::kFloat32;
    case at::kHalf:
      return ck::DType::kFloat16;
    case at::kBFloat16:
      return ck::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "unsupported dtype ", t, " (float32, float16 or bfloat16)");
  }
}

}  // namespace

void paged_attention(
    at::Tensor& out,                 // [num_seqs, num_heads, head_size]
    const at::Tensor& query,         // [num_seqs, num_heads, head_size]
    const at::Tensor& key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale,
    int64_t sliding_window) {        // 0: the whole context
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "out/query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: the whole context)");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key/value cache must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "out and the caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query head vectors must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "out, query and caches must share one dtype");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "cache head_size differs from query head_size");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0,
              "paged_attention: the caches must be 16-byte aligned (the kernel reads 16-byte chunks)");
  const c10::cuda::CUDAGuard guard(query.device());
  const auto tables = block_tables.to(query.device(), at::kInt).contiguous();
  const auto lens = context_lens.to(query.device(), at::kInt).contiguous();
  const int num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int block_size = key_cache.size(2), max_blocks = tables.size(1);
  // The block table's width bounds every context: no device-to-host read.
  const int max_context_len = max_blocks * block_size;
  const int window = static_cast<int>(std::min<int64_t>(sliding_window, max_context_len));
  const size_t ws_bytes = ck::paged_attention_workspace_bytes(num_seqs, num_heads, head_size, max_context_len, window);
  at::Tensor workspace;
  if (ws_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(ws_bytes / sizeof(float))}, query.options().dtype(at::kFloat));
  }
  check(ck::paged_attention_launch(kernel_dtype(query.scalar_type()), out.data_ptr(), query.data_ptr(),
                                   key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr<int32_t>(),
                                   lens.data_ptr<int32_t>(), ws_bytes > 0 ? workspace.data_ptr<float>() : nullptr,
                                   num_seqs, num_heads, key_cache.size(1), head_size, block_size, max_blocks,
                                   max_context_len, query.stride(0), query.stride(1), static_cast<float>(scale),
                                   window, c10::cuda::getCurrentCUDAStream().stream()),
        "paged_attention (head sizes 64, 80, 96, 128, 256)");
}

void reshape_and_cache(
    const at::Tensor& key,           // [num_tokens, num_kv_heads, head_size]
    const at::Tensor& value,         // [num_tokens, num_kv_heads, head_size]
    at::Tensor& key_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    at::Tensor& value_cache,         // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& slot_mapping)  // [num_tokens] int64
{
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key/value dtype must match the cache dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value head vectors must be contiguous");
  TORCH_CHECK(key_cache.size(1) == key.size(1) && key_cache.size(3) == key.size(2), "key/value do not match the cache");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const auto slots = slot_mapping.to(key_cache.device(), at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "slot_mapping must have one slot per token");
  check(ck::reshape_and_cache_launch(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                     slots.data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2),
                                     key_cache.size(2), key.element_size(), key.stride(0), key.stride(1),
                                     value.stride(0), value.stride(1), c10::cuda::getCurrentCUDAStream().stream()),
        "reshape_and_cache");
}

void copy_blocks(
    std::vector<at::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    std::vector<at::Tensor>& value_caches,  // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_mapping)        // [num_pairs, 2] int64 (src, dst)
{
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many key caches as value caches");
  const int num_layers = key_caches.size();
  const int num_pairs = block_mapping.size(0);
  if (num_layers == 0 || num_pairs == 0) return;
  const auto device = key_caches[0].device();
  const c10::cuda::CUDAGuard guard(device);
  auto key_ptrs = at::empty({num_layers}, at::kLong);
  auto value_ptrs = at::empty({num_layers}, at::kLong);
  int64_t* key_addr = key_ptrs.data_ptr<int64_t>();
  int64_t* value_addr = value_ptrs.data_ptr<int64_t>();
  bool aligned16 = true;
  for (int l = 0; l < num_layers; ++l) {
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes() && value_caches[l].sizes() == key_caches[0].sizes(),
                "every layer's cache must have the same shape");
    TORCH_CHECK(key_caches[l].is_contiguous() && value_caches[l].is_contiguous(), "caches must be contiguous");
    const auto k = reinterpret_cast<int64_t>(key_caches[l].data_ptr());
    const auto v = reinterpret_cast<int64_t>(value_caches[l].data_ptr());
    key_addr[l] = k;
    value_addr[l] = v;
    aligned16 = aligned16 && k % 16 == 0 && v % 16 == 0;
  }
  const int64_t bytes_per_block = key_caches[0][0].numel() * key_caches[0].element_size();
  const auto mapping = block_mapping.to(at::kLong).contiguous();
  const auto num_blocks = key_caches[0].size(0);
  TORCH_CHECK(mapping.min().item<int64_t>() >= 0 && mapping.max().item<int64_t>() < num_blocks,
              "copy_blocks: block id outside the cache");
  const auto key_ptrs_dev = key_ptrs.to(device);
  const auto value_ptrs_dev = value_ptrs.to(device);
  const auto mapping_dev = mapping.to(device);
  check(ck::copy_blocks_launch(key_ptrs_dev.data_ptr<int64_t>(), value_ptrs_dev.data_ptr<int64_t>(),
                               mapping_dev.data_ptr<int64_t>(), num_layers, num_pairs, bytes_per_block, aligned16,
                               c10::cuda::getCurrentCUDAStream().stream()),
        "copy_blocks");
}

void swap_blocks(
    const std::vector<at::Tensor>& srcs,  // num_tensors x [num_src_blocks, ...]
    std::vector<at::Tensor>& dsts,        // num_tensors x [num_dst_blocks, ...]
    const at::Tensor& block_mapping)      // [num_pairs, 2] int64 (src, dst), on the CPU
{
  TORCH_CHECK(srcs.size() == dsts.size(), "swap_blocks: ", srcs.size(), " sources but ", dsts.size(), " destinations");
  const auto mapping = block_mapping.to(at::kCPU, at::kLong).contiguous();
  const int num_pairs = mapping.size(0), num_tensors = srcs.size();
  if (num_pairs == 0 || num_tensors == 0) return;
  const at::Tensor &src0 = srcs[0], &dst0 = dsts[0];
  std::vector<const void*> src_ptrs(num_tensors);
  std::vector<void*> dst_ptrs(num_tensors);
  for (int t = 0; t < num_tensors; ++t) {
    const at::Tensor &src = srcs[t], &dst = dsts[t];
    TORCH_CHECK(src.scalar_type() == src0.scalar_type() && dst.scalar_type() == src0.scalar_type(),
                "swap_blocks: every tensor must have one dtype");
    TORCH_CHECK(src.dim() >= 1 && src.sizes() == src0.sizes() && dst.sizes() == dst0.sizes() &&
                    dst.sizes().slice(1) == src0.sizes().slice(1),
                "swap_blocks: every source (and every destination) must have one shape, with the same blocks");
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: tensors must be contiguous");
    TORCH_CHECK(src.is_cuda() || src.is_pinned(), "swap_blocks: a host source must be pinned");
    TORCH_CHECK(dst.is_cuda() || dst.is_pinned(), "swap_blocks: a host destination must be pinned");
    src_ptrs[t] = src.data_ptr();
    dst_ptrs[t] = dst.data_ptr();
  }
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  for (int p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(pairs[2 * p] >= 0 && pairs[2 * p] < src0.size(0), "source block ", pairs[2 * p], " is outside src");
    TORCH_CHECK(pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < dst0.size(0), "destination block ", pairs[2 * p + 1],
                " is outside dst");
  }
  const auto device = src0.is_cuda() ? src0.device() : dst0.device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t bytes_per_block = src0.numel() / src0.size(0) * src0.element_size();
  check(ck::swap_blocks_launch(src_ptrs.data(), dst_ptrs.data(), num_tensors, pairs, num_pairs, bytes_per_block,
                               c10::cuda::getCurrentCUDAStream(device.index()).stream()),
        "swap_blocks");
}

// ---- elementwise ops of a Llama block (elementwise_kernels.cu)

namespace {

void check_rows(const at::Tensor& t, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CUDA [num_tokens, hidden] tensor with contiguous rows");
  TORCH_CHECK(t.size(1) == weight.numel() && t.scalar_type() == weight.scalar_type() && t.device() == weight.device(),
              name, ": hidden size, dtype or device differs from the weight");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rows(input, weight, "rms_norm input");
  check_rows(out, weight, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && out.size(0) == input.size(0), "rms_norm: bad weight or out shape");
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::rms_norm_launch(kernel_dtype(input.scalar_type()), out.data_ptr(), input.data_ptr(), weight.data_ptr(),
                            input.size(0), input.size(1), input.stride(0), out.stride(0), static_cast<float>(eps),
                            c10::cuda::getCurrentCUDAStream().stream()),
        "rms_norm");
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(input, weight, "fused_add_rms_norm input");
  check_rows(residual, weight, "fused_add_rms_norm residual");
  TORCH_CHECK(weight.is_contiguous() && residual.size(0) == input.size(0), "fused_add_rms_norm: bad shapes");
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::fused_add_rms_norm_launch(kernel_dtype(input.scalar_type()), input.data_ptr(), residual.data_ptr(),
                                      weight.data_ptr(), input.size(0), input.size(1), input.stride(0),
                                      residual.stride(0), static_cast<float>(eps),
                                      c10::cuda::getCurrentCUDAStream().stream()),
        "fused_add_rms_norm");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  TORCH_CHECK(input.is_cuda() && input.dim() == 2 && input.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 &&
                  out.device() == input.device(),
              "silu_and_mul: CUDA [num_tokens, 2 * d] input and [num_tokens, d] out with contiguous rows");
  TORCH_CHECK(input.size(1) == 2 * out.size(1) && input.size(0) == out.size(0) &&
                  input.scalar_type() == out.scalar_type(),
              "silu_and_mul: out must be [num_tokens, d] of the input's dtype");
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::silu_and_mul_launch(kernel_dtype(input.scalar_type()), out.data_ptr(), input.data_ptr(), input.size(0),
                                out.size(1), input.stride(0), out.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
        "silu_and_mul");
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding: x must be a CUDA [num_tokens, num_heads, head_size] view, head vectors contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0),
              "rotary_embedding: positions must be [num_tokens] int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.stride(1) == 1 && cos_sin_cache.stride(0) == cos_sin_cache.size(1) &&
                  cos_sin_cache.size(1) == x.size(2) && cos_sin_cache.device() == x.device(),
              "rotary_embedding: cos_sin_cache must be [max_position, head_size] float32 on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto pos = positions.to(x.device()).contiguous();
  check(ck::rotary_embedding_launch(kernel_dtype(x.scalar_type()), pos.data_ptr<int64_t>(), x.data_ptr(),
                                    cos_sin_cache.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
                                    cos_sin_cache.size(0), x.stride(0), x.stride(1),
                                    c10::cuda::getCurrentCUDAStream().stream()),
        "rotary_embedding");
}

}  // namespace cuda
}  // namespace pagedserve
