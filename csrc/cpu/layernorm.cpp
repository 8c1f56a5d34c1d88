// CPU RMSNorm and the fused residual add + RMSNorm of a Llama block.
//
// Numerics follow HF's LlamaRMSNorm: the mean of squares in float32, then
// float32 x * rsqrt(mean + eps); for bfloat16 that product is rounded to
// bfloat16 before the weight multiplies it (and the product rounded again).
// Rows are independent; a few rows (one decode sequence) run on the calling
// thread (vec::kParallelMinElements).
#include <cmath>
#include <type_traits>

#include <c10/util/Exception.h>

#include "../checks.h"
#include "../ops.h"
#include "vec_utils.h"

namespace pagedserve {
namespace cpu {

namespace {

// out[i] = weight * norm(x): x and out may alias (the fused op writes in place).
template <typename T>
inline void norm_row(T* out, const T* x, const T* weight, int64_t hidden, float eps) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = vec::load(x, i);
    sum_sq += v * v;
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    const float normed = vec::round_to<T>(vec::load(x, i) * inv_rms);
    vec::store(out, i, normed * vec::load(weight, i));
  }
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, float eps) {
  const int64_t num_tokens = input.size(0), hidden = input.size(1);
  const int64_t in_stride = input.stride(0), out_stride = out.stride(0);
  const T* x = input.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= vec::kParallelMinElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    norm_row(o + t * out_stride, x + t * in_stride, w, hidden, eps);
  }
}

template <typename T>
void fused_add_rms_norm_impl(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t num_tokens = input.size(0), hidden = input.size(1);
  const int64_t in_stride = input.stride(0), res_stride = residual.stride(0);
  T* x = input.data_ptr<T>();
  T* r = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
#pragma omp parallel for schedule(static) if (num_tokens * hidden >= vec::kParallelMinElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* xr = x + t * in_stride;
    T* rr = r + t * res_stride;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
      vec::store(rr, i, vec::load(rr, i) + vec::load(xr, i));  // rounded to T, as `residual + x` would be
    }
    norm_row(xr, rr, w, hidden, eps);
  }
}

// Each head vector of x [T, H, D] (any strides over T and H, D contiguous) normed in place.
template <typename T>
void rms_norm_heads_impl(at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t t_stride = x.stride(0), h_stride = x.stride(1);
  T* p = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= vec::kParallelMinElements)
  for (int64_t i = 0; i < tokens * heads; ++i) {
    T* row = p + (i / heads) * t_stride + (i % heads) * h_stride;
    norm_row(row, row, w, dim, eps);
  }
}

}  // namespace

void rms_norm_heads(at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm_heads: CPU tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && weight.dim() == 1 && weight.numel() == x.size(2) &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm_heads: x [num_tokens, num_heads, head_size] with contiguous heads, weight [head_size] of "
              "x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return rms_norm_heads_impl<float>(x, weight, static_cast<float>(eps));
    case at::kBFloat16: return rms_norm_heads_impl<c10::BFloat16>(x, weight, static_cast<float>(eps));
    default: TORCH_CHECK(false, "rms_norm_heads: unsupported dtype ", x.scalar_type());
  }
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, double eps) {
  checks::rms_norm(out, input, weight, at::kCPU);
  switch (input.scalar_type()) {
    case at::kFloat: return rms_norm_impl<float>(out, input, weight, static_cast<float>(eps));
    case at::kBFloat16: return rms_norm_impl<c10::BFloat16>(out, input, weight, static_cast<float>(eps));
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", input.scalar_type());
  }
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(input, residual, weight, at::kCPU);
  switch (input.scalar_type()) {
    case at::kFloat: return fused_add_rms_norm_impl<float>(input, residual, weight, static_cast<float>(eps));
    case at::kBFloat16:
      return fused_add_rms_norm_impl<c10::BFloat16>(input, residual, weight, static_cast<float>(eps));
    default: TORCH_CHECK(false, "fused_add_rms_norm: unsupported dtype ", input.scalar_type());
  }
}

}  // namespace cpu
}  // namespace pagedserve
