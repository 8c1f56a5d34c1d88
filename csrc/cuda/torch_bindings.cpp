// Adapts torch tensors to the raw-pointer CUDA launchers (cuda/launchers.h).
// Compiled only in the CUDA build (PAGEDSERVE_CUDA); bindings.cpp dispatches here.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "../checks.h"
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
  checks::paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, sliding_window);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0,
              "paged_attention: the caches must be 16-byte aligned (the kernel reads 16-byte chunks)");
  const c10::cuda::CUDAGuard guard(query.device());
  const auto tables = block_tables.to(query.device()).contiguous();
  const auto lens = context_lens.to(query.device()).contiguous();
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
  checks::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const auto slots = slot_mapping.to(key_cache.device()).contiguous();
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
  const int num_layers = checks::copy_blocks(key_caches, value_caches, block_mapping);
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
    const auto k = reinterpret_cast<int64_t>(key_caches[l].data_ptr());
    const auto v = reinterpret_cast<int64_t>(value_caches[l].data_ptr());
    key_addr[l] = k;
    value_addr[l] = v;
    aligned16 = aligned16 && k % 16 == 0 && v % 16 == 0;
  }
  const int64_t bytes_per_block = key_caches[0][0].numel() * key_caches[0].element_size();
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  checks::block_ids(mapping.data_ptr<int64_t>(), num_pairs, key_caches[0].size(0));
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
  const int num_tensors = checks::swap_blocks(srcs, dsts, block_mapping);
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int num_pairs = mapping.size(0);
  if (num_pairs == 0 || num_tensors == 0) return;
  const at::Tensor &src0 = srcs[0], &dst0 = dsts[0];
  std::vector<const void*> src_ptrs(num_tensors);
  std::vector<void*> dst_ptrs(num_tensors);
  for (int t = 0; t < num_tensors; ++t) {
    const at::Tensor &src = srcs[t], &dst = dsts[t];
    TORCH_CHECK(src.is_cuda() || src.is_pinned(), "swap_blocks: a host source must be pinned");
    TORCH_CHECK(dst.is_cuda() || dst.is_pinned(), "swap_blocks: a host destination must be pinned");
    src_ptrs[t] = src.data_ptr();
    dst_ptrs[t] = dst.data_ptr();
  }
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  checks::swap_ids(pairs, num_pairs, src0.size(0), dst0.size(0));
  const auto device = src0.is_cuda() ? src0.device() : dst0.device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t bytes_per_block = src0.numel() / src0.size(0) * src0.element_size();
  check(ck::swap_blocks_launch(src_ptrs.data(), dst_ptrs.data(), num_tensors, pairs, num_pairs, bytes_per_block,
                               c10::cuda::getCurrentCUDAStream(device.index()).stream()),
        "swap_blocks");
}

// ---- elementwise ops of a Llama block (elementwise_kernels.cu)

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  checks::rms_norm(out, input, weight, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::rms_norm_launch(kernel_dtype(input.scalar_type()), out.data_ptr(), input.data_ptr(), weight.data_ptr(),
                            input.size(0), input.size(1), input.stride(0), out.stride(0), static_cast<float>(eps),
                            c10::cuda::getCurrentCUDAStream().stream()),
        "rms_norm");
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(input, residual, weight, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::fused_add_rms_norm_launch(kernel_dtype(input.scalar_type()), input.data_ptr(), residual.data_ptr(),
                                      weight.data_ptr(), input.size(0), input.size(1), input.stride(0),
                                      residual.stride(0), static_cast<float>(eps),
                                      c10::cuda::getCurrentCUDAStream().stream()),
        "fused_add_rms_norm");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  checks::silu_and_mul(out, input, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  check(ck::silu_and_mul_launch(kernel_dtype(input.scalar_type()), out.data_ptr(), input.data_ptr(), input.size(0),
                                out.size(1), input.stride(0), out.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
        "silu_and_mul");
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos_sin_cache) {
  checks::rotary_embedding(positions, x, cos_sin_cache, at::kCUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto pos = positions.to(x.device()).contiguous();
  check(ck::rotary_embedding_launch(kernel_dtype(x.scalar_type()), pos.data_ptr<int64_t>(), x.data_ptr(),
                                    cos_sin_cache.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
                                    cos_sin_cache.size(0), x.stride(0), x.stride(1),
                                    c10::cuda::getCurrentCUDAStream().stream()),
        "rotary_embedding");
}

int64_t paged_attention_workspace_bytes(int64_t num_seqs, int64_t num_heads, int64_t head_size,
                                        int64_t max_context_len, int64_t sliding_window) {
  const int window = static_cast<int>(std::min<int64_t>(sliding_window, max_context_len));
  return static_cast<int64_t>(ck::paged_attention_workspace_bytes(static_cast<int>(num_seqs),
                                                                  static_cast<int>(num_heads),
                                                                  static_cast<int>(head_size),
                                                                  static_cast<int>(max_context_len), window));
}

}  // namespace cuda
}  // namespace pagedserve
