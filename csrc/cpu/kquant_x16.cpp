// The x16 panels of csrc/cpu/kquant_gemm.cpp and q8_gemm.cpp (issue 53: a prefill's many rows on AVX2, where no
// bfloat16 dot product exists and float32 panels run at the FMA's 8 products a lane group): x as the wide tiles carry
// it (x16 = 254 xh + xl, int16, scale dx / 254), scaled per 32 k for every format (a unit's epilogue applies its own
// scale anyway; a K-quant's 256-wide x block let one large value coarsen 255 others: SmolLM2's Q4_K_M file, 8 greedy
// prompts, 89.5 % of the dequantized model's tokens with x per 256, 100 % per 32), the codes of one 16-column block
// unpacked and widened to int16 pairs once into a thread's panel (per 32 k: 16 pairs x 16 columns, the order of x16's
// pairs) with each unit's scale and offset per column as float32 (D sc, M mn; a unit is a sub-block: 16 k for Q6_K,
// else 32; Q8_0: d, 0), then every row of x against it: vpmaddwd, 16 products an instruction, int32 sums per unit (at
// most 32 * 127 * 32258 < 2^31), scaled once per unit and row: out += cvt(sum) (D sc dx) - (M mn) (dx sum x16). The
// products are the wide tiles' (and the int8 tiles' two parts'; a K-quant's x finer here); what changes is the codes
// unpacked once a column block rather than once per 4 rows, and a 3-row x 16-column register tile over a 512-k slice of
// the panel (L1).
//
// Measured on an AMD EPYC Zen 5 (2 vCPUs) as an AVX2 build (make test-avx2's settings), one thread, float32 x, ms
// for a [2048, 8192] / [8192, 2048] weight (benchmarks/kernels.py --ops quant, q8):
//   rows                    16           32           64            128
//   Q4_K wide tiles      3.6 / 3.5    7.2 / 6.9   14.6 / 13.7   30.1 / 27.4
//        x16 panels      3.9 / 3.7    7.5 / 6.8   14.2 / 12.7   27.3 / 24.5
//        float32 panels  3.7 / 3.5*  12.7 / 12.1  22.6 / 21.7   42.8 / 40.8   (* the wide tiles below 32 rows)
//   Q6_K wide / x16 / float32 panels at 128 rows: 39.9 / 31.4 / 42.9 and 38.2 / 28.5 / 41.5; Q4_0 32.8 / 27.0 / 41.9
//   Q8_0 (q8_gemm) int16 tiles / x16 / float32 panels: 16 rows 4.8 / 4.8 / 9.4, 128 rows 38.3 / 27.1 / 43.8 and
//   35.0 / 25.0 / 42.1.
// So from kX16Rows = 24 rows (below, the panel's build is not yet paid back). A 128-token prefill of the 1.17B
// Q4_K_M served on the AVX2 paths: TTFT 1672 -> 813 ms (llama.cpp's AVX2 build: 924). Codes centred in the panel
// (kCenter, 2026-11-29, 128 rows): Q6_K 29.7 / 27.3 -> 25.6 / 24.4 ms, Q5_0 25.7 / 23.5 -> 24.4 / 22.6, Q4_0 25.2 /
// 23.1 -> 24.1 / 22.5; a 128-token prefill of the 1.17B Q6_K file 924-940 -> 833-850 ms. On AVX-512 the same tile
// on zmm (8 or 12 rows, vpdpwssd) lost to the VNNI int8 tiles and the bfloat16 panels (Zen 5, Q8_0 at 128 rows: 16.1
// / 15.8 / 10.5 ms), so this is AVX2 only; a forced X16 path on an AVX-512 build runs these AVX2 tiles (the tests).
#include "kquant_blocks.h"

