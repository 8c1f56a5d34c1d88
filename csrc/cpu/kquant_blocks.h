// What csrc/cpu/kquant_gemm.cpp (the int8 tiles, the driver) and csrc/cpu/kquant_panel.cpp (the dequantized
// panels) share: the packed layout's geometry and readers (kquant_gemm.cpp's header describes the layout), the SIMD
// wrappers, the ISA codes and the split over threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "cpu_features.h"
#include "vec_utils.h"

namespace pagedserve {
namespace cpu {
namespace kquant {

constexpr int64_t kCols = 16;
constexpr int64_t kMinBlocksPerThread = 4;  // column blocks: a second thread costs more below this

enum Isa : int64_t { kAuto = 0, kPlain = 1, kAvx2 = 2, kAvx512 = 3, kVnni = 5, kX16 = 6, kPanel = 7 };
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// A format's geometry: Bits of a code, S weights a block, Sub weights a sub-scale (0: none), whether M is stored
// (else M = MMul * D) and whether the offsets mn are their own (else mn = sc: Q6_K).
template <int Bits, int S, int Sub, bool StoresM, int MMul, bool OwnMins>
struct Fmt {
  static constexpr int kBits = Bits, kS = S, kSub = Sub, kMMul = MMul;
  static constexpr bool kStoresM = StoresM, kOwnMins = OwnMins;
  static constexpr int kJ32 = S / 32;
  static constexpr int kSubs = Sub ? S / Sub : 0;
  static constexpr int kHiBytes = Bits == 5 ? 64 : Bits == 6 ? 128 : 0;
  static constexpr int kOffHi = kJ32 * 256;
  static constexpr int kOffD = kOffHi + kJ32 * kHiBytes;
  static constexpr int kOffM = kOffD + 32;
  static constexpr int kOffSc = kOffM + (StoresM ? 32 : 0);
  static constexpr int kOffMn = kOffSc + kSubs * 16;
  static constexpr int kBytes = kOffMn + (OwnMins ? kSubs * 16 : 0);
};
using FQ4_0 = Fmt<4, 32, 0, false, 8, false>;
using FQ4_1 = Fmt<4, 32, 0, true, 0, false>;
using FQ5_0 = Fmt<5, 32, 0, false, 16, false>;
using FQ5_1 = Fmt<5, 32, 0, true, 0, false>;
using FQ4_K = Fmt<4, 256, 32, true, 0, true>;
using FQ5_K = Fmt<5, 256, 32, true, 0, true>;
using FQ6_K = Fmt<6, 256, 16, false, 32, false>;

inline int32_t pair16(const int16_t* p) {  // two int16 as one 32-bit lane (a vpmaddwd operand broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int32_t four(const int8_t* p) {  // four int8 of x as one 32-bit lane (a vpmaddubsw / vpdpbusd operand)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_at(const uint8_t* p, int i) {
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// ------------------------------------------------------------------ plain C++ (any CPU; the reference layout reader)

template <class F>
inline int code(const uint8_t* b, int j32, int g, int c, int i) {
  const uint8_t lo = b[j32 * 256 + (g & 3) * 64 + c * 4 + i];
  int q = g < 4 ? lo & 15 : lo >> 4;
  if constexpr (F::kBits == 5) q |= ((b[F::kOffHi + j32 * 64 + c * 4 + i] >> g) & 1) << 4;
  if constexpr (F::kBits == 6) q |= ((b[F::kOffHi + j32 * 128 + (g >> 2) * 64 + c * 4 + i] >> (2 * (g & 3))) & 3) << 4;
  return q;
}

inline int pair_at(const uint8_t* p, int j, int c) {  // [subs/2][16][2] int8, sub j of column c
  return static_cast<int8_t>(p[(j / 2) * 32 + c * 2 + (j & 1)]);
}

template <typename Fn>
void over_threads(int64_t blocks, Fn&& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), blocks / kMinBlocksPerThread));
  if (threads == 1) return fn(int64_t{0}, blocks);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    fn(blocks * t / nt, blocks * (t + 1) / nt);
  }
}

// x quantized per block of S in two int8 parts (the residual is kLowSteps finer): "expanded" rows 2r (xh) and
// 2r + 1 (xl) of row r, each with per block its scale (dx, dx / kLowSteps) and per 16 and 32 its sums (int16), so a
// tile treats xl as rows of its own and the weights are still read once.
constexpr int kParts = 2;
constexpr float kLowSteps = 254.0f;  // xl's steps per step of xh (|254 (t - xh)| <= 127)

