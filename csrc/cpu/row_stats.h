// A row's argmax (torch.argmax's first-index tie rule) and its sum of exp(x - max): what greedy decoding and the
// sampled token's logprob need. csrc/cpu/sampling.cpp runs them over a step's logits, csrc/cpu/small_gemm.cpp over
// the head's panels of logits while they are in cache (small_gemm_argmax_lse).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace pagedserve {
namespace cpu {

// The first index of the row's largest value (torch.argmax's tie rule), and that value. NaNs are passed over.
template <int N, typename T>
inline int64_t row_argmax(const T* x, int64_t n, float* best_value) {
  using I = typename simd::VecTypes<N>::i32;
  simd::Vec<N> best = simd::splat<N>(-std::numeric_limits<float>::infinity());
  I best_idx = {}, idx = {};
  for (int i = 0; i < N; ++i) idx[i] = i;
  int64_t i = 0;
  if (n >= N) {
    best = simd::load<N>(x);
    best_idx = idx;
    for (i = N; i + N <= n; i += N) {
      idx += N;
      const simd::Vec<N> v = simd::load<N>(x + i);
      const auto greater = v > best;  // strict: each lane keeps its first maximum
      best = greater ? v : best;
      best_idx = greater ? idx : best_idx;
    }
  }
  // Lanes -> the largest value, and among the lanes holding it the smallest index.
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  if (n >= N) {
    m = best[0], arg = best_idx[0];
    for (int l = 1; l < N; ++l) {
      if (best[l] > m || (best[l] == m && best_idx[l] < arg)) m = best[l], arg = best_idx[l];
    }
  }
  for (; i < n; ++i) {  // the tail, past every vector lane's indices
    const float v = static_cast<float>(x[i]);
    if (v > m || (i == 0 && n < N)) m = v, arg = i;
  }
  *best_value = m;
  return arg;
}

// sum(exp(x - m)) over the row, for its maximum m (0 when m is -inf: every value masked).
template <int N, typename T>
inline float row_sumexp(const T* x, int64_t n, float m) {
  if (m == -std::numeric_limits<float>::infinity()) return 0.0f;
  const simd::Vec<N> mv = simd::splat<N>(m);
  simd::Vec<N> s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 += simd::exp<N>(simd::load<N>(x + i) - mv);
    s1 += simd::exp<N>(simd::load<N>(x + i + N) - mv);
  }
  for (; i + N <= n; i += N) s0 += simd::exp<N>(simd::load<N>(x + i) - mv);
  float sum = simd::reduce_add<N>(s0 + s1);
  for (; i < n; ++i) sum += std::exp(static_cast<float>(x[i]) - m);
  return sum;
}

}  // namespace cpu
}  // namespace pagedserve
