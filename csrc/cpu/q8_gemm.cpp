// int8 weights for CPU linears: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in llama.cpp's Q8_0 form.
//
// Q8_0: each run of 32 weights along K (a "block") is 32 int8 values q and one float16 scale d, w = d * q
// (engine/model_executor/layers/quant.py quantizes a float weight so, or takes a GGUF Q8_0 tensor's blocks as they
// are). At a few rows a linear is bound by reading W once: 34 bytes per 32 weights against bfloat16's 64 (issue 42).
//
// Packed layout (engine/model_executor/layers/quant.py pack_q8), one uint8 tensor, N padded to 16 columns and K to
// 32 with zeros:
//
//   weights: [N/16][K/32][8][16][4]  uint8  q + 128 (offset binary) of 16 columns side by side, 4 k of a column in
//                                           each 32-bit lane: vpdpbusd's unsigned operand
//   scales:  [N/16][K/32][16]        float16 d of the 16 columns' block, after all the weights
//
// Paths, picked at run time (or forced by `isa`, for tests):
//   kAvx512 (AVX-512 without VNNI): x stays float32, each weight byte is widened to float32 in registers and scaled
//     by its column's d, 16 columns a zmm (a decode step is bound by reading the weights, not by this arithmetic).
//   kVnni (AVX-512 VNNI; the default, but for bfloat16 panels from kPanelRowsVnni / kPanelRowsBf16 rows): each
//     row of x is split per 32-block into two int8 parts, x = dx * (xh + xl / 254) with dx = amax / 127,
//     xh = round(x / dx) and xl = round(254 (x / dx - xh)), and vpdpbusd sums 4 products (q + 128) * xh (and * xl)
//     a lane. The offset is taken off per block with the row's 128 * sum(xh) (and xl), so both sums are exact in
//     int32; then acc += (sum_h + sum_l / 254) * (d * dx). The two parts carry x to 1 / 64516 of its block's largest
//     value, finer than bfloat16's rounding of x itself: one part alone (llama.cpp's Q8_0 x Q8_0 dot) moved
//     SmolLM2's greedy outputs off the float product's (204 of 256 tokens).
//   kAvx2 (AVX2 + FMA; the default on AVX2 CPUs below kPanelRowsAvx2 rows): x in kVnni's two int8 parts, folded into
//     one int16 a k, v = 254 xh + xl (|v| <= 32385); each weight byte is made signed (xor 0x80), sign-extended to
//     int16 and multiplied with v by vpmaddwd (|pair sum| <= 2 * 127 * 32385: a block's int32 sums are exact), then
//     acc += sum * (d * dx / 254), 4 rows a tile so a decode batch reads each weight once. Not llama.cpp's vpmaddubsw
//     sign trick (|w| unsigned, sign(x, w) signed): with two parts of x that is sign + maddubs + madd + add per part,
//     8 ops per 32 products of a row against 4 here (2 madd, 2 add), and one part alone is too coarse (above).
//     Measured on the 2-vCPU Intel Xeon @ 2.50GHz (family 6 model 85) as an AVX2 build (make test-avx2's env), one
//     thread, ms per call, against the float-widening tiles this path replaced (x float32, each weight byte widened
//     and scaled in float: slower at every shape and row count measured, so gone):
//       [N, K]        rows:   1 (GB/s packed)      8         32             128              512
//       [2048, 2048]  float   0.61 (7.3)           2.39      9.41           41.1             152
//                     int     0.39 (11.4)          1.80      6.51           29.7             128
//                     panel   5.86                 9.51      10.8           28.4             53.5 (80 GFLOP/s)
//       [2048, 8192]  float   2.93 (6.1)           12.7      43.1           161              615
//                     int     2.39 (7.5)           9.33      24.8           133              508
//                     panel   28.7                 25.9      36.3           68.3             208 (82 GFLOP/s)
//       [8192, 2048]  float   2.71 (6.6)           8.20      31.6           136              596
//                     int     2.52 (7.1)           5.89      25.0           94.4             392
//                     panel   24.1                 31.3      36.4           72.0             201 (85 GFLOP/s)
//     (torch's float32 linear on the dequantized weight: 1.86, 7.10, 7.26 ms at 1 row; the machine was shared, so
//     figures move by ~20 %.) The integer tiles run 25-45 GFLOP/s; float32 panels overtake them between 48 and 64
//     rows (48 rows: equal within noise on all three shapes; 64: panels 1.0-1.4x faster): kPanelRowsAvx2.
//   kX16 (AVX2's default from kquant::x16_rows() rows, where float32 panels would serve): kAvx2's products against
//     a column block's weights sign-extended to int16 once for all rows (csrc/cpu/kquant_x16.cpp: 128 rows of a
//     [2048, 8192] weight on a Zen 5's AVX2 build 27 ms, against 38 for the kAvx2 tiles and 44 for float32 panels).
//   kPanel (a prefill, a wide decode batch: use_panels): the weights are dequantized a panel of columns at a time
//     into W^T [K, P] (bfloat16 where the CPU multiplies bfloat16 natively and x and out are bfloat16, float32
//     otherwise; 4 MiB) and multiplied by torch's GEMM (oneDNN: AMX tiles or AVX-512 BF16 / FMA). At 128 bfloat16
//     rows on an AMX Xeon: twice the VNNI tiles' rate, four times the widening tiles'.
//
// Threads: the 16-column blocks are split over the caller's OpenMP threads, as small_gemm does
// (csrc/cpu/small_gemm.cpp); the panel path dequantizes on them and leaves the GEMM to torch's own threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "../ops.h"
#include "cpu_features.h"
#include "kquant_blocks.h"  // the x16 panels (kquant_x16.cpp)

