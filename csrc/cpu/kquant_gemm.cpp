// CPU linears over llama.cpp's GGML block formats (issue 53): out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W's rows in
// parts, each part in its own format (a Q4_K_M file's qkv: q and k Q4_K, v Q6_K).
//
// Every format is, per block of S weights along K (32, or a K-quant's 256), w = D * sc_j * q - M * mn_j with D, M
// float16 per block and column, small integer scales sc_j / offsets mn_j per sub-block j (K-quants only) and codes
// q of 4, 5 or 6 bits (engine/model_executor/layers/formats.py says which field is which). x is quantized per block
// of S to int8 (xq = round(x / dx), dx = amax / 127: llama.cpp's Q8_0 / Q8_K) with the sums of xq per 16 and 32,
// so a block's contribution is dx * (D * S1 - M * S2) with S1 = sum_j sc_j sum_k q xq and S2 = sum_j mn_j bsum_j,
// both exact in int32. The integer dot products are u8 (q) x s8 (xq): vpdpbusd (AVX-512 VNNI), or vpmaddubsw then
// vpmaddwd with the sub-scale as the second operand (AVX2, AVX-512 without VNNI: the scale costs nothing there).
//
// Packed layout (formats.py pack_kquant), per column block of 16 (N padded with zero columns), per block along K,
// contiguous (a column block's weights are one stream):
//   qs  [S/32][4 lines][16 columns][4 k]  uint8: low nibbles of group g (k 4g..4g+3 of the 32) | group g+4's << 4
//   hi  5-bit: [S/32][16][4], bit g = group g's fifth bit; 6-bit: [S/32][2 lines][16][4], bits 2i..2i+1 of line h
//       = group 4h+i's top two bits
//   D   [16] float16;  M [16] float16 (Q4_1, Q5_1, Q4_K, Q5_K; else M = 8 D, 16 D, 32 D)
//   sc  [subs/2][16][2] int8 (K-quants), mn likewise (Q4_K, Q5_K; Q6_K's offset is 32 * sc: mn = sc)
// so one 64-byte line of qs holds 4 k of 16 columns in 32-bit lanes, the operand layout of vpdpbusd / vpmaddubsw.
//
// The blob (formats.py pack_parts, int8): int64 header {magic, parts, N, K, ...}, per part {ggml type, rows, offset,
// bytes}, then the parts; a Q8_0 part is csrc/cpu/q8_gemm.cpp's own layout and goes there.
//
// Threads: each part's column blocks split over the caller's OpenMP threads. Every row count runs the int8 tiles
// (8 rows a tile on AVX-512, 4 on AVX2; a tile streams its column block's weights once, prefetching 4 KiB ahead,
// and taller batches re-read them from cache). Measured on the 2-vCPU Xeon (Cascade Lake, VNNI), one thread, a
// [2048, 8192] Q4_K weight: 1 row 0.81 ms (12.0 GB/s of packed weights; Q8_0's q8_gemm 1.59 ms, 11.2 GB/s), 8 rows
// 1.56 ms; the explicit prefetch took 1 row from 1.48 ms, 8-row tiles took 8 rows from 1.94 ms.
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

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kMagic = 0x4B51504B;
constexpr int64_t kRows = 4;                 // rows of x per tile (AVX2: 16 ymm)
constexpr int64_t kRowsWide = 8;             // rows of x per tile (AVX-512: 32 zmm)
constexpr int64_t kMinBlocksPerThread = 4;   // column blocks: a second thread costs more below this

constexpr int64_t kPanelBytes = 4 << 20;    // one dequantized float32 panel of W^T (as q8_gemm's)

enum Isa : int64_t { kAuto = 0, kPlain = 1, kAvx2 = 2, kAvx512 = 3, kVnni = 5, kPanel = 7 };
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