namespace pagedserve {
namespace cpu {
namespace kquant {

namespace {

constexpr int64_t kX16Rows = 24;  // rows from which AVX2 takes these panels (the header's measurements)

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

constexpr int64_t kSlice = 512;  // k a pass of the rows covers: a 16 KiB slice of the panel, read from L1
constexpr int kTileRows = 3;     // rows a register tile: 6 int32 sums + 6 float32 sums + 2 codes + x of 16 ymm

template <class F>
constexpr int kUnit = F::kSub == 16 ? 16 : 32;  // k a scale covers

// Q8_0 as q8_gemm.cpp packs it ([N/16][K/32][8][16][4] q + 128, then [N/16][K/32][16] float16 d): w = d q.
struct FQ8 {
  static constexpr int kS = 32, kSub = 0;
};

// A format whose offset is a fixed number of code steps (Q4_0 8, Q5_0 16, Q6_K 32: w = D sc (q - c)) is widened into
// the panel as q - c, so a unit's epilogue has no offset term (and Q8_0, signed already, none either): one of its
// three float operations a row and column, a third of the epilogue (Q6_K's 16-k units pay it twice as often).
template <class F>
constexpr int kCenter = F::kStoresM || F::kOwnMins ? -1 : F::kMMul;  // -1: an offset of its own (Q4_1, Q4_K, ...)
template <>
constexpr int kCenter<FQ8> = 0;

// One 16-column block's codes as int16 pairs ([K / 2][16] int32, pair p of a 32-k chunk: codes of x16's pair p) and
// per unit and column D sc and M mn.
struct Panel {
  std::vector<int32_t> q;
  std::vector<float> sa, mn;
};

template <class F, int G>
inline void widen_group(const uint8_t* b, int j32, int lane0, int32_t* chunk) {
  using V = V256;
  V::I w0, w1;
  unpack<V, F, G>(b, j32, lane0, w0, w1);
  const V::I lo = V::set32(0x00ff00ff);  // bytes 0, 2 of a lane: k 4G, 4G + 2 (x16's order x0 x2 x1 x3)
  const V::I c = V::set16(std::max(0, kCenter<F>));
  auto put = [&](int pair, V::I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + pair * 16 + lane0), _mm256_sub_epi16(v, c));
  };
  put(2 * G, V::and_(w0, lo));
  put(2 * G + 1, V::template shift16<-8>(w0));
  put(8 + 2 * G, V::and_(w1, lo));
  put(9 + 2 * G, V::template shift16<-8>(w1));
}

// A K-quant or Q4_0 .. Q5_1 column block (packed as kquant_gemm.cpp's header says) into p.
template <class F>
void build(const uint8_t* w, int64_t sb, Panel& p) {
  constexpr int kUnits = F::kS / kUnit<F>;
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = w + s * F::kBytes;
    for (int j32 = 0; j32 < F::kJ32; ++j32) {
      int32_t* chunk = p.q.data() + (s * F::kJ32 + j32) * 16 * kCols;
      for (int lane0 = 0; lane0 < kCols; lane0 += V256::kL) {
        widen_group<F, 0>(b, j32, lane0, chunk);
        widen_group<F, 1>(b, j32, lane0, chunk);
        widen_group<F, 2>(b, j32, lane0, chunk);
        widen_group<F, 3>(b, j32, lane0, chunk);
      }
    }
    for (int c = 0; c < kCols; ++c) {
      const float dd = half_at(b + F::kOffD, c);
      const float mm = F::kStoresM ? half_at(b + F::kOffM, c) : dd * static_cast<float>(F::kMMul);
      for (int j = 0; j < kUnits; ++j) {
        float sc = 1.0f, mn = 1.0f;
        if constexpr (F::kSub != 0) {
          sc = static_cast<float>(pair_at(b + F::kOffSc, j, c));
          mn = F::kOwnMins ? static_cast<float>(pair_at(b + F::kOffMn, j, c)) : sc;
        }
        p.sa[(s * kUnits + j) * kCols + c] = dd * sc;
        p.mn[(s * kUnits + j) * kCols + c] = mm * mn;
      }
    }
  }
}

// A Q8_0 column block (kb blocks of 32 k; d: its [kb][16] scales) into p: the bytes made signed, sign-extended.
void build_q8(const uint8_t* w, const uint16_t* d, int64_t kb, Panel& p) {
  using V = V256;
  for (int64_t j = 0; j < kb; ++j) {
    int32_t* chunk = p.q.data() + j * 16 * kCols;
    for (int g = 0; g < 8; ++g)
      for (int lane0 = 0; lane0 < kCols; lane0 += V::kL) {
        // k 4g .. 4g + 3 of a column, made signed bytes
        const V::I q = _mm256_xor_si256(V::load(w + (j * 8 + g) * 64 + lane0 * 4), V::set8(0x80));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + 2 * g * kCols + lane0),
                            _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + (2 * g + 1) * kCols + lane0), _mm256_srai_epi16(q, 8));
      }
    for (int c = 0; c < kCols; ++c) {
      p.sa[j * kCols + c] = half_at(reinterpret_cast<const uint8_t*>(d + j * kCols), c);
      p.mn[j * kCols + c] = 0.0f;
    }
  }
}