namespace pagedserve {
namespace cpu {

namespace {

constexpr int64_t kCols = 16;        // output columns per packed block
constexpr int64_t kQ = 32;           // weights per Q8_0 block (along K)
constexpr int64_t kBlockBytes = kCols * kQ;   // bytes of one (16 columns, 32 k) weight tile
constexpr int64_t kSmallRows = 4;    // up to this many rows: one pass over the weights, every row per load
constexpr int64_t kRowChunk = 128;   // rows of x per sweep over the weights in a long prefill
constexpr int64_t kMinBlocksPerThread = 8;     // a second thread costs more than it saves below this (decode)
constexpr int64_t kMinBlocksPerThreadWide = 2;
constexpr int64_t kPrefetchAhead = 16;        // cache lines of a weight stream prefetched ahead (into L2)

enum Isa : int64_t { kAuto = 0, kAvx2 = 2, kAvx512 = 3, kVnni = 5, kX16 = 6, kPanel = 7 };

constexpr int64_t kPanelBytes = 4 << 20;  // one dequantized panel of W^T (beat 1 MiB panels from 128 rows up)
constexpr int64_t kPanelRowsVnni = 48;    // bfloat16 panels from this many rows on a VNNI CPU with AMX
constexpr int64_t kPanelRowsBf16 = 32;    // the same with AVX-512 BF16 only (Zen 4 / 5; never float32 panels)
constexpr int64_t kPanelRowsWiden = 32;   // panels from this many rows where the widening tiles serve
constexpr int64_t kPanelRowsAvx2 = 48;    // float32 panels from this many rows where the AVX2 integer tiles serve

// AMX tiles for bfloat16 (Sapphire Rapids on): where oneDNN's bfloat16 GEMM outruns the int8 tiles by far.
bool cpu_has_amx_bf16() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool has = __builtin_cpu_supports("amx-bf16");
  return has;
#else
  return false;
#endif
}

// Whether m rows go through the panels (measured on an AMX Xeon: docs/benchmarks.md, "int8 weights against
// llama.cpp's Q8_0"). On a VNNI CPU the int8 tiles beat float32 panels at every row count and AMX's bfloat16 panels
// below kPanelRowsVnni rows; without AMX, AVX-512 BF16's panels below kPanelRowsBf16 (a Zen 5, one thread, [2048,
// 8192], ms tiles / panels: 32 rows 4.2 / 5.0, 64 rows 8.2 / 7.2, 128 rows 16.1 / 11.5, 512 rows 64 / 37);
// the widening tiles lose to either panel from kPanelRowsWiden rows, the AVX2 integer tiles to float32 panels from
// kPanelRowsAvx2 (header). PAGEDSERVE_Q8_PANEL_ROWS=R moves the threshold
// to R rows for every dtype (0: never), for measuring.
Isa best_isa();

bool use_panels(int64_t m, at::ScalarType pt) {
  static const int64_t forced = [] {
    const char* v = std::getenv("PAGEDSERVE_Q8_PANEL_ROWS");
    if (v == nullptr || v[0] == '\0') return int64_t{-1};
    const long long r = std::atoll(v);
    return r <= 0 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(r);
  }();
  if (forced >= 0) return m >= forced;
  if (cpu_has_vnni()) return pt == at::kBFloat16 && m >= (cpu_has_amx_bf16() ? kPanelRowsVnni : kPanelRowsBf16);
  return m >= (best_isa() == kAvx2 ? kPanelRowsAvx2 : kPanelRowsWiden);
}

Isa best_isa() {
#if defined(__AVX512F__)
  if (cpu_has_vnni()) return kVnni;
  return kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kAuto;  // none: q8_gemm_isa() reports 0 and engine/model_executor/layers/quant.py refuses int8 weights
#endif
}

inline void store_row(const Out& o, int64_t row, int64_t col0, const float* v) {
  const int64_t cols = std::min<int64_t>(kCols, o.n - col0);
  if (o.f32) {
    float* dst = o.f32 + row * o.stride + col0;
    for (int64_t c = 0; c < cols; ++c) dst[c] = v[c] + (o.bias ? o.bias[col0 + c] : 0.0f);
  } else {
    c10::BFloat16* dst = o.bf16 + row * o.stride + col0;
    for (int64_t c = 0; c < cols; ++c) dst[c] = c10::BFloat16(v[c] + (o.bias ? o.bias[col0 + c] : 0.0f));
  }
}

// The weight stream of a tile: block b's weights and scales, kb blocks of 32 k each.
struct Stream {
  const uint8_t* w;       // block 0's weights
  const uint16_t* s;      // block 0's scales (float16 bits)
  int64_t w_block;        // bytes between blocks' weights (kb * 512)
  int64_t s_block;        // scales between blocks' scales (kb * 16)
  int64_t kb;             // 32-k blocks along K
};

constexpr float kLowSteps = 254.0f;  // xl's steps per step of xh

// x quantized per 32-block in two parts (the VNNI path; the AVX2 path folds them into X16): int8 rows of kb * 32 (K
// padded with zeros) of xh and of xl, per block its scale dx and 128 * sum(xh), 128 * sum(xl) (what the weights'
// offset adds to a block's integer sums).
struct XQuant {
  std::vector<int8_t> q, ql;
  std::vector<float> d;
  std::vector<int32_t> corr, corrl;
  int64_t kb = 0;
};

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// One row's 32-blocks in two parts, as engine/model_executor/layers/quant.py's reference does: dx = amax / 127
// (float32), t = x * (1 / dx), xh = round-half-even(t), xl = round-half-even(254 * (t - xh)); a block of zeros has
// dx = 0 and xh = xl = 0.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t kb, int8_t* q, int8_t* ql, float* d, int32_t* corr,
                  int32_t* corrl) {
  float vals[kQ];
  for (int64_t j = 0; j < kb; ++j) {
    const int64_t k0 = j * kQ, len = std::min<int64_t>(kQ, k - k0);
    for (int64_t i = 0; i < kQ; ++i) vals[i] = i < len ? as_float(x[k0 + i]) : 0.0f;
    const float amax = vec::abs_max(vals, kQ);
    const float dj = amax / 127.0f;
    const float id = dj != 0.0f ? 1.0f / dj : 0.0f;
    int32_t sum = 0, suml = 0;
    for (int64_t i = 0; i < kQ; ++i) {
      const float t = vals[i] * id;
      const float r = std::nearbyint(t);  // the default rounding mode: to nearest, ties to even
      const int32_t v = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, r)));
      const float rl = std::nearbyint((t - static_cast<float>(v)) * kLowSteps);
      const int32_t vl = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, rl)));
      q[k0 + i] = static_cast<int8_t>(v);
      ql[k0 + i] = static_cast<int8_t>(vl);
      sum += v;
      suml += vl;
    }
    d[j] = dj;
    corr[j] = 128 * sum;
    corrl[j] = 128 * suml;
  }
}