bool cpu_has_vnni() {
#if defined(__AVX512F__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// oneDNN multiplies bfloat16 natively (AVX-512 BF16, AMX): there a bfloat16 x meets a bfloat16 panel.
bool cpu_has_bf16_dot() {
#if defined(__AVX512F__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

Isa best_isa() {
#if defined(__AVX512F__)
  return cpu_has_vnni() ? kVnni : kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kPlain;
#endif
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
  const int8_t* row(int64_t e) const { return q.data() + e * k; }
};

inline void block_sums(const int8_t* q, int64_t k, int16_t* s16, int16_t* s32) {
  for (int64_t j = 0; j < k / 16; ++j) {
    int v = 0;
    for (int i = 0; i < 16; ++i) v += q[j * 16 + i];
    s16[j] = static_cast<int16_t>(v);
  }
  for (int64_t j = 0; j < k / 32; ++j) s32[j] = static_cast<int16_t>(s16[2 * j] + s16[2 * j + 1]);
}

// One row's blocks: dx = amax / 127 (float32), t = x * (1 / dx), xh = round-half-even(t), xl = round-half-even(254 *
// (t - xh)), x = dx * xh + (dx / 254) * xl to 1 / 64516 of the block's largest |x| (one part: 1 / 254, coarser than
// bfloat16 itself); formats.py quantize_activations is the same arithmetic.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t s, int8_t* qh, int8_t* ql, float* dh, float* dl) {
  for (int64_t b = 0; b < k / s; ++b) {
    float amax = 0.0f;
    for (int64_t i = 0; i < s; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[b * s + i])));
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    for (int64_t i = 0; i < s; ++i) {
      const float t = static_cast<float>(x[b * s + i]) * id;
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(t)));  // ties to even
      qh[b * s + i] = static_cast<int8_t>(v);
      ql[b * s + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint((t - v) * kLowSteps))));
    }
    dh[b] = db;
    dl[b] = db / kLowSteps;
  }
}

XQuant quantize_x(const at::Tensor& x, int64_t s) {
  const int64_t m = x.size(0), k = x.size(1), e = kParts * m;
  XQuant xq;
  xq.k = k;
  xq.s = s;
  xq.q.resize(e * k);
  xq.d.resize(e * (k / s));
  xq.s16.resize(e * (k / 16));
  xq.s32.resize(e * (k / 32));
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto row = [&](int64_t r) {
    int8_t* q = xq.q.data() + 2 * r * k;
    float* d = xq.d.data() + 2 * r * (k / s);
    if (bf16) {
      quantize_row(x.data_ptr<c10::BFloat16>() + r * x.stride(0), k, s, q, q + k, d, d + k / s);
    } else {
      quantize_row(x.data_ptr<float>() + r * x.stride(0), k, s, q, q + k, d, d + k / s);
    }
    for (int64_t p = 0; p < kParts; ++p)
      block_sums(q + p * k, k, xq.s16.data() + (2 * r + p) * (k / 16), xq.s32.data() + (2 * r + p) * (k / 32));
  };
  if (m > 1 && m * k >= (1 << 16)) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) row(r);
  } else {
    for (int64_t r = 0; r < m; ++r) row(r);
  }
  return xq;
}

// Where a tile writes: float32 or bfloat16 rows, the bias, the valid columns.
struct Out {
  float* f32;
  c10::BFloat16* bf16;
  int64_t stride;
  const float* bias;
  int64_t n;
};

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

