// CPU activations of a gated MLP: out = act(gate) * up, where each input row is [gate | up]: SiLU (Llama) and
// GELU with the tanh approximation (Gemma's gelu_pytorch_tanh). For bfloat16 the activation's result is rounded
// to bfloat16 before the multiply, as torch's F.silu(gate) * up (F.gelu(gate, approximate="tanh") * up) does.
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

// gelu_tanh(g) * u with gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), torch's formula;
// tanh(y) = 1 - 2 / (exp(2y) + 1) over simd::exp (~1e-7 from torch's float32 result, no inf: exp is clamped).
template <int N, bool kRound>
inline simd::Vec<N> gelu_tanh_mul(simd::Vec<N> g, simd::Vec<N> u) {
  const simd::Vec<N> inner = (g + g * g * g * 0.044715f) * 0.7978845608028654f;
  const simd::Vec<N> tanh = 1.0f - 2.0f / (simd::exp<N>(inner * 2.0f) + 1.0f);
  simd::Vec<N> act = g * 0.5f * (1.0f + tanh);
  if constexpr (kRound) act = simd::round_bf16<N>(act);
  return act * u;
}

template <typename T>
void gelu_tanh_and_mul_impl(at::Tensor& out, const at::Tensor& input) {
  constexpr int N = simd::kNative;
  constexpr bool kRound = std::is_same_v<T, c10::BFloat16>;
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
    for (; i + N <= d; i += N) {
      simd::store<N>(row + i, gelu_tanh_mul<N, kRound>(simd::load<N>(gate + i), simd::load<N>(up + i)));
    }
    for (; i < d; ++i) vec::store(row, i, gelu_tanh_mul<1, kRound>(simd::load<1>(gate + i), simd::load<1>(up + i))[0]);
  }
}

}  // namespace

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  checks::silu_and_mul(out, input, at::kCPU);
  switch (input.scalar_type()) {
    case at::kFloat: return gelu_tanh_and_mul_impl<float>(out, input);
    case at::kBFloat16: return gelu_tanh_and_mul_impl<c10::BFloat16>(out, input);
    default: TORCH_CHECK(false, "gelu_tanh_and_mul: unsupported dtype ", input.scalar_type());
  }
}

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