XQuant quantize_x(const at::Tensor& x, int64_t kb) {
  const int64_t m = x.size(0), k = x.size(1);
  XQuant xq;
  xq.kb = kb;
  xq.q.resize(m * kb * kQ);
  xq.ql.resize(m * kb * kQ);
  xq.d.resize(m * kb);
  xq.corr.resize(m * kb);
  xq.corrl.resize(m * kb);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t stride = x.stride(0);
  const void* base = x.data_ptr();
  auto row = [&](int64_t r) {
    if (bf16) {
      quantize_row(static_cast<const c10::BFloat16*>(base) + r * stride, k, kb, xq.q.data() + r * kb * kQ,
                   xq.ql.data() + r * kb * kQ, xq.d.data() + r * kb, xq.corr.data() + r * kb, xq.corrl.data() + r * kb);
    } else {
      quantize_row(static_cast<const float*>(base) + r * stride, k, kb, xq.q.data() + r * kb * kQ,
                   xq.ql.data() + r * kb * kQ, xq.d.data() + r * kb, xq.corr.data() + r * kb, xq.corrl.data() + r * kb);
    }
  };
  if (m * k >= (1 << 16) && m > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) row(r);
  } else {
    for (int64_t r = 0; r < m; ++r) row(r);
  }
  return xq;
}