template <class F>
void plain_blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS;
  float acc[kCols];
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t e = 0; e < kParts * m; ++e) {  // expanded rows: xh, then xl of the same row
      const int64_t r = e;
      if (e % kParts == 0) std::fill(acc, acc + kCols, 0.0f);
      const int8_t* xr = xq.row(r);
      for (int64_t s = 0; s < sb; ++s) {
        const uint8_t* b = w + (blk * sb + s) * F::kBytes;
        for (int c = 0; c < kCols; ++c) {
          int32_t s1 = 0, s2 = 0;
          for (int j32 = 0; j32 < F::kJ32; ++j32) {
            int32_t part[2] = {0, 0};  // groups 0-3 and 4-7 (Q6_K's two sub-blocks of 16)
            for (int g = 0; g < 8; ++g)
              for (int i = 0; i < 4; ++i) part[g >> 2] += code<F>(b, j32, g, c, i) * xr[s * F::kS + j32 * 32 + 4 * g + i];
            if constexpr (F::kSub == 0) {
              s1 += part[0] + part[1];
            } else if constexpr (F::kSub == 32) {
              s1 += pair_at(b + F::kOffSc, j32, c) * (part[0] + part[1]);
            } else {
              s1 += pair_at(b + F::kOffSc, 2 * j32, c) * part[0] + pair_at(b + F::kOffSc, 2 * j32 + 1, c) * part[1];
            }
          }
          if constexpr (F::kSub == 0) {
            s2 = xq.s32[r * (xq.k / 32) + s];
          } else {
            const int16_t* bs = F::kSub == 32 ? xq.s32.data() + r * (xq.k / 32) : xq.s16.data() + r * (xq.k / 16);
            for (int j = 0; j < F::kSubs; ++j)
              s2 += pair_at(b + (F::kOwnMins ? F::kOffMn : F::kOffSc), j, c) * bs[s * F::kSubs + j];
          }
          const float dd = half_at(b + F::kOffD, c);
          const float mm = F::kStoresM ? half_at(b + F::kOffM, c) : dd * static_cast<float>(F::kMMul);
          acc[c] = std::fma(std::fma(dd, static_cast<float>(s1), -mm * static_cast<float>(s2)),
                            xq.d[r * (xq.k / F::kS) + s], acc[c]);
        }
      }
      if (e % kParts == kParts - 1) store_cols(o, e / kParts, blk * kCols, kCols, acc);
    }
  }
}