struct XQuant {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s16, s32;
  int64_t k = 0, s = 0;
  std::vector<int16_t> q16;  // the wide tiles' x16 = 254 xh + xl per row (kquant_wide.cpp), when asked for
  std::vector<float> dx16, xs16, dx32, xs32;  // unit_scales: per row and unit of 16 / 32 k, x16's scale, scale * sum
  const int8_t* row(int64_t e) const { return q.data() + e * k; }
};

// x [M, K] (float32 or bfloat16) per block of s in the two parts (kquant_gemm.cpp); widen adds the wide tiles'
// int16 form (q16) for its m rows and, with sums, the x16 panels' per-unit scales and scaled sums.
XQuant quantize_x(const at::Tensor& x, int64_t s);
void widen(XQuant& xq, int64_t m, bool sums);
// Per row of x and unit of 32 k (and of 16 with sixteens: Q6_K's X32 offsets, the x16 panels) the joined parts' scale
// and scaled sum, dx32 / xs32 (dx16 / xs16): the per-32 epilogues' operands.
void unit_scales(XQuant& xq, int64_t m, bool sixteens = true);

// Out (where a tile writes): cpu_features.h.
inline void store_cols(const Out& o, int64_t row, int64_t col0, int64_t width, const float* v) {
  const int64_t cols = std::min<int64_t>(width, o.n - col0);
  for (int64_t c = 0; c < cols; ++c) {
    const float y = v[c] + (o.bias ? o.bias[col0 + c] : 0.0f);
    if (o.f32) {
      o.f32[row * o.stride + col0 + c] = y;
    } else {
      o.bf16[row * o.stride + col0 + c] = c10::BFloat16(y);
    }
  }
}

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