// x rows widened to float32 (the AVX-512 widening path), K padded to kb * 32 with zeros.
std::vector<float> widen_x(const at::Tensor& x, int64_t width) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> buf(m * width, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    if (x.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + r * x.stride(0);
      for (int64_t i = 0; i < k; ++i) buf[r * width + i] = static_cast<float>(src[i]);
    } else {
      std::memcpy(buf.data() + r * width, x.data_ptr<float>() + r * x.stride(0), k * sizeof(float));
    }
  }
  return buf;
}

// x per 32-block as one int16 a k, 254 xh + xl (|v| <= 127 * 254 + 127 = 32385: the two parts of quantize_row
// exactly), and per block dx / 254: the AVX2 integer path's operands.
struct X16 {
  std::vector<int16_t> v;
  std::vector<float> d;
};

X16 quantize_x16(const at::Tensor& x, int64_t kb) {
  const XQuant xq = quantize_x(x, kb);
  X16 x16;
  x16.v.resize(xq.q.size());
  x16.d.resize(xq.d.size());
  for (size_t i = 0; i < xq.q.size(); ++i)
    x16.v[i] = static_cast<int16_t>(static_cast<int>(kLowSteps) * xq.q[i] + xq.ql[i]);
  for (size_t i = 0; i < xq.d.size(); ++i) x16.d[i] = xq.d[i] / kLowSteps;
  return x16;
}

// ------------------------------------------------------------------ AVX-512 VNNI

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")

// R rows, B blocks of 16 columns: 2 R B int32 block sums (xh's and xl's) and R B float32 accumulators (R = 3, B = 2:
// 18 zmm).
template <int R, int B>
void tile_vnni(const XQuant& xq, int64_t row0, const Stream& st, int64_t b0, const Out& o) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t kb = st.kb;
  const uint8_t* wb[B];
  const uint16_t* sb[B];
  for (int b = 0; b < B; ++b) {
    wb[b] = st.w + (b0 + b) * st.w_block;
    sb[b] = st.s + (b0 + b) * st.s_block;
  }
  const int8_t* xr[R];
  const int8_t* xl[R];
  const float* dr[R];
  const int32_t* cr[R];
  const int32_t* cl[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.q.data() + (row0 + r) * kb * kQ;
    xl[r] = xq.ql.data() + (row0 + r) * kb * kQ;
    dr[r] = xq.d.data() + (row0 + r) * kb;
    cr[r] = xq.corr.data() + (row0 + r) * kb;
    cl[r] = xq.corrl.data() + (row0 + r) * kb;
  }
  const __m512 low_step = _mm512_set1_ps(1.0f / kLowSteps);
  for (int64_t j = 0; j < kb; ++j) {
    __m512i sum[R][B], suml[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) sum[r][b] = suml[r][b] = _mm512_setzero_si512();
    for (int g = 0; g < kQ / 4; ++g) {  // 4 k per 32-bit lane: 8 loads of 64 bytes per block
      __m512i wv[B];
      for (int b = 0; b < B; ++b) {
        const uint8_t* line = wb[b] + j * kBlockBytes + g * 64;
        _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchAhead * 64), _MM_HINT_T2);
        wv[b] = _mm512_loadu_si512(line);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four, fourl;
        std::memcpy(&four, xr[r] + j * kQ + g * 4, 4);
        std::memcpy(&fourl, xl[r] + j * kQ + g * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four), xvl = _mm512_set1_epi32(fourl);
        for (int b = 0; b < B; ++b) {
          sum[r][b] = _mm512_dpbusd_epi32(sum[r][b], wv[b], xv);
          suml[r][b] = _mm512_dpbusd_epi32(suml[r][b], wv[b], xvl);
        }
      }
    }
    __m512 ds[B];
    for (int b = 0; b < B; ++b)
      ds[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[b] + j * kCols)));
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(cr[r][j]), corrl = _mm512_set1_epi32(cl[r][j]);
      const __m512 dx = _mm512_set1_ps(dr[r][j]);
      for (int b = 0; b < B; ++b) {
        const __m512 high = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r][b], corr));
        const __m512 lowp = _mm512_cvtepi32_ps(_mm512_sub_epi32(suml[r][b], corrl));
        const __m512 exact = _mm512_fmadd_ps(lowp, low_step, high);
        acc[r][b] = _mm512_fmadd_ps(exact, _mm512_mul_ps(ds[b], dx), acc[r][b]);
      }
    }
  }
  alignas(64) float buf[kCols];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      _mm512_store_ps(buf, acc[r][b]);
      store_row(o, row0 + r, (b0 + b) * kCols, buf);
    }
}