// ------------------------------------------------------------------ SIMD tiles (AVX2, AVX-512, AVX-512 VNNI)

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
  static I dot(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), set16(1))); }
  static I pairs(const uint8_t* p) {  // 8 columns' int8 pairs -> int16 pairs in 32-bit lanes
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F halfs(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  template <int N>
  static I srl32(I v) { return _mm256_srli_epi32(v, N); }
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
  static I pairs(const uint8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F halfs(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  template <int N>
  static I srl32(I v) { return _mm512_srli_epi32(v, N); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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

// One 32-k chunk of R rows: S1 += its sub-scaled integer dot products (the sub-scales: sc pairs `p` as loaded,
// even or odd member for Q4_K / Q5_K; both for Q6_K).
template <class V, class F, int R, int G>
inline void chunk_groups(const uint8_t* b, int j32, int lane0, const int8_t* const* xr, int64_t k0,
                         typename V::I* ia, typename V::I* ib, typename V::I sca, typename V::I scb) {
  using I = typename V::I;
  I w0, w1;
  unpack<V, F, G>(b, j32, lane0, w0, w1);
  for (int r = 0; r < R; ++r) {
    const I x0 = V::set32(four(xr[r] + k0 + 4 * G)), x1 = V::set32(four(xr[r] + k0 + 16 + 4 * G));
    if constexpr (V::kVnni || F::kSub == 0) {
      ia[r] = V::dot(ia[r], w0, x0);
      ib[r] = V::dot(ib[r], w1, x1);
    } else {  // the sub-scale as vpmaddwd's second operand
      ia[r] = V::add(ia[r], V::madd(V::maddubs(w0, x0), sca));
      ia[r] = V::add(ia[r], V::madd(V::maddubs(w1, x1), scb));
    }
  }
}

// Bytes of a block's stream a 32-k chunk prefetches (whole lines), and how far ahead.
template <class F>
constexpr int kChunkBytes = (F::kBytes / F::kJ32 + 63) / 64 * 64;
constexpr int kPrefetchBytes = 4096;

// R expanded rows (R / 2 rows of x, each its xh and xl) of one 16-column block over all of K: H halves of V::kL
// columns; a row's two parts are summed at the end.
template <class V, class F, int R>
void tile(const XQuant& xq, int64_t row0, const uint8_t* w, int64_t sb, const Out& o, int64_t col0) {
  using I = typename V::I;
  using FV = typename V::F;
  constexpr int H = kCols / V::kL;
  FV acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = V::fzero();
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xq.row(row0 + r);
  const int64_t n32 = xq.k / 32, n16 = xq.k / 16, ns = xq.k / F::kS;
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = w + s * F::kBytes;
    for (int h = 0; h < H; ++h) {
      const int lane0 = h * V::kL;
      I s1[R];
      for (int r = 0; r < R; ++r) s1[r] = V::zero();
      for (int j32 = 0; j32 < F::kJ32; ++j32) {
        I ia[R], ib[R];
        for (int r = 0; r < R; ++r) ia[r] = ib[r] = V::zero();
        I sca = V::set16(1), scb = sca, p = sca;
        if constexpr (F::kSub != 0) p = V::pairs(b + F::kOffSc + (F::kSub == 32 ? j32 / 2 : j32) * 32 + lane0 * 2);
        // even / odd sub-scale of each lane, as int32 (VNNI) or duplicated int16 (vpmaddwd)
        I even = V::sra16of32(V::template shl32<16>(p)), odd = V::sra16of32(p);
        if constexpr (F::kSub != 0 && !V::kVnni) {
          even = V::or_(V::and_(even, V::set32(0xffff)), V::template shl32<16>(even));
          odd = V::or_(V::and_(odd, V::set32(0xffff)), V::template shl32<16>(odd));
          if constexpr (F::kSub == 32) sca = scb = (j32 & 1) ? odd : even;
          else sca = even, scb = odd;
        }
        if (h == 0) {  // this chunk's share of the stream kPrefetchBytes ahead (the hardware prefetcher alone lags)
          const uint8_t* ahead = b + kPrefetchBytes + j32 * kChunkBytes<F>;
          for (int line = 0; line < kChunkBytes<F>; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        }
        const int64_t k0 = s * F::kS + j32 * 32;
        chunk_groups<V, F, R, 0>(b, j32, lane0, xr, k0, ia, ib, sca, scb);
        chunk_groups<V, F, R, 1>(b, j32, lane0, xr, k0, ia, ib, sca, scb);
        chunk_groups<V, F, R, 2>(b, j32, lane0, xr, k0, ia, ib, sca, scb);
        chunk_groups<V, F, R, 3>(b, j32, lane0, xr, k0, ia, ib, sca, scb);
        for (int r = 0; r < R; ++r) {
          if constexpr (F::kSub == 0) {
            s1[r] = V::add(s1[r], V::add(ia[r], ib[r]));
          } else if constexpr (!V::kVnni) {
            s1[r] = V::add(s1[r], ia[r]);
          } else if constexpr (F::kSub == 32) {
            s1[r] = V::add(s1[r], V::mullo(V::add(ia[r], ib[r]), (j32 & 1) ? odd : even));
          } else {
            s1[r] = V::add(s1[r], V::add(V::mullo(ia[r], even), V::mullo(ib[r], odd)));
          }
        }
      }
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      FV mm;
      if constexpr (F::kStoresM) mm = V::halfs(b + F::kOffM + lane0 * 2);
      else mm = V::mul(dd, V::fset(static_cast<float>(F::kMMul)));
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        FV off;
        if constexpr (F::kSub == 0) {
          off = V::mul(mm, V::fset(static_cast<float>(xq.s32[row * n32 + s])));
        } else {
          const int16_t* bs = F::kSub == 32 ? xq.s32.data() + row * n32 : xq.s16.data() + row * n16;
          I s2 = V::zero();
          for (int p2 = 0; p2 < F::kSubs / 2; ++p2) {
            int32_t pair;
            std::memcpy(&pair, bs + s * F::kSubs + 2 * p2, 4);
            const uint8_t* mp = b + (F::kOwnMins ? F::kOffMn : F::kOffSc) + p2 * 32 + lane0 * 2;
            s2 = V::add(s2, V::madd(V::pairs(mp), V::set32(pair)));
          }
          off = V::mul(mm, V::cvt(s2));
        }
        const FV blockv = V::fmsub(dd, V::cvt(s1[r]), off);
        acc[h][r] = V::fmadd(blockv, V::fset(xq.d[row * ns + s]), acc[h][r]);
      }
    }
  }
  alignas(64) float buf[kCols];
  static_assert(R % kParts == 0 && kParts == 2, "a tile holds whole rows");
  for (int r = 0; r < R; r += kParts) {
    for (int h = 0; h < H; ++h) V::store(buf + h * V::kL, V::fadd(acc[h][r], acc[h][r + 1]));
    store_cols(o, (row0 + r) / kParts, col0, kCols, buf);
  }
}

template <class V, class F>
void simd_blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS;
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* wb = w + blk * sb * F::kBytes;
    constexpr int64_t rows = V::kL == 16 ? kRowsWide : kRows;
    for (int64_t r = 0; r < kParts * m; r += rows) {  // expanded rows, an even count
      switch (std::min<int64_t>(rows, kParts * m - r)) {
        case 2: tile<V, F, 2>(xq, r, wb, sb, o, blk * kCols); break;
        case 4: tile<V, F, 4>(xq, r, wb, sb, o, blk * kCols); break;
        case 6: tile<V, F, rows < 6 ? 4 : 6>(xq, r, wb, sb, o, blk * kCols); break;
        default: tile<V, F, rows < 8 ? 4 : 8>(xq, r, wb, sb, o, blk * kCols); break;
      }
    }
  }
}

// The panel path's dequantization of one column block's blocks into W^T rows (float32 [K, ld], columns col0..+15):
// w = (D sc) q - (M mn) per lane, the codes as unpack reads them (byte i of a lane is k 4g + i).
template <class V, class F, int G>
inline void dequant_groups(const uint8_t* b, int j32, int lane0, float* dst, int64_t ld, typename V::F sc0,
                           typename V::F sc1, typename V::F mn0, typename V::F mn1) {
  typename V::I w0, w1;
  unpack<V, F, G>(b, j32, lane0, w0, w1);
  const typename V::I ff = V::set32(0xff);
  auto put = [&](typename V::I w, int64_t kk, typename V::F sc, typename V::F mn) {
    V::store(dst + (kk + 0) * ld, V::fmsub(V::cvt(V::and_(w, ff)), sc, mn));
    V::store(dst + (kk + 1) * ld, V::fmsub(V::cvt(V::and_(V::template srl32<8>(w), ff)), sc, mn));
    V::store(dst + (kk + 2) * ld, V::fmsub(V::cvt(V::and_(V::template srl32<16>(w), ff)), sc, mn));
    V::store(dst + (kk + 3) * ld, V::fmsub(V::cvt(V::template srl32<24>(w)), sc, mn));
  };
  put(w0, j32 * 32 + 4 * G, sc0, mn0);
  put(w1, j32 * 32 + 16 + 4 * G, sc1, mn1);
}

template <class V, class F>
void simd_dequant(const uint8_t* wb, int64_t sb, float* dst, int64_t ld) {  // dst: [K, ld] at the block's column 0
  using FV = typename V::F;
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = wb + s * F::kBytes;
    for (int lane0 = 0; lane0 < kCols; lane0 += V::kL) {
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      const FV mm = F::kStoresM ? V::halfs(b + F::kOffM + lane0 * 2) : V::mul(dd, V::fset(float(F::kMMul)));
      for (int j32 = 0; j32 < F::kJ32; ++j32) {
        FV sc0 = dd, sc1 = dd, mn0 = mm, mn1 = mm;
        if constexpr (F::kSub != 0) {  // sub-scales (and offsets) of this chunk's k 0-15 and 16-31, per lane
          const int pair = F::kSub == 32 ? j32 / 2 : j32;
          auto pick = [&](int off, bool odd) {
            const typename V::I p = V::pairs(b + off + pair * 32 + lane0 * 2);
            return V::cvt(odd ? V::sra16of32(p) : V::sra16of32(V::template shl32<16>(p)));
          };
          const FV a0 = pick(F::kOffSc, F::kSub == 32 ? (j32 & 1) : 0);
          const FV a1 = F::kSub == 32 ? a0 : pick(F::kOffSc, 1);
          const FV n0 = F::kOwnMins ? pick(F::kOffMn, j32 & 1) : a0, n1 = F::kOwnMins ? n0 : a1;
          sc0 = V::mul(dd, a0), sc1 = V::mul(dd, a1), mn0 = V::mul(mm, n0), mn1 = V::mul(mm, n1);
        }
        float* d = dst + s * F::kS * ld + lane0;
        dequant_groups<V, F, 0>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 1>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 2>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 3>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
      }
    }
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------ driver

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

template <class F>
void plain_dequant(const uint8_t* wb, int64_t sb, float* dst, int64_t ld) {  // simd_dequant's plain C++ form
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = wb + s * F::kBytes;
    for (int c = 0; c < kCols; ++c) {
      const float dd = half_at(b + F::kOffD, c);
      const float mm = F::kStoresM ? half_at(b + F::kOffM, c) : dd * static_cast<float>(F::kMMul);
      for (int j32 = 0; j32 < F::kJ32; ++j32)
        for (int g = 0; g < 8; ++g) {
          const int sub = F::kSub == 16 ? 2 * j32 + (g >> 2) : j32;
          const float sc = F::kSub ? static_cast<float>(pair_at(b + F::kOffSc, sub, c)) : 1.0f;
          const float mn = F::kSub ? static_cast<float>(pair_at(b + (F::kOwnMins ? F::kOffMn : F::kOffSc), sub, c))
                                   : 1.0f;
          for (int i = 0; i < 4; ++i)
            dst[(s * F::kS + j32 * 32 + 4 * g + i) * ld + c] =
                static_cast<float>(code<F>(b, j32, g, c, i)) * (dd * sc) - mm * mn;
        }
    }
  }
}

// kPanel: out = x @ W^T a panel of column blocks at a time: W^T's panel dequantized to float32 [K, P] on the
// caller's OpenMP threads, then torch's GEMM (oneDNN; bfloat16 where x and out are and the CPU multiplies bfloat16
// natively), so a prefill costs what the float model's does and equals the dequantized model's product.
template <class F>
void run_panels(Isa isa, at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n, const at::Tensor& bias) {
  const int64_t k = x.size(1), sb = k / F::kS, blocks = (n + kCols - 1) / kCols;
  const int64_t panel_blocks = std::min(blocks, std::max<int64_t>(4, kPanelBytes / (k * 4 * kCols)));
  const bool bf16 = x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot();
  const at::ScalarType pt = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xin = x.scalar_type() == pt ? x : x.to(pt);
  at::Tensor scratch = at::empty({k * panel_blocks * kCols}, x.options().dtype(at::kFloat));
  for (int64_t b0 = 0; b0 < blocks; b0 += panel_blocks) {
    const int64_t b1 = std::min(blocks, b0 + panel_blocks), ld = (b1 - b0) * kCols;
    const int64_t c0 = b0 * kCols, cols = std::min(n, b1 * kCols) - c0;
    float* dst = scratch.data_ptr<float>();
    over_threads(b1 - b0, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* wb = w + (b0 + p) * sb * F::kBytes;
#if defined(__AVX512F__)
        if (isa >= kAvx512) { simd_dequant<V512<false>, F>(wb, sb, dst + p * kCols, ld); continue; }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (isa >= kAvx2) { simd_dequant<V256, F>(wb, sb, dst + p * kCols, ld); continue; }
#endif
        plain_dequant<F>(wb, sb, dst + p * kCols, ld);
      }
    });
    at::Tensor wt = scratch.narrow(0, 0, k * ld).view({k, ld}).narrow(1, 0, cols);
    if (pt != at::kFloat) wt = wt.to(pt);
    at::Tensor o = out.narrow(1, c0, cols);
    if (out.scalar_type() == pt) {
      if (bias.defined()) {
        at::addmm_out(o, bias.narrow(0, c0, cols).to(pt), xin, wt);
      } else {
        at::mm_out(o, xin, wt);
      }
    } else {
      at::Tensor t = at::mm(xin, wt);
      if (bias.defined()) t.add_(bias.narrow(0, c0, cols));
      o.copy_(t);
    }
  }
}

