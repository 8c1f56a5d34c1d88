// CPU rotary embedding (neox style: the head's two halves rotate together),
// in place on a strided [num_tokens, num_heads, head_size] view, e.g. the q and
// k heads inside a fused qkv projection's output.
//
// Same arithmetic as HF's x * cos + rotate_half(x) * sin in the tensor's dtype:
// for bfloat16, cos/sin are rounded to bfloat16 and so is each product and sum.
#include <type_traits>

#include <c10/util/Exception.h>

#include "../checks.h"
#include "../ops.h"
#include "vec_utils.h"

namespace pagedserve {
namespace cpu {

namespace {

template <typename T>
void rotary_impl(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos_sin_cache) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const int64_t cache_stride = cos_sin_cache.stride(0), max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin_cache.data_ptr<float>();
  T* base = x.data_ptr<T>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // checked here: an exception must not leave an OpenMP region
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t], " outside the cos/sin table");
  }
#pragma omp parallel for schedule(static) if (num_tokens * num_heads * half * 2 >= vec::kParallelMinElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* cos = table + pos[t] * cache_stride;  // [half] cos | [half] sin
    const float* sin = cos + half;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* x1 = base + t * token_stride + h * head_stride;
      T* x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float c = vec::round_to<T>(cos[i]), s = vec::round_to<T>(sin[i]);
        const float a = vec::load(x1, i), b = vec::load(x2, i);
        vec::store(x1, i, vec::round_to<T>(a * c) - vec::round_to<T>(b * s));
        vec::store(x2, i, vec::round_to<T>(b * c) + vec::round_to<T>(a * s));
      }
    }
  }
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& x, const at::Tensor& cos_sin_cache) {
  checks::rotary_embedding(positions, x, cos_sin_cache, at::kCPU);
  switch (x.scalar_type()) {
    case at::kFloat: return rotary_impl<float>(positions, x, cos_sin_cache);
    case at::kBFloat16: return rotary_impl<c10::BFloat16>(positions, x, cos_sin_cache);
    default: TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace cpu
}  // namespace pagedserve