// 8 columns a ymm; a 16-column block is two halves.
struct V256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kL = 8;
  static constexpr bool kVnni = false;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I set16(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
  static I set32(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  template <int N>
  static I shift16(I v) {  // N > 0: left
    if constexpr (N > 0) return _mm256_slli_epi16(v, N);
    else if constexpr (N < 0) return _mm256_srli_epi16(v, -N);
    else return v;
  }
  template <int N>
  static I shl32(I v) { return _mm256_slli_epi32(v, N); }
  static I sra16of32(I v) { return _mm256_srai_epi32(v, 16); }
  static I srl16of32(I v) { return _mm256_srli_epi32(v, 16); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }
  static I maddubs(I w, I x) { return _mm256_maddubs_epi16(w, x); }
  static I dot(I acc, I w, I x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), set16(1)));
  }
  static I dot16(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }  // int16 pairs
  static I pairs(const uint8_t* p) {  // 8 columns' int8 pairs -> int16 pairs in 32-bit lanes
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F halfs(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  template <int N>
  static I srl32(I v) { return _mm256_srli_epi32(v, N); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#if defined(__AVX512F__)
template <bool Vnni>
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kL = 16;
  static constexpr bool kVnni = Vnni;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set8(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I set16(int v) { return _mm512_set1_epi16(static_cast<int16_t>(v)); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  template <int N>
  static I shift16(I v) {
    if constexpr (N > 0) return _mm512_slli_epi16(v, N);
    else if constexpr (N < 0) return _mm512_srli_epi16(v, -N);
    else return v;
  }
  template <int N>
  static I shl32(I v) { return _mm512_slli_epi32(v, N); }
  static I sra16of32(I v) { return _mm512_srai_epi32(v, 16); }
  static I srl16of32(I v) { return _mm512_srli_epi32(v, 16); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I madd(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I maddubs(I w, I x) { return _mm512_maddubs_epi16(w, x); }
  static I dot(I acc, I w, I x) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(acc, w, x);
    else return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), set16(1)));
  }
  static I dot16(I acc, I w, I x) {  // int16 pairs
    if constexpr (Vnni) return _mm512_dpwssd_epi32(acc, w, x);
    else return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
  }
  static I pairs(const uint8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F halfs(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  template <int N>
  static I srl32(I v) { return _mm512_srli_epi32(v, N); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, F v) {  // rounded to nearest even (finite values: no NaN care)
    const I bits = _mm512_castps_si512(v);
    const I odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), set32(1));
    const I r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, set32(0x7fff)), odd), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};
#endif

// Codes of groups g and g + 4 of one 32-k chunk: uint8 in 0 .. 2^Bits - 1, 4 k of a column a 32-bit lane.
template <class V, class F, int G>
inline void unpack(const uint8_t* b, int j32, int lane0, typename V::I& w0, typename V::I& w1) {
  using I = typename V::I;
  const I v = V::load(b + j32 * 256 + G * 64 + lane0 * 4);
  const I m0f = V::set8(0x0f);
  w0 = V::and_(v, m0f);
  w1 = V::and_(V::template shift16<-4>(v), m0f);
  if constexpr (F::kBits == 5) {  // bit G -> 4 for group G, bit G + 4 -> 4 for group G + 4
    const I h = V::load(b + F::kOffHi + j32 * 64 + lane0 * 4);
    const I m10 = V::set8(0x10);
    w0 = V::or_(w0, V::and_(V::template shift16<4 - G>(h), m10));
    w1 = V::or_(w1, V::and_(V::template shift16<-G>(h), m10));
  }
  if constexpr (F::kBits == 6) {  // bits 2G..2G+1 of line 0 (group G) and of line 1 (group G + 4) -> 4..5
    const I h0 = V::load(b + F::kOffHi + j32 * 128 + lane0 * 4);
    const I h1 = V::load(b + F::kOffHi + j32 * 128 + 64 + lane0 * 4);
    const I m30 = V::set8(0x30);
    w0 = V::or_(w0, V::and_(V::template shift16<4 - 2 * G>(h0), m30));
    w1 = V::or_(w1, V::and_(V::template shift16<4 - 2 * G>(h1), m30));
  }
}

// A K-quant block's offset sums for X rows of x scaled per 32 (the X32 tiles): off[x] = sum_j mn_j xs_j over the
// block's sub-blocks, mn per lane in float, xs from unit_scales (a sub-block's x scale times its sum of x16).
template <class V, class F, int X>
inline void x32_offsets(const uint8_t* b, int lane0, const XQuant& xq, int64_t x0, int64_t s, typename V::F* off) {
  const int64_t n = xq.k / (F::kSub == 32 ? 32 : 16);
  const float* xs = F::kSub == 32 ? xq.xs32.data() : xq.xs16.data();
  for (int x = 0; x < X; ++x) off[x] = V::fzero();
  for (int p2 = 0; p2 < F::kSubs / 2; ++p2) {
    const typename V::I mp = V::pairs(b + (F::kOwnMins ? F::kOffMn : F::kOffSc) + p2 * 32 + lane0 * 2);
    const typename V::F even = V::cvt(V::sra16of32(V::template shl32<16>(mp))), odd = V::cvt(V::sra16of32(mp));
    for (int x = 0; x < X; ++x) {
      const float* xr = xs + (x0 + x) * n + s * F::kSubs + 2 * p2;
      off[x] = V::fmadd(odd, V::fset(xr[1]), V::fmadd(even, V::fset(xr[0]), off[x]));
    }
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

// out[M, n] (a part's columns of the caller's out) = x @ W^T (+ bias) through dequantized panels (kquant_panel.cpp);
// w is the part's packed blocks of `type`, isa the best path (it dequantizes with that ISA's registers).
void panels(int64_t type, Isa isa, at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n,
            const at::Tensor& bias);  // bias: float32 [n] or undefined

// kquant_wide.cpp: column blocks b0 .. b1 - 1 of m rows through the wide tiles (x16 = xq.q16); false where this
// build has no wide tile for isa (plain C++).
bool wide_tiles(int64_t type, Isa isa, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1,
                const Out& o);

// kquant_x16.cpp: the same through x16 panels (a column block's codes widened once for all m rows); false where
// this build or isa has none (AVX2 only).
bool x16_panels(int64_t type, Isa isa, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1,
                const Out& o);

// kquant_x16.cpp: out = x @ W^T for q8_gemm.cpp's packed Q8_0 (w its weights, d its float16 scales, n columns) through
// x16 panels, split over the caller's OpenMP threads; false where this build has no AVX2 or K is not a multiple of 32.
// Rows from which AVX2 takes the x16 panels (kquant_x16.cpp's measurements); PAGEDSERVE_KQUANT_X16=R moves it to R
// (0: never), for measuring.
int64_t x16_rows();

bool q8_x16_panels(Isa isa, const at::Tensor& x, const uint8_t* w, const uint16_t* d, int64_t n, const Out& o);

}  // namespace kquant
}  // namespace cpu
}  // namespace pagedserve