template <class F>
void run_format(Isa isa, const XQuant& xq, int64_t m, const uint8_t* w, int64_t blocks, const Out& o) {
  over_threads(blocks, [&](int64_t b0, int64_t b1) {
#if defined(__AVX512F__)
    if (isa == kVnni) return simd_blocks<V512<true>, F>(xq, m, w, b0, b1, o);
    if (isa == kAvx512) return simd_blocks<V512<false>, F>(xq, m, w, b0, b1, o);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa == kAvx2) return simd_blocks<V256, F>(xq, m, w, b0, b1, o);
#endif
    plain_blocks<F>(xq, m, w, b0, b1, o);
  });
}

// Whether m rows go through the panels (kPanel) rather than the int8 tiles: PROVISIONAL, measured below.
// PAGEDSERVE_KQUANT_PANEL_ROWS=R moves the threshold to R rows (0: never), for measuring.
bool use_panels(int64_t m, int64_t type, Isa isa) {
  static const int64_t forced = [] {
    const char* v = std::getenv("PAGEDSERVE_KQUANT_PANEL_ROWS");
    if (v == nullptr || v[0] == '\0') return int64_t{-1};
    const long long r = std::atoll(v);
    return r <= 0 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(r);
  }();
  if (forced >= 0) return m >= forced;
  (void)type;
  return m >= (isa == kVnni ? 64 : 32);
}