// Rows row0 .. row0 + R - 1 against units u0 .. u1 - 1 of the panel, adding into acc ([rows][16] float32): H registers
// of V::kL columns a row.
template <class V, class F, int R>
void tile(const Panel& p, const XQuant& xq, int64_t row0, int64_t u0, int64_t u1, float* acc) {
  using I = typename V::I;
  using FV = typename V::F;
  constexpr int U = kUnit<F>, P = U / 2, H = kCols / V::kL;
  const int64_t k = xq.k, nu = k / U;
  const std::vector<float>& xs = U == 16 ? xq.xs16 : xq.xs32;
  const std::vector<float>& dx = U == 16 ? xq.dx16 : xq.dx32;
  FV f[R][H];
  const int16_t* xr[R];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < H; ++h) f[r][h] = V::fload(acc + r * kCols + h * V::kL);
    xr[r] = xq.q16.data() + (row0 + r) * k;
  }
  for (int64_t u = u0; u < u1; ++u) {
    I ia[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) ia[r][h] = V::zero();
    const uint8_t* pq = reinterpret_cast<const uint8_t*>(p.q.data() + u * P * kCols);
#pragma GCC unroll 16
    for (int pp = 0; pp < P; ++pp) {
      I w[H];
      for (int h = 0; h < H; ++h) w[h] = V::load(pq + (pp * kCols + h * V::kL) * 4);
      for (int r = 0; r < R; ++r) {
        const I xb = V::set32(pair16(xr[r] + u * U + 2 * pp));
        for (int h = 0; h < H; ++h) {
          ia[r][h] = V::dot16(ia[r][h], w[h], xb);
          // keep the sums in registers (as kquant_wide.cpp's group: GCC would otherwise reassociate and spill)
          __asm__("" : "+v"(ia[r][h]));
        }
      }
    }
    const float* sa = p.sa.data() + u * kCols;
    const float* mn = p.mn.data() + u * kCols;
    for (int r = 0; r < R; ++r) {
      const FV d = V::fset(dx[(row0 + r) * nu + u]);
      for (int h = 0; h < H; ++h) {
        const FV t = V::mul(V::cvt(ia[r][h]), d);
        f[r][h] = V::fmadd(t, V::fload(sa + h * V::kL), f[r][h]);
        if constexpr (kCenter<F> < 0) {  // the offset term: M mn (dx sum x16)
          f[r][h] = V::fnmadd(V::fload(mn + h * V::kL), V::fset(xs[(row0 + r) * nu + u]), f[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) V::store(acc + r * kCols + h * V::kL, f[r][h]);
}

// Column blocks b0 .. b1 - 1 of m rows: each block's panel built once (build(blk, panel)), then every row against it.
template <class V, class F, class Build>
void blocks(const XQuant& xq, int64_t m, int64_t b0, int64_t b1, const Out& o, Build&& build_block) {
  constexpr int U = kUnit<F>, R = kTileRows;
  const int64_t k = xq.k;
  Panel p;
  p.q.resize(k / 2 * kCols);
  p.sa.resize(k / U * kCols);
  p.mn.resize(k / U * kCols);
  std::vector<float> acc(m * kCols);
  for (int64_t blk = b0; blk < b1; ++blk) {
    build_block(blk, p);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
      const int64_t u0 = k0 / U, u1 = std::min(k, k0 + kSlice) / U;
      int64_t r = 0;
      for (; r + R <= m; r += R) tile<V, F, R>(p, xq, r, u0, u1, acc.data() + r * kCols);
      if (m - r == 2) tile<V, F, 2>(p, xq, r, u0, u1, acc.data() + r * kCols);
      else if (m - r == 1) tile<V, F, 1>(p, xq, r, u0, u1, acc.data() + r * kCols);
    }
    for (int64_t r = 0; r < m; ++r) store_cols(o, r, blk * kCols, kCols, acc.data() + r * kCols);
  }
}

template <class V, class F>
void kquant_blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS;
  blocks<V, F>(xq, m, b0, b1, o, [&](int64_t blk, Panel& p) { build<F>(w + blk * sb * F::kBytes, sb, p); });
}

template <class V>
bool run(int64_t type, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  switch (type) {
    case kQ4_0: return kquant_blocks<V, FQ4_0>(xq, m, w, b0, b1, o), true;
    case kQ4_1: return kquant_blocks<V, FQ4_1>(xq, m, w, b0, b1, o), true;
    case kQ5_0: return kquant_blocks<V, FQ5_0>(xq, m, w, b0, b1, o), true;
    case kQ5_1: return kquant_blocks<V, FQ5_1>(xq, m, w, b0, b1, o), true;
    case kQ4_K: return kquant_blocks<V, FQ4_K>(xq, m, w, b0, b1, o), true;
    case kQ5_K: return kquant_blocks<V, FQ5_K>(xq, m, w, b0, b1, o), true;
    case kQ6_K: return kquant_blocks<V, FQ6_K>(xq, m, w, b0, b1, o), true;
    default: return false;
  }
}

template <class V>
void run_q8(const XQuant& xq, int64_t m, const uint8_t* w, const uint16_t* d, int64_t n, const Out& o) {
  const int64_t kb = xq.k / 32, blocks_n = (n + kCols - 1) / kCols;
  over_threads(blocks_n, [&](int64_t b0, int64_t b1) {
    blocks<V, FQ8>(xq, m, b0, b1, o, [&](int64_t blk, Panel& p) {
      build_q8(w + blk * kb * 512, d + blk * kb * kCols, kb, p);
    });
  });
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

}  // namespace

int64_t x16_rows() {
  static const int64_t rows = [] {
    const char* v = std::getenv("PAGEDSERVE_KQUANT_X16");
    if (v == nullptr || v[0] == '\0') return kX16Rows;
    const long long r = std::atoll(v);
    return r <= 0 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(r);
  }();
  return rows;
}

bool x16_panels(int64_t type, Isa isa, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1,
                const Out& o) {
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= kAvx2) return run<V256>(type, xq, m, w, b0, b1, o);  // AVX2 registers on any SIMD build (header)
#endif
  (void)type, (void)isa, (void)xq, (void)m, (void)w, (void)b0, (void)b1, (void)o;
  return false;
}

bool q8_x16_panels(Isa isa, const at::Tensor& x, const uint8_t* w, const uint16_t* d, int64_t n, const Out& o) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t m = x.size(0), k = x.size(1);
  if (k % 32 != 0 || isa < kAvx2) return false;
  XQuant xq = quantize_x(x, 32);
  widen(xq, m, true);
  return run_q8<V256>(xq, m, w, d, n, o), true;
#else
  (void)isa, (void)x, (void)w, (void)d, (void)n, (void)o;
  return false;
#endif
}

}  // namespace kquant
}  // namespace cpu
}  // namespace pagedserve
