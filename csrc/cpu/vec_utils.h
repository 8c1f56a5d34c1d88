// Scalar helpers written so that gcc auto-vectorizes the loops that use them
// (no branches, no libm calls): bfloat16 <-> float32. The vectorized exp lives in simd.h.
// Shared by the elementwise kernels (layernorm.cpp, activation.cpp, pos_encoding.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace pagedserve {
namespace cpu {
namespace vec {

// Rows below this many elements run on the calling thread. Inside a step the other OpenMP thread is still
// spinning from the kernel before (GOMP_SPINCOUNT=4000, engine/platform/openmp.py), so a parallel region costs a few
// microseconds and halving a norm or an activation of 8 sequences and more pays: bfloat16 decode step at 32
// sequences 38.4 -> 37.2 ms, at 8 14.05 -> 13.81 ms (in-process A/B, Zen 4; one stream and float32 at 16 the
// same). The old 2^18 dated from OMP_WAIT_POLICY=PASSIVE, where each region woke a sleeping thread (50-100 us).
constexpr int64_t kParallelMinElements = 4096;

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint16_t raw;
  std::memcpy(&raw, p + i, sizeof(raw));
  return bits_to_float(static_cast<uint32_t>(raw) << 16);
}

// float32 -> bfloat16 bits, round to nearest even (torch's rounding; NaN inputs
// are not expected in activations and would come out as some NaN or inf).
inline uint16_t bf16_bits(float f) {
  const uint32_t bits = float_to_bits(f);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Rounds a float32 to the nearest bfloat16 value, kept as float32.
inline float round_bf16(float f) { return bits_to_float(static_cast<uint32_t>(bf16_bits(f)) << 16); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) {
  const uint16_t raw = bf16_bits(v);
  std::memcpy(p + i, &raw, sizeof(raw));
}

// max |x_i| of n values. The bits of |x| order as the values do (finite x), so this is an integer max reduction,
// which gcc vectorizes (a float one it may not reorder without -ffast-math: the scalar loop was 45 % of a
// quantization's time). A NaN comes out as a NaN.
template <typename T>
inline float abs_max(const T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = float_to_bits(load(x, i)) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return bits_to_float(m);
}

// The value a tensor of T holds after rounding (identity for float32).
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    return v;
  }
}

}  // namespace vec
}  // namespace cpu
}  // namespace pagedserve
