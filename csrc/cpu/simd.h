// Fixed-width float vectors for the CPU kernels, written once for every ISA:
// GCC vector extensions become zmm code under -mavx512f, ymm under -mavx2 and
// xmm (or scalars, N = 1) otherwise. Intrinsics appear only where the generic
// form compiles badly (bf16/fp16 widening, the cross-lane reduction).
// engine/ops/__init__.py picks the -m flags from /proc/cpuinfo.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pagedserve {
namespace cpu {
namespace simd {

// float32 lanes of the widest register the build targets.
#if defined(__AVX512F__)
constexpr int kNative = 16;
#elif defined(__AVX2__)
constexpr int kNative = 8;
#else
constexpr int kNative = 4;
#endif

template <int N>
struct VecTypes {
  typedef float f32 __attribute__((vector_size(4 * N)));
  typedef int32_t i32 __attribute__((vector_size(4 * N)));
  typedef uint32_t u32 __attribute__((vector_size(4 * N)));
  typedef uint16_t u16 __attribute__((vector_size(2 * N)));
};
template <int N>
using Vec = typename VecTypes<N>::f32;

// s in every lane (x - 0.0f == x for every x, so this folds to one broadcast).
template <int N>
inline Vec<N> splat(float s) { return s - Vec<N>{}; }

template <int N, typename V>
inline Vec<N> bit_cast_f32(V bits) {
  Vec<N> v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Pins v in a register: GCC otherwise folds its load into every use, one reload per use.
template <int N>
inline void keep_in_register(Vec<N>& v) {
  if constexpr (N > 1) {  // (a one-lane vector has no register class)
#if defined(__AVX512F__)
    asm("" : "+v"(v));
#elif defined(__x86_64__)
    asm("" : "+x"(v));
#endif
  }
}

// ---- loads: N values of a storage type, widened to float32.

template <int N>
inline Vec<N> load(const float* p) {
  Vec<N> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int N>
inline Vec<N> load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
#if defined(__AVX512F__)
  if constexpr (N == 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
#endif
  typename VecTypes<N>::u16 h;
  std::memcpy(&h, p, sizeof(h));
  return bit_cast_f32<N>(__builtin_convertvector(h, typename VecTypes<N>::u32) << 16);
}

template <int N>
inline Vec<N> load(const c10::Half* p) {
#if defined(__AVX512F__)
  if constexpr (N == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(__F16C__)
  if constexpr (N == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  Vec<N> v;
  for (int i = 0; i < N; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

#if defined(__AVX2__)
// 16 bfloat16 as two float32 vectors with their lanes in the order k 0-3, 8-11 (lo) and 4-7, 12-15 (hi): unpacking
// with zero is one instruction a vector where an in-order widening takes two. For sums over k (a dot product) the
// order does not matter when both operands take it; elsewhere unpermute16 puts it back.
inline void widen16_permuted(const c10::BFloat16* p, Vec<8>& lo, Vec<8>& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
}

// widen16_permuted's lanes (or sums kept in them) back in order: k 0-7 and 8-15.
inline void unpermute16(Vec<8>& lo, Vec<8>& hi) {
  const __m256 a = lo, b = hi;
  lo = _mm256_permute2f128_ps(a, b, 0x20);
  hi = _mm256_permute2f128_ps(a, b, 0x31);
}
#endif

// ---- stores: float32 lanes rounded to nearest-even in the storage type (torch's rounding).

template <int N>
inline void store(float* p, Vec<N> v) { std::memcpy(p, &v, sizeof(v)); }

template <int N>
inline void store(c10::BFloat16* p, Vec<N> v) {
  // NaN is not expected here (it would come out as some NaN or inf).
  using U = typename VecTypes<N>::u32;
  U bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const auto h = __builtin_convertvector(bits, typename VecTypes<N>::u16);
  std::memcpy(p, &h, sizeof(h));
}

// v rounded to the nearest bfloat16 value (even on ties), kept as float32.
template <int N>
inline Vec<N> round_bf16(Vec<N> v) {
  using U = typename VecTypes<N>::u32;
  U bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bit_cast_f32<N>((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
}

template <int N>
inline void store(c10::Half* p, Vec<N> v) {
  for (int i = 0; i < N; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// ---- math

// a > b ? a : b and a < b ? a : b, lane by lane (GCC does not map the generic form to one instruction).
template <int N>
inline Vec<N> max(Vec<N> a, Vec<N> b) {
#if defined(__AVX512F__)
  if constexpr (N == 16) return _mm512_max_ps(a, b);
#endif
#if defined(__AVX2__)
  if constexpr (N == 8) return _mm256_max_ps(a, b);
#endif
  return a > b ? a : b;
}

template <int N>
inline Vec<N> min(Vec<N> a, Vec<N> b) {
#if defined(__AVX512F__)
  if constexpr (N == 16) return _mm512_min_ps(a, b);
#endif
#if defined(__AVX2__)
  if constexpr (N == 8) return _mm256_min_ps(a, b);
#endif
  return a < b ? a : b;
}

template <int N>
inline float reduce_max(Vec<N> v) {
  float m = v[0];
  for (int i = 1; i < N; ++i) m = m > v[i] ? m : v[i];
  return m;
}

template <int N>
inline float reduce_add(Vec<N> v) {
  float s = v[0];
  for (int i = 1; i < N; ++i) s += v[i];
  return s;
}

// exp(x) on every lane: Cephes' expf polynomial (max error ~2 ulp, as vec::exp);
// inputs are clamped to the finite range, so no inf and no denormals.
template <int N>
inline Vec<N> exp(Vec<N> x) {
  x = min<N>(max<N>(x, splat<N>(-87.0f)), splat<N>(88.0f));
  // Round to the nearest integer by adding and removing 1.5 * 2^23.
  const Vec<N> n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  Vec<N> r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  Vec<N> p = splat<N>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
#if defined(__AVX512F__)
  if constexpr (N == 16) return _mm512_scalef_ps(p, n);  // p * 2^n in one instruction, the same rounding
#endif
  using I = typename VecTypes<N>::i32;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return p * bit_cast_f32<N>(e);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1) on every lane (exp clamps, so no inf: +-1 at the ends). Absolute error ~1e-7.
template <int N>
inline Vec<N> tanh(Vec<N> x) {
  return 1.0f - 2.0f / (exp<N>(x * 2.0f) + 1.0f);
}

// Gemma 2's soft-cap of attention scores: tanh(s / cap) * cap (HF's order of operations, float32).
template <int N>
inline Vec<N> softcap(Vec<N> s, float cap) {
  return tanh<N>(s / cap) * cap;
}

// silu(g) * u = g / (1 + exp(-g)) * u, lane by lane (a gated MLP's activation). With kRoundSilu, silu's result is
// rounded to bfloat16 before the multiply, as torch's F.silu(gate) * up does on bfloat16 tensors. One definition for
// csrc/cpu/activation.cpp and the fused epilogue of csrc/cpu/small_gemm.cpp, so the two give the same bits.
template <int N, bool kRoundSilu>
inline Vec<N> silu_mul(Vec<N> g, Vec<N> u) {
  Vec<N> act = g / (1.0f + exp<N>(-g));
  if constexpr (kRoundSilu) act = round_bf16<N>(act);
  return act * u;
}

// out[i] = sum of the lanes of a[i]: N horizontal sums in one transpose-and-add
// tree (about 3 instructions per sum instead of 2 * log2(N) each).
template <int N>
inline Vec<N> transpose_add(const Vec<N> (&a)[N]) {
#if defined(__AVX512F__)
  if constexpr (N == 16) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)  // 256-bit halves: [a_i | a_i+8]
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xee));
    for (int i = 0; i < 4; ++i)  // 128-bit lanes: [a_i, a_i+8, a_i+4, a_i+12]
      d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xdd));
    for (int i = 0; i < 2; ++i) {
      const __m512d x = _mm512_castps_pd(d[i]), y = _mm512_castps_pd(d[i + 2]);
      e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
    // f holds the sums in the order 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15 (its own inverse).
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), f);
  }
#endif
#if defined(__AVX2__)
  if constexpr (N == 8) {
    __m256 c[4], e[2];
    for (int i = 0; i < 4; ++i)  // 128-bit halves: [a_i | a_i+4]
      c[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(c[i]), y = _mm256_castps_pd(c[i + 2]);
      e[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(e[0], e[1], 0x88), _mm256_shuffle_ps(e[0], e[1], 0xdd));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));  // was 0 2 1 3 4 6 5 7
  }
#endif
  Vec<N> out;
  for (int i = 0; i < N; ++i) out[i] = reduce_add<N>(a[i]);
  return out;
}

}  // namespace simd
}  // namespace cpu
}  // namespace pagedserve