// x in float32 (the AVX-512 default): the weights widened to float32 in registers, d * (q + 128) - 128 d, and
// multiplied with x in float32, 16 columns a zmm. R rows, B blocks: R * B accumulators and 2 B scale vectors.
template <int R, int B>
void tile_widen_avx512(const float* x, int64_t xs, int64_t row0, const Stream& st, int64_t b0, const Out& o) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint8_t* wb[B];
  const uint16_t* sb[B];
  for (int b = 0; b < B; ++b) {
    wb[b] = st.w + (b0 + b) * st.w_block;
    sb[b] = st.s + (b0 + b) * st.s_block;
  }
  const __m512i low = _mm512_set1_epi32(0xff);
  const float* xr = x + row0 * xs;
  for (int64_t j = 0; j < st.kb; ++j) {
    __m512 ds[B], ds128[B];
    for (int b = 0; b < B; ++b) {
      ds[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[b] + j * kCols)));
      ds128[b] = _mm512_mul_ps(ds[b], _mm512_set1_ps(128.0f));
    }
    for (int g = 0; g < kQ / 4; ++g) {
      __m512i v[B];
      for (int b = 0; b < B; ++b) {
        const uint8_t* line = wb[b] + j * kBlockBytes + g * 64;
        _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchAhead * 64), _MM_HINT_T2);
        v[b] = _mm512_loadu_si512(line);
      }
      for (int i = 0; i < 4; ++i) {  // byte i of each lane: k = 4g + i of the 16 columns
        __m512 w[B];
        for (int b = 0; b < B; ++b) {
          const __m512i u =
              i == 3 ? _mm512_srli_epi32(v[b], 24) : _mm512_and_si512(_mm512_srli_epi32(v[b], 8 * i), low);
          w[b] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(u), ds[b], ds128[b]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(xr[r * xs + j * kQ + g * 4 + i]);
          for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(xv, w[b], acc[r][b]);
        }
      }
    }
  }
  alignas(64) float buf[kCols];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      _mm512_store_ps(buf, acc[r][b]);
      store_row(o, row0 + r, (b0 + b) * kCols, buf);
    }
}

// Blocks [b0, b1) of the packed weight, dequantized transposed: dst[k * ld + (b - b0) * 16 + c] = d * q of column
// c, for the 32-k blocks [j0, j1) (k < K only: the zero padding is not written). bfloat16 rounds to nearest even.
template <typename T>
void dequant_panel_avx512(const Stream& st, int64_t b0, int64_t b1, int64_t j0, int64_t j1, int64_t k, T* dst,
                          int64_t ld) {
  const __m512i low = _mm512_set1_epi32(0xff);
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = st.w + b * st.w_block + j * kBlockBytes;
      const uint16_t* sc = st.s + b * st.s_block + j * kCols;
      if (b + 1 < b1) {  // the next column block's bytes: another stream (the hardware prefetcher lags)
        for (int64_t line = 0; line < kBlockBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + st.w_block + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sc + st.s_block), _MM_HINT_T0);
      }
      const __m512 ds = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      const __m512 ds128 = _mm512_mul_ps(ds, _mm512_set1_ps(128.0f));
      for (int g = 0; g < kQ / 4; ++g) {
        const __m512i v = _mm512_loadu_si512(w + g * 64);
        for (int i = 0; i < 4; ++i) {
          const int64_t kk = j * kQ + g * 4 + i;
          if (kk >= k) break;
          const __m512i u = i == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), low);
          const __m512 f = _mm512_fmsub_ps(_mm512_cvtepi32_ps(u), ds, ds128);
          T* row = dst + kk * ld + (b - b0) * kCols;
          if constexpr (std::is_same_v<T, float>) {
            _mm512_storeu_ps(row, f);
          } else {  // round to nearest even: bits + 0x7fff + (bit 16), the high half (these are finite values)
            const __m512i bits = _mm512_castps_si512(f);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
            const __m512i r = _mm512_srli_epi32(biased, 16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_cvtepi32_epi16(r));
          }
        }
      }
    }
  }
}

#pragma GCC pop_options
#endif  // __AVX512F__

// ------------------------------------------------------------------ AVX2 + FMA (x in two int8 parts; panels)

#if defined(__AVX2__) && defined(__FMA__)

