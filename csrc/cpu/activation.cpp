// CPU SiLU-and-multiply of a gated MLP: out = silu(gate) * up, where each
// input row is [gate | up]. For bfloat16 silu's result is rounded to bfloat16
// before the multiply, as torch's F.silu(gate) * up does.
#include <type_traits>

#include <c10/util/Exception.h>

#include "../checks.h"
#include "../ops.h"
#include "simd.h"
#include "vec_utils.h"

namespace pagedserve {
namespace cpu {

namespace {

template <int N, typename T>
inline simd::Vec<N> silu_times_up(const T* gate, const T* up) {
  return simd::silu_mul<N, std::is_same_v<T, c10::BFloat16>>(simd::load<N>(gate), simd::load<N>(up));
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& input) {
  constexpr int N = simd::kNative;
  const int64_t num_tokens = input.size(0), d = out.size(1);
  const int64_t in_stride = input.stride(0), out_stride = out.stride(0);
  const T* in = input.data_ptr<T>();
  T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (num_tokens * d >= vec::kParallelMinElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* gate = in + t * in_stride;
    const T* up = gate + d;
    T* row = o + t * out_stride;
    int64_t i = 0;
    for (; i + N <= d; i += N) simd::store<N>(row + i, silu_times_up<N>(gate + i, up + i));
    for (; i < d; ++i) vec::store(row, i, silu_times_up<1>(gate + i, up + i)[0]);
  }
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  checks::silu_and_mul(out, input, at::kCPU);
  switch (input.scalar_type()) {
    case at::kFloat: return silu_and_mul_impl<float>(out, input);
    case at::kBFloat16: return silu_and_mul_impl<c10::BFloat16>(out, input);
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", input.scalar_type());
  }
}

}  // namespace cpu
}  // namespace pagedserve