int64_t block_weights(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 256 : 32; }

int64_t packed_bytes(int64_t type, int64_t n, int64_t k) {
  const int64_t blocks = (n + kCols - 1) / kCols, sb = k / block_weights(type);
  switch (type) {
    case kQ4_0: return blocks * sb * FQ4_0::kBytes;
    case kQ4_1: return blocks * sb * FQ4_1::kBytes;
    case kQ5_0: return blocks * sb * FQ5_0::kBytes;
    case kQ5_1: return blocks * sb * FQ5_1::kBytes;
    case kQ4_K: return blocks * sb * FQ4_K::kBytes;
    case kQ5_K: return blocks * sb * FQ5_K::kBytes;
    case kQ6_K: return blocks * sb * FQ6_K::kBytes;
    case kQ8_0: return blocks * ((k + 31) / 32) * kCols * 34;
    default: return -1;
  }
}

}  // namespace

int64_t kquant_gemm_isa() { return best_isa(); }

void kquant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& blob, const c10::optional<at::Tensor>& bias,
                 int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && blob.dim() == 1, "kquant_gemm: x [M, K], out [M, N], blob 1-D");
  TORCH_CHECK(blob.scalar_type() == at::kChar && blob.is_contiguous() && blob.numel() >= 64,
              "kquant_gemm: the weight is an int8 blob (engine/model_executor/layers/formats.py pack_parts)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "kquant_gemm: x is float32 or "
              "bfloat16, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "kquant_gemm: out is float32 "
              "or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "kquant_gemm: rows contiguous");
  const uint8_t* base = reinterpret_cast<const uint8_t*>(blob.data_ptr<int8_t>());
  int64_t head[4];
  std::memcpy(head, base, sizeof(head));
  const int64_t parts = head[1], n = head[2], k = head[3];
  TORCH_CHECK(head[0] == kMagic && parts > 0 && 64 + 32 * parts <= blob.numel(), "kquant_gemm: not a packed blob");
  const int64_t m = x.size(0);
  TORCH_CHECK(x.size(1) == k && out.size(1) == n && out.size(0) == m, "kquant_gemm: x [", m, ", ", x.size(1),
              "] and out [", out.size(0), ", ", out.size(1), "] for a weight [", n, ", ", k, "]");
  const Isa best = best_isa();
  const bool forced_panel = isa == kPanel;
  const Isa use = isa == kAuto || forced_panel ? best : static_cast<Isa>(isa);
  TORCH_CHECK(use == kPlain || ((use == kAvx2 || use == kAvx512 || use == kVnni) && use <= best),
              "kquant_gemm: ISA path ", isa, " is not in this build or on this CPU (best ", best, ")");
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "kquant_gemm: bias has ", bias->numel(), " elements, N is ", n);
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return;
  XQuant x32, x256;  // x quantized per block of 32 / 256, as the parts need
  int64_t col = 0;
  for (int64_t p = 0; p < parts; ++p) {
    int64_t info[4];
    std::memcpy(info, base + 64 + 32 * p, sizeof(info));
    const int64_t type = info[0], rows = info[1], offset = info[2], bytes = info[3];
    TORCH_CHECK(rows > 0 && bytes == packed_bytes(type, rows, k) && offset + bytes <= blob.numel() &&
                    col + rows <= n && k % block_weights(type) == 0,
                "kquant_gemm: part ", p, " (type ", type, ", ", rows, " rows) does not match the blob");
    at::Tensor o_part = out.narrow(1, col, rows);
    if (type == kQ8_0) {
      const at::Tensor w = blob.narrow(0, offset, bytes).view(at::kByte);
      q8_gemm(o_part, x, w, bias_f32.defined() ? c10::optional<at::Tensor>(bias_f32.narrow(0, col, rows))
                                              : c10::nullopt, forced_panel ? kPanel : 0);
      col += rows;
      continue;
    }
    const int64_t s = block_weights(type);
    const uint8_t* w = base + offset;
    if (forced_panel || (isa == kAuto && use_panels(m, type, use))) {
      const at::Tensor b = bias_f32.defined() ? bias_f32.narrow(0, col, rows) : at::Tensor();
      switch (type) {
        case kQ4_0: run_panels<FQ4_0>(use, o_part, x, w, rows, b); break;
        case kQ4_1: run_panels<FQ4_1>(use, o_part, x, w, rows, b); break;
        case kQ5_0: run_panels<FQ5_0>(use, o_part, x, w, rows, b); break;
        case kQ5_1: run_panels<FQ5_1>(use, o_part, x, w, rows, b); break;
        case kQ4_K: run_panels<FQ4_K>(use, o_part, x, w, rows, b); break;
        case kQ5_K: run_panels<FQ5_K>(use, o_part, x, w, rows, b); break;
        case kQ6_K: run_panels<FQ6_K>(use, o_part, x, w, rows, b); break;
        default: TORCH_CHECK(false, "kquant_gemm: GGML type ", type, " has no kernel");
      }
      col += rows;
      continue;
    }
    XQuant& xq = s == 32 ? x32 : x256;
    if (xq.k == 0) xq = quantize_x(x, s);
    const bool f32 = out.scalar_type() == at::kFloat;
    const Out o{f32 ? o_part.data_ptr<float>() : nullptr, f32 ? nullptr : o_part.data_ptr<c10::BFloat16>(),
                out.stride(0), bias_f32.defined() ? bias_f32.data_ptr<float>() + col : nullptr, rows};
    const int64_t blocks = (rows + kCols - 1) / kCols;
    switch (type) {
      case kQ4_0: run_format<FQ4_0>(use, xq, m, w, blocks, o); break;
      case kQ4_1: run_format<FQ4_1>(use, xq, m, w, blocks, o); break;
      case kQ5_0: run_format<FQ5_0>(use, xq, m, w, blocks, o); break;
      case kQ5_1: run_format<FQ5_1>(use, xq, m, w, blocks, o); break;
      case kQ4_K: run_format<FQ4_K>(use, xq, m, w, blocks, o); break;
      case kQ5_K: run_format<FQ5_K>(use, xq, m, w, blocks, o); break;
      case kQ6_K: run_format<FQ6_K>(use, xq, m, w, blocks, o); break;
      default: TORCH_CHECK(false, "kquant_gemm: GGML type ", type, " has no kernel");
    }
    col += rows;
  }
}

}  // namespace cpu
}  // namespace pagedserve