// The AVX2 default (x in two int8 parts, as one int16 a k: X16): per 64-byte line, each half of 8 columns x 4 k is
// made signed (xor 0x80), sign-extended to int16 pairs (unpack with itself, shift right 8: columns 0, 1, 4, 5 and
// 2, 3, 6, 7) and vpmaddwd'ed with the row's 4 k of x (one 64-bit broadcast); |q x| <= 127 * 32385, so a block's
// int32 sums are exact. At a block's end vphaddd folds each column's two lanes (columns 0..7 in order) and
// acc += sum * (d * dx / 254). R rows: 4R int32 sums, 2R accumulators.
template <int R>
void tile_avx2_int(const X16& xq, int64_t row0, const Stream& st, int64_t b0, const Out& o) {
  const int64_t kb = st.kb;
  const uint8_t* wb = st.w + b0 * st.w_block;
  const uint16_t* sb = st.s + b0 * st.s_block;
  const int16_t* xr[R];
  const float* dr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.v.data() + (row0 + r) * kb * kQ;
    dr[r] = xq.d.data() + (row0 + r) * kb;
  }
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < kb; ++j) {
    const uint8_t* blk = wb + j * kBlockBytes;
    for (int h = 0; h < 2; ++h) {
      __m256i sum[R][2];
      for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
      for (int g = 0; g < kQ / 4; ++g) {
        const uint8_t* line = blk + g * 64;
        if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchAhead * 64), _MM_HINT_T2);
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + h * 32)), flip);
        const __m256i lo = _mm256_srai_epi16(_mm256_unpacklo_epi8(v, v), 8);
        const __m256i hi = _mm256_srai_epi16(_mm256_unpackhi_epi8(v, v), 8);
        for (int r = 0; r < R; ++r) {
          int64_t four;
          std::memcpy(&four, xr[r] + j * kQ + g * 4, 8);
          const __m256i xv = _mm256_set1_epi64x(four);
          sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(lo, xv));
          sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(hi, xv));
        }
      }
      const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + j * kCols + h * 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sum[r][0], sum[r][1]));
        acc[r][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(ds, _mm256_set1_ps(dr[r][j])), acc[r][h]);
      }
    }
  }
  alignas(32) float buf[kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(buf, acc[r][0]);
    _mm256_store_ps(buf + 8, acc[r][1]);
    store_row(o, row0 + r, b0 * kCols, buf);
  }
}

// dequant_panel_avx512's float32 form on AVX2 (8 columns a ymm).
inline void dequant_panel_avx2(const Stream& st, int64_t b0, int64_t b1, int64_t j0, int64_t j1, int64_t k, float* dst,
                               int64_t ld) {
  const __m256i low = _mm256_set1_epi32(0xff);
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = st.w + b * st.w_block + j * kBlockBytes;
      const uint16_t* s = st.s + b * st.s_block + j * kCols;
      for (int h = 0; h < 2; ++h) {
        const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + h * 8)));
        const __m256 ds128 = _mm256_mul_ps(ds, _mm256_set1_ps(128.0f));
        for (int g = 0; g < kQ / 4; ++g) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + h * 32));
          for (int i = 0; i < 4; ++i) {
            const int64_t kk = j * kQ + g * 4 + i;
            if (kk >= k) break;
            const __m256i u = i == 3 ? _mm256_srli_epi32(v, 24) : _mm256_and_si256(_mm256_srli_epi32(v, 8 * i), low);
            const __m256 f = _mm256_fmsub_ps(_mm256_cvtepi32_ps(u), ds, ds128);
            _mm256_storeu_ps(dst + kk * ld + (b - b0) * kCols + h * 8, f);
          }
        }
      }
    }
  }
}

#endif  // __AVX2__ && __FMA__

// ------------------------------------------------------------------ driver

// fn(b0, b1) over the blocks on up to omp_get_max_threads() threads, at least min_blocks each.
template <typename Fn>
void over_threads(int64_t blocks, int64_t min_blocks, Fn&& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), blocks / min_blocks));
  if (threads == 1) return fn(int64_t{0}, blocks);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    fn(blocks * t / nt, blocks * (t + 1) / nt);
  }
}

// Tiles of up to RMax rows and BMax blocks: table[(r - 1) * BMax + (b - 1)] runs r rows of b blocks.
template <typename Fn, int RMax, int BMax>
struct Table {
  Fn fn[RMax * BMax];
};

#if defined(__AVX512F__)
using WideFn = void (*)(const float*, int64_t, int64_t, const Stream&, int64_t, const Out&);
template <int RMax, int BMax, int... I>
constexpr Table<WideFn, RMax, BMax> widen_table(std::integer_sequence<int, I...>) {
  return {{&tile_widen_avx512<I / BMax + 1, I % BMax + 1>...}};
}
using VnniFn = void (*)(const XQuant&, int64_t, const Stream&, int64_t, const Out&);
template <int RMax, int BMax, int... I>
constexpr Table<VnniFn, RMax, BMax> vnni_table(std::integer_sequence<int, I...>) {
  return {{&tile_vnni<I / BMax + 1, I % BMax + 1>...}};
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
using Avx2IntFn = void (*)(const X16&, int64_t, const Stream&, int64_t, const Out&);
template <int RMax, int... I>
constexpr Table<Avx2IntFn, RMax, 1> avx2_int_table(std::integer_sequence<int, I...>) {
  return {{&tile_avx2_int<I + 1>...}};
}
#endif

// Blocks [b0, b1) for rows [0, m): kRowChunk rows at a time, BMax blocks at a time, RMax rows a pass.
template <int RMax, int BMax, typename Fn, typename Call>
void run_blocks(const Table<Fn, RMax, BMax>& t, int64_t m, int64_t b0, int64_t b1, Call&& call) {
  for (int64_t c = 0; c < m; c += kRowChunk) {
    const int64_t c1 = std::min(m, c + kRowChunk);
    for (int64_t b = b0; b < b1; b += BMax) {
      const int nb = static_cast<int>(std::min<int64_t>(BMax, b1 - b));
      for (int64_t r = c; r < c1; r += RMax) {
        const int nr = static_cast<int>(std::min<int64_t>(RMax, c1 - r));
        call(t.fn[(nr - 1) * BMax + (nb - 1)], r, b);
      }
    }
  }
}

// The column blocks [0, blocks) over the threads, each range through the narrow tiles (up to kSmallRows rows) or
// the wide ones.
template <class Narrow, class Wide, class Call>
void run_narrow_or_wide(const Narrow& narrow, const Wide& wide, bool small, int64_t m, int64_t blocks,
                        int64_t min_blocks, Call&& call) {
  over_threads(blocks, min_blocks, [&](int64_t b0, int64_t b1) {
    if (small) {
      run_blocks(narrow, m, b0, b1, call);
    } else {
      run_blocks(wide, m, b0, b1, call);
    }
  });
}

// kPanel: out = x @ W^T a panel of P columns at a time: W^T's panel dequantized into [K, P] on the caller's OpenMP
// threads, then torch's GEMM (oneDNN) into out's columns, with the bias where out has the panel's dtype.
void gemm_panels(at::Tensor& out, const at::Tensor& x, const Stream& st, int64_t n, int64_t k,
                 const at::Tensor& bias_f32) {
  const at::ScalarType pt = panel_dtype(x, out);
  const int64_t elt = pt == at::kFloat ? 4 : 2;
  const int64_t blocks = (n + kCols - 1) / kCols;
  const int64_t panel_blocks = std::min(blocks, std::max<int64_t>(4, kPanelBytes / (k * elt * kCols)));
  const at::Tensor xin = x.scalar_type() == pt ? x : x.to(pt);
  const at::Tensor bias = bias_f32.defined() ? bias_f32.to(pt) : at::Tensor();
  at::Tensor scratch = at::empty({k * (panel_blocks * kCols + kPanelPad)}, x.options().dtype(pt));
  const bool direct = out.scalar_type() == pt;
  for (int64_t b0 = 0; b0 < blocks; b0 += panel_blocks) {
    const int64_t b1 = std::min(blocks, b0 + panel_blocks), ld = (b1 - b0) * kCols + kPanelPad;
    const int64_t c0 = b0 * kCols, cols = std::min(n, b1 * kCols) - c0;
    over_threads(st.kb, 1, [&](int64_t j0, int64_t j1) {
#if defined(__AVX512F__)
      if (pt == at::kFloat) {
        dequant_panel_avx512(st, b0, b1, j0, j1, k, scratch.data_ptr<float>(), ld);
      } else {
        dequant_panel_avx512(st, b0, b1, j0, j1, k, scratch.data_ptr<c10::BFloat16>(), ld);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      dequant_panel_avx2(st, b0, b1, j0, j1, k, scratch.data_ptr<float>(), ld);
#endif
    });
    const at::Tensor wt = scratch.narrow(0, 0, k * ld).view({k, ld}).narrow(1, 0, cols);
    at::Tensor o = out.narrow(1, c0, cols);
    panel_mm(o, xin, wt, bias.defined() ? bias.narrow(0, c0, cols) : bias, direct);
  }
}

}  // namespace

int64_t q8_gemm_isa() { return best_isa(); }

void q8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
             int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 1, "q8_gemm: x [M, K], out [M, N], packed 1-D");
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && packed.device().is_cpu(), "q8_gemm: CPU tensors");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "q8_gemm: the packed weight is uint8 "
              "(engine/model_executor/layers/quant.py pack_q8), got ", packed.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "q8_gemm: x is float32 or "
              "bfloat16, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "q8_gemm: out is float32 or "
              "bfloat16, got ", out.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "q8_gemm: rows contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m, "q8_gemm: out has ", out.size(0), " rows, x ", m);
  const int64_t blocks = (n + kCols - 1) / kCols, kb = (k + kQ - 1) / kQ;
  const int64_t w_bytes = blocks * kb * kBlockBytes;
  TORCH_CHECK(packed.numel() == w_bytes + blocks * kb * kCols * 2, "q8_gemm: packed weight has ", packed.numel(),
              " bytes, expected ", w_bytes + blocks * kb * kCols * 2, " for N=", n, " K=", k);
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "q8_gemm: bias has ", bias->numel(), " elements, N is ", n);
    bias_f32 = bias->detach().to(at::kFloat).contiguous();  // an inference op (a Parameter may require grad)
  }
  const Isa best = best_isa();
  // AVX2: the x16 panels (csrc/cpu/kquant_x16.cpp) from kquant::x16_rows() rows, the float32 panels never
  const bool x16 = isa == kX16 || (isa == kAuto && best == kAvx2 && m >= kquant::x16_rows());
  const bool panel = !x16 && (isa == kPanel || (isa == kAuto && use_panels(m, panel_dtype(x, out))));
  const Isa use = isa != kAuto && !panel && !x16 ? static_cast<Isa>(isa) : best;
  TORCH_CHECK(use != kAuto && (use == kAvx2 || use == kAvx512 || use == kVnni) && use <= best, "q8_gemm: ISA path ",
              isa, " is not in this build or on this CPU (best ", best, ")");
  if (m == 0 || n == 0) return;
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const Stream st{base, reinterpret_cast<const uint16_t*>(base + w_bytes), kb * kBlockBytes, kb * kCols, kb};
  const bool f32 = out.scalar_type() == at::kFloat;
  const Out o{f32 ? out.data_ptr<float>() : nullptr, f32 ? nullptr : out.data_ptr<c10::BFloat16>(), out.stride(0),
              bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, n};
  if (x16 && kquant::q8_x16_panels(static_cast<kquant::Isa>(use), x, base, st.s, n, o)) return;
  if (panel) return gemm_panels(out, x, st, n, k, bias_f32);
  const bool small = m <= kSmallRows;
  const int64_t min_blocks = small ? kMinBlocksPerThread : kMinBlocksPerThreadWide;

#if defined(__AVX512F__)
  if (use == kVnni) {
    const XQuant xq = quantize_x(x, kb);
    // 4 rows x 2 blocks a tile at every row count (16 sums, 8 accumulators; 8 x 1 tiles were slower at 8 rows).
    static constexpr auto table = vnni_table<4, 2>(std::make_integer_sequence<int, 8>{});
    over_threads(blocks, min_blocks, [&](int64_t b0, int64_t b1) {
      run_blocks(table, m, b0, b1, [&](VnniFn fn, int64_t r, int64_t b) { fn(xq, r, st, b, o); });
    });
    return;
  }
#endif
#if defined(__AVX512F__)
  if (use == kAvx512) {
    const std::vector<float> xf = widen_x(x, kb * kQ);
    // Up to 4 rows: 4 x 2 tiles (one pass); above: 8 rows x 2 blocks (16 accumulators).
    static constexpr auto narrow = widen_table<4, 2>(std::make_integer_sequence<int, 8>{});
    static constexpr auto wide = widen_table<8, 2>(std::make_integer_sequence<int, 16>{});
    run_narrow_or_wide(narrow, wide, small, m, blocks, min_blocks,
                       [&](WideFn fn, int64_t r, int64_t b) { fn(xf.data(), kb * kQ, r, st, b, o); });
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (use == kAvx2) {
    const X16 xq = quantize_x16(x, kb);
    // 4 rows a tile at every row count (4 int32 sums and 2 accumulators a row; 2 and 3 rows a tile were slower at 8)
    static constexpr auto table = avx2_int_table<4>(std::make_integer_sequence<int, 4>{});
    over_threads(blocks, min_blocks, [&](int64_t b0, int64_t b1) {
      run_blocks(table, m, b0, b1, [&](Avx2IntFn fn, int64_t r, int64_t b) { fn(xq, r, st, b, o); });
    });
    return;
  }
#endif
  TORCH_CHECK(false, "q8_gemm: this build has no SIMD path (AVX2+FMA at least)");
}

}  // namespace cpu
}  // namespace pagedserve
