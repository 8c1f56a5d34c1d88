// CPU linears over llama.cpp's GGML block formats (issue 53): out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W's rows in
// parts, each part in its own format (a Q4_K_M file's qkv: q and k Q4_K, v Q6_K).
//
// Every format is, per block of S weights along K (32, or a K-quant's 256), w = D * sc_j * q - M * mn_j with D, M
// float16 per block and column, small integer scales sc_j / offsets mn_j per sub-block j (K-quants only) and codes
// q of 4, 5 or 6 bits (engine/model_executor/layers/formats.py says which field is which). x is quantized per block
// of S to int8 in two parts, as q8_gemm's VNNI path does: xh = round(x / dx), dx = amax / 127 (llama.cpp's Q8_0 /
// Q8_K activations), and the residual xl = round(254 (x / dx - xh)) with scale dx / 254, so x is carried to 1 / 64516
// of its block's largest value (one part: 1 / 254, coarser than bfloat16's own rounding). A tile treats xl as rows
// of their own (row r of x is the tile's rows 2r, 2r + 1), so the weights are still read once. Per part and block
// the contribution is dx * (D * S1 - M * S2) with S1 = sum_j sc_j sum_k q xq and S2 = sum_j mn_j bsum_j (the sums of
// xq per 16 and 32), both exact in int32; a row's two parts are summed at the end. The integer dot products are
// u8 (q) x s8 (xq): vpdpbusd (AVX-512 VNNI), or vpmaddubsw then vpmaddwd with the sub-scale as the second
// operand (AVX2, AVX-512 without VNNI: the scale costs nothing there).
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
// Paths: the int8 tiles (8 of the tile's rows on AVX-512, i.e. 4 rows of x; 4 on AVX2; a tile streams its column
// block's weights once, prefetching 4 KiB ahead, taller batches re-read them from cache; the 32-weight formats' tile32
// joins the two parts in int32 and takes 8 rows of x on AVX-512 where K <= 2048) on VNNI; the wide tiles of
// kquant_wide.cpp (x's parts joined into one int16, x16 = 254 xh + xl, against the codes widened once a tile: 4 rows
// of x a tile on AVX2, 8 on AVX-512; one row of a 5- or 6-bit format on AVX2 multiplies the two int8 parts with
// vpmaddubsw instead, Bytes1) on AVX2 and AVX-512 without VNNI, and on VNNI for Q6_K from kWideRowsVnni rows; each
// part's column blocks split over the caller's OpenMP threads; from a row threshold (use_panels) the
// dequantized panels of kquant_panel.cpp: float32 or bfloat16 W^T panels into torch's GEMM, the dequantized model's
// own products; and on AVX2 from x16_rows() rows instead the x16 panels of kquant_x16.cpp (the wide tiles' products,
// a column block's codes widened once for all rows: 1.5-1.7x the float32 panels at 128 rows on a Zen 5). From
// kX32Rows rows (a prefill) x is scaled per 32 for the K-quants too (X32 tiles), not per 256.
//
// Measured on a Zen 5 (2 vCPUs, AVX-512 VNNI + BF16, one thread, [2048, 8192], 2026-11-29): tile32 8 rows Q5_0
// 0.96 -> 0.84 ms, Q4_0 0.87 -> 0.74; a decode step of SmolLM2's Q4_K_M (mostly Q5_0) at 8 sequences, bfloat16,
// with quantize_row's amax vectorized (vec::abs_max): 8.7 -> 7.8 ms. X32 against x per 256 (float32 x): Q4_K 16 rows
// 1.34 -> 1.52 ms, 64 rows 5.6 -> 6.5; Q6_K 1.74 -> 1.87, 7.9 -> 8.0; what it buys: SmolLM2's Q4_K_M, float32,
// greedy tokens 89.5 % -> 100 % of its dequantized self's (one near-tie of 0.002 in log-probability flipped by the
// prompts' prefill through the per-256 tiles; quant_quality.py).
//
// Measured on the 2-vCPU Xeon @ 2.50GHz (Cascade Lake: AVX-512 VNNI, no BF16/AMX), one thread's CPU time, a
// [2048, 8192] weight, while the machine's other 5 jobs ran (load ~11 on 2 cores: absolute figures are 1.5-2x a
// quiet machine's, where 1 row of Q4_K took 0.81 ms and 8 rows 1.56 ms with one part), same conditions before/after:
//   x in two parts, decode (before -> after): VNNI Q4_K 1 row 1.34 -> 1.41 ms, 8 rows 2.51 -> 3.06; Q4_1 1.41 ->
//   1.54, 8 rows 1.97 -> 5.11; Q6_K 1.62 -> 1.82, 8 rows 2.88 -> 5.79. One row stays bound by reading the weights
//   (+5-13 %); 8 rows are compute-bound and pay for twice the dot products (1.2-2.6x). AVX2 build (after): Q4_K 1
//   row 1.98 ms, 8 rows 12.4 ms; Q4_1 2.12 / 16.3; Q6_K 2.71 / 15.0.
//   What it buys: SmolLM2-135M's Q4_1 file natively against itself dequantized to float32 (benchmarks/quant_quality
//   .py): greedy tokens 59 % -> 100 % equal, same top-1 100 %, ln(PPL ratio) 4e-6.
//   Tiles against panels against the float32 linear (ms; rows 16 / 64 / 128 / 512), VNNI: Q4_K tiles 8.6 / 36 / 70 /
//   252, panels 44 / 67 / 77 / 313, float 30 / 49 / 57 / 196; Q6_K tiles 11 / 44 / 88 / 373, panels 46 / 68 / 76 /
//   260; Q4_0 tiles 9.9 / 37 / 78 / 390, panels 42 / 47 / 101 / 294. AVX2 (16 / 64 / 128): Q4_K tiles 15 / 63 / 129,
//   panels 31 / 47 / 71, float 25 / 38 / 56; Q6_K 18 / 121 / 152 vs 37 / 46 / 96; Q4_0 19 / 78 / 163 vs 29 / 60 /
//   69; Q5_1 19 / 82 / 170 vs 30 / 45 / 68. So panels from 128 rows on VNNI then (the tiles' 4x int8 rate keeps
//   them ahead below; at 512 rows the panels won 1.3-1.4x but for Q4_K; float32 panels on VNNI now: use_panels),
//   from kPanelRowsWiden = 32 rows on AVX2 / AVX-512 without VNNI (the tiles cost ~1 ms a row there, the panels
//   ~27 ms + 0.35 ms a row).
//   The wide tiles (issue 53's 8-row decode; same machine, one thread, min of 2 runs at load ~2-5, ms for the
//   [2048, 8192] / [8192, 2048] weight, int8 tiles (the kernel before) -> wide): AVX2 build, 8 rows Q4_K 7.2 / 7.1 ->
//   4.8 / 4.9, Q6_K 8.4 / 8.5 -> 6.0 / 6.2, Q4_0 8.7 / 8.9 -> 6.1 / 5.7; 16 rows Q4_K 14.3 -> 10.2, 1 row 1.0 -> 1.0
//   (x16 halves the vpmaddwd work of two int8 parts; at 32 rows the wide tiles and the panels are even, so the
//   threshold stays). VNNI (vpdpwssd against 2x vpdpbusd + vpmulld for the sub-scales), 3 interleaved runs: Q6_K
//   8 rows 3.5 / 3.2-3.5 -> 3.2-3.3 / 2.9-3.1, 16 rows 6.7 / 6.4-8.5 -> 6.3-6.4 / 5.8-6.2 (its two sub-scales a
//   chunk cost the int8 tile two vpmulld); Q4_K, Q4_0 even or worse (8 rows Q4_K 2.6 / 2.4 -> 2.6 / 2.7), and below
//   8 rows the int8 tiles stay ahead (1-2 rows 0.6 -> 0.9 ms: a tile of 1-2 rows waits on vpdpwssd's latency).
//   bfloat16 panels (AMD EPYC Zen 5, 2 vCPUs, AVX-512 VNNI + BF16, one thread, bfloat16 x and out, 2026-11-28, ms
//   [2048, 8192] / [8192, 2048]), once written as bfloat16 in whole lines (kquant_panel.cpp): tiles / panels at 32
//   rows Q4_K 3.1 / 4.0, Q6_K 3.9 / 3.8, Q4_0 3.4 / 3.8; 64 rows Q4_K 6.2 / 5.8, Q6_K 8.4 / 5.8, Q4_0 7.4 / 5.7 (and
//   [8192, 2048] alike); 128 rows Q4_K 12.8 / 11.0: so kPanelRowsBf16 = 64. The same rewrite took the AVX2 build's
//   float32 panels of a [8192, 2048] Q4_K from 17.5 to 7.6 ms at 16 rows and 52.1 to 40.6 at 128 (same Zen 5).
#include "kquant_blocks.h"

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace kquant {

namespace {

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
    const float amax = vec::abs_max(x + b * s, s);
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

}  // namespace

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

// The wide tiles' x (kquant_wide.cpp): x16 = 254 xh + xl per row, k in the order x0 x2 x1 x3 per 4 (vpmaddwd's
// pairs against the codes of k 0, 2 and of k 1, 3).
void widen(XQuant& xq, int64_t m, bool sums) {
  const int64_t k = xq.k;
  xq.q16.resize(m * k);
  for (int64_t r = 0; r < m; ++r) {
    const int8_t* qh = xq.row(kParts * r);
    const int8_t* ql = xq.row(kParts * r + 1);
    int16_t* x16 = xq.q16.data() + r * k;
    for (int64_t i = 0; i < k; ++i)
      x16[(i & ~int64_t{3}) + ((i & 1) << 1) + ((i >> 1) & 1)] = static_cast<int16_t>(254 * qh[i] + ql[i]);
  }
  if (sums) unit_scales(xq, m);
}

// Per row and unit of 16 / 32 k, the joined parts' scale (the xl row's d) and scaled sum (sum x16 = 254 sum xh + sum
// xl): the epilogues of the x16 panels, the X32 tiles and tile32.
void unit_scales(XQuant& xq, int64_t m, bool sixteens) {
  const int64_t k = xq.k, ns = k / xq.s;
  for (int u : {16, 32}) {
    if (u == 16 && !sixteens) continue;
    const int64_t nu = k / u;
    std::vector<float>& dx = u == 16 ? xq.dx16 : xq.dx32;
    std::vector<float>& xs = u == 16 ? xq.xs16 : xq.xs32;
    const std::vector<int16_t>& sums = u == 16 ? xq.s16 : xq.s32;
    dx.resize(m * nu);
    xs.resize(m * nu);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < nu; ++j) {
        const float d = xq.d[(kParts * r + 1) * ns + j * u / xq.s];
        dx[r * nu + j] = d;
        xs[r * nu + j] = d * static_cast<float>(254 * sums[kParts * r * nu + j] + sums[(kParts * r + 1) * nu + j]);
      }
  }
}

}  // namespace kquant

namespace {

using namespace kquant;

constexpr int64_t kMagic = 0x4B51504B;
constexpr int64_t kRows = 4;      // rows of x per tile (AVX2: 16 ymm)
constexpr int64_t kRowsWide = 8;  // rows of x per tile (AVX-512: 32 zmm)
constexpr int64_t kPanelRowsBf16 = 64;   // rows from which the bfloat16 panels serve (AVX-512 BF16; header)
constexpr int64_t kPanelRowsWiden = 32;  // the float32 panels' where the wide tiles serve (AVX2, AVX-512 w/o VNNI)
constexpr int64_t kWideRowsVnni = 8;     // rows from which VNNI takes the wide tiles for Q6_K (vpdpwssd)
constexpr int64_t kX32Rows = 16;  // rows from which x is scaled per 32 for every format (K-quants: X32 tiles)
// Up to this K a 32-weight format's AVX-512 tile takes 8 rows of x (16 expanded: the codes unpacked once for 8
// rows, not twice); beyond, its 16 rows of x no longer stay in L1 (Zen 5, one thread, 8 rows, us: Q5_0 [1536, 576]
// 58 -> 54, [8192, 2048] 842 -> 793, Q4_0 alike; [2048, 8192] 867 -> 1217).
constexpr int64_t kTile32RowsMaxK = 2048;

Isa best_isa() {
#if defined(__AVX512F__)
  return cpu_has_vnni() ? kVnni : kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kPlain;
#endif
}

// The plain C++ path: per 32-k chunk its integer sums S1 (sub-scaled) and S2 (offsets), scaled by the chunk's dx (x
// per 32 or per F::kS, xq.s).
template <class F>
void plain_blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS, n32 = xq.k / 32, n16 = xq.k / 16, nd = xq.k / xq.s;
  float acc[kCols];
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t r = 0; r < kParts * m; ++r) {  // expanded rows: xh, then xl of the same row
      if (r % kParts == 0) std::fill(acc, acc + kCols, 0.0f);
      const int8_t* xr = xq.row(r);
      for (int64_t s = 0; s < sb; ++s) {
        const uint8_t* b = w + (blk * sb + s) * F::kBytes;
        for (int c = 0; c < kCols; ++c) {
          const float dd = half_at(b + F::kOffD, c);
          const float mm = F::kStoresM ? half_at(b + F::kOffM, c) : dd * static_cast<float>(F::kMMul);
          for (int j32 = 0; j32 < F::kJ32; ++j32) {
            int32_t part[2] = {0, 0};  // groups 0-3 and 4-7 (Q6_K's two sub-blocks of 16)
            const int8_t* xc = xr + s * F::kS + j32 * 32;
            for (int g = 0; g < 8; ++g)
              for (int i = 0; i < 4; ++i) part[g >> 2] += code<F>(b, j32, g, c, i) * xc[4 * g + i];
            int32_t s1 = 0, s2 = 0;
            const int64_t u = s * F::kJ32 + j32;  // the chunk's 32-k unit
            if constexpr (F::kSub == 0) {
              s1 = part[0] + part[1];
              s2 = xq.s32[r * n32 + u];
            } else if constexpr (F::kSub == 32) {
              s1 = pair_at(b + F::kOffSc, j32, c) * (part[0] + part[1]);
              s2 = pair_at(b + (F::kOwnMins ? F::kOffMn : F::kOffSc), j32, c) * xq.s32[r * n32 + u];
            } else {
              s1 = pair_at(b + F::kOffSc, 2 * j32, c) * part[0] + pair_at(b + F::kOffSc, 2 * j32 + 1, c) * part[1];
              s2 = pair_at(b + F::kOffSc, 2 * j32, c) * xq.s16[r * n16 + 2 * u] +
                   pair_at(b + F::kOffSc, 2 * j32 + 1, c) * xq.s16[r * n16 + 2 * u + 1];
            }
            const float dx = xq.d[r * nd + u * 32 / xq.s];
            acc[c] = std::fma(std::fma(dd, static_cast<float>(s1), -mm * static_cast<float>(s2)), dx, acc[c]);
          }
        }
      }
      if (r % kParts == kParts - 1) store_cols(o, r / kParts, blk * kCols, kCols, acc);
    }
  }
}

// ------------------------------------------------------------------ SIMD tiles (AVX2, AVX-512, AVX-512 VNNI)

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

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

// R expanded rows (R / 2 rows of x, each its xh and xl) of one 16-column block of a K-quant over all of K: H halves
// of V::kL columns; a row's two parts are summed at the end. X32: x scaled per 32 (a prefill's rows, kX32Rows), a
// chunk's integer sum converted and scaled on its own and the offsets summed per sub-block in float, once a row of x
// (unit_scales' xs16 / xs32); else x per block of F::kS, the block's sums exact in int32.
template <class V, class F, int R, bool X32>
void tile(const XQuant& xq, int64_t row0, const uint8_t* w, int64_t sb, const Out& o, int64_t col0) {
  static_assert(F::kSub != 0, "the 32-weight formats take tile32");
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
      FV f1[R];  // X32: S1 in float, each chunk at its own scale
      for (int r = 0; r < R; ++r) s1[r] = V::zero(), f1[r] = V::fzero();
      for (int j32 = 0; j32 < F::kJ32; ++j32) {
        I ia[R], ib[R];
        for (int r = 0; r < R; ++r) ia[r] = ib[r] = V::zero();
        I sca = V::set16(1), scb = sca;
        const I p = V::pairs(b + F::kOffSc + (F::kSub == 32 ? j32 / 2 : j32) * 32 + lane0 * 2);
        // even / odd sub-scale of each lane, as int32 (VNNI) or duplicated int16 (vpmaddwd)
        I even = V::sra16of32(V::template shl32<16>(p)), odd = V::sra16of32(p);
        if constexpr (!V::kVnni) {
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
          I t;  // this chunk's sub-scaled integer sum
          if constexpr (!V::kVnni) t = ia[r];
          else if constexpr (F::kSub == 32) t = V::mullo(V::add(ia[r], ib[r]), (j32 & 1) ? odd : even);
          else t = V::add(V::mullo(ia[r], even), V::mullo(ib[r], odd));
          if constexpr (X32) f1[r] = V::fmadd(V::cvt(t), V::fset(xq.d[(row0 + r) * n32 + s * F::kJ32 + j32]), f1[r]);
          else s1[r] = V::add(s1[r], t);
        }
      }
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      FV mm;
      if constexpr (F::kStoresM) mm = V::halfs(b + F::kOffM + lane0 * 2);
      else mm = V::mul(dd, V::fset(static_cast<float>(F::kMMul)));
      if constexpr (X32) {  // acc += dd S1 (both parts), and for a row of x once - mm sum_j mn_j xs_j
        FV off[R / kParts];
        x32_offsets<V, F, R / kParts>(b, lane0, xq, row0 / kParts, s, off);
        for (int r = 0; r < R; ++r) {
          acc[h][r] = V::fmadd(dd, f1[r], acc[h][r]);
          if (r % kParts == 0) acc[h][r] = V::fnmadd(mm, off[r / kParts], acc[h][r]);
        }
        continue;
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        const int16_t* bs = F::kSub == 32 ? xq.s32.data() + row * n32 : xq.s16.data() + row * n16;
        I s2 = V::zero();
        for (int p2 = 0; p2 < F::kSubs / 2; ++p2) {
          const uint8_t* mp = b + (F::kOwnMins ? F::kOffMn : F::kOffSc) + p2 * 32 + lane0 * 2;
          s2 = V::add(s2, V::madd(V::pairs(mp), V::set32(pair16(bs + s * F::kSubs + 2 * p2))));
        }
        const FV off = V::mul(mm, V::cvt(s2));
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

// The 32-weight formats (no sub-scales): R expanded rows of one 16-column block over all of K, a block's dot products
// straight into S1 and its two parts joined in int32 before the float epilogue (S = 254 S1h + S1l, exact: |S1h| <=
// 32 * 31 * 127), one epilogue a row of x and block: out += dd dl S - mm dl (254 s32h + s32l) (unit_scales' dx32 and
// xs32), where tile() pays two, each with its own offset term.
template <class V, class F, int R>
void tile32(const XQuant& xq, int64_t row0, const uint8_t* w, int64_t sb, const Out& o, int64_t col0) {
  using I = typename V::I;
  using FV = typename V::F;
  constexpr int H = kCols / V::kL, X = R / kParts;
  FV acc[H][X];
  for (int h = 0; h < H; ++h)
    for (int x = 0; x < X; ++x) acc[h][x] = V::fzero();
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xq.row(row0 + r);
  const int64_t n32 = xq.k / 32, x0 = row0 / kParts;
  const I k254 = V::set32(254), one = V::set16(1);
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = w + s * F::kBytes;
    for (int line = 0; line < kChunkBytes<F>; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchBytes + line), _MM_HINT_T0);
    for (int h = 0; h < H; ++h) {
      const int lane0 = h * V::kL;
      I s1[R];
      for (int r = 0; r < R; ++r) s1[r] = V::zero();
      chunk_groups<V, F, R, 0>(b, 0, lane0, xr, s * 32, s1, s1, one, one);
      chunk_groups<V, F, R, 1>(b, 0, lane0, xr, s * 32, s1, s1, one, one);
      chunk_groups<V, F, R, 2>(b, 0, lane0, xr, s * 32, s1, s1, one, one);
      chunk_groups<V, F, R, 3>(b, 0, lane0, xr, s * 32, s1, s1, one, one);
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      FV mm;
      if constexpr (F::kStoresM) mm = V::halfs(b + F::kOffM + lane0 * 2);
      else mm = V::mul(dd, V::fset(static_cast<float>(F::kMMul)));
      for (int x = 0; x < X; ++x) {
        const int64_t u = (x0 + x) * n32 + s;
        const I joined = V::add(V::mullo(s1[kParts * x], k254), s1[kParts * x + 1]);
        acc[h][x] = V::fmadd(V::mul(dd, V::fset(xq.dx32[u])), V::cvt(joined), acc[h][x]);
        acc[h][x] = V::fnmadd(mm, V::fset(xq.xs32[u]), acc[h][x]);
      }
    }
  }
  alignas(64) float buf[kCols];
  for (int x = 0; x < X; ++x) {
    for (int h = 0; h < H; ++h) V::store(buf + h * V::kL, acc[h][x]);
    store_cols(o, x0 + x, col0, kCols, buf);
  }
}

// R expanded rows of one column block: tile32 for the 32-weight formats, tile for the K-quants (X32 where x is
// scaled per 32).
template <class V, class F, int R>
void any_tile(const XQuant& xq, int64_t row0, const uint8_t* w, int64_t sb, const Out& o, int64_t col0) {
  if constexpr (F::kSub == 0) tile32<V, F, R>(xq, row0, w, sb, o, col0);
  else if (xq.s < F::kS) tile<V, F, R, true>(xq, row0, w, sb, o, col0);
  else tile<V, F, R, false>(xq, row0, w, sb, o, col0);
}

template <class V, class F>
void simd_blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS, e = kParts * m;  // expanded rows, an even count
  constexpr int64_t rows = V::kL == 16 ? kRowsWide : kRows;
  constexpr bool rows16 = F::kSub == 0 && V::kL == 16;  // tile32 takes 8 rows of x at once where K is short
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* wb = w + blk * sb * F::kBytes;
    for (int64_t r = 0, step; r < e; r += step) {
      step = rows16 && e - r >= 16 && xq.k <= kTile32RowsMaxK ? 16 : std::min<int64_t>(rows, e - r);
      switch (step) {
        case 2: any_tile<V, F, 2>(xq, r, wb, sb, o, blk * kCols); break;
        case 4: any_tile<V, F, 4>(xq, r, wb, sb, o, blk * kCols); break;
        case 6: any_tile<V, F, rows < 6 ? 4 : 6>(xq, r, wb, sb, o, blk * kCols); break;
        case 16: any_tile<V, F, rows16 ? 16 : rows>(xq, r, wb, sb, o, blk * kCols); break;
        default: any_tile<V, F, rows < 8 ? 4 : 8>(xq, r, wb, sb, o, blk * kCols); break;
      }
    }
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

// ------------------------------------------------------------------ driver

template <class F>
void run_format(int64_t type, Isa isa, bool wide, bool x16, const XQuant& xq, int64_t m, const uint8_t* w,
                int64_t blocks, const Out& o) {
  over_threads(blocks, [&](int64_t b0, int64_t b1) {
    if (x16 && x16_panels(type, isa, xq, m, w, b0, b1, o)) return;
    if (wide && wide_tiles(type, isa, xq, m, w, b0, b1, o)) return;
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

// Whether m rows go through the panels (kPanel) rather than the int8 tiles (the header's measurements: one threshold
// serves every format; bfloat16 panels, half the bytes to write and AVX-512 BF16's GEMM, from fewer rows). On VNNI
// never float32 panels, as q8_gemm: the tiles were 3.4x faster at 128 to 512 rows on a Zen 5 (one thread, float32
// x, [2048, 8192] Q4_K 128 rows 11.2 / 38.4 ms, 512 rows 44.6 / 153; torch's float32 GEMM there runs MKL's AVX2
// kernel, 117 GFLOP/s a core). PAGEDSERVE_KQUANT_PANEL_ROWS=R moves it to R rows (0: never), for measuring.
bool use_panels(int64_t m, Isa isa, bool bf16_panels) {
  static const int64_t forced = [] {
    const char* v = std::getenv("PAGEDSERVE_KQUANT_PANEL_ROWS");
    if (v == nullptr || v[0] == '\0') return int64_t{-1};
    const long long r = std::atoll(v);
    return r <= 0 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(r);
  }();
  if (forced >= 0) return m >= forced;
  if (bf16_panels) return m >= kPanelRowsBf16;
  return isa != kVnni && m >= kPanelRowsWiden;
}

// Whether m rows of `type` take the wide tiles (kquant_wide.cpp) rather than the int8 ones: always on AVX2 / AVX-512
// without VNNI, on VNNI Q6_K from kWideRowsVnni rows (the header's measurements). PAGEDSERVE_KQUANT_WIDE=1 / 0 takes
// them on every SIMD path / none, for measuring.
bool use_wide(Isa isa, int64_t m, int64_t type) {
  static const int forced = [] {
    const char* v = std::getenv("PAGEDSERVE_KQUANT_WIDE");
    return v == nullptr || v[0] == '\0' ? -1 : std::atoi(v) != 0;
  }();
  if (isa == kPlain) return false;
  if (forced >= 0) return forced == 1;
  return isa != kVnni || (type == kQ6_K && m >= kWideRowsVnni);
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
  const bool forced_panel = isa == kPanel, forced_x16 = isa == kX16;
  const Isa use = isa == kAuto || forced_panel || forced_x16 ? best : static_cast<Isa>(isa);
  TORCH_CHECK(use == kPlain || ((use == kAvx2 || use == kAvx512 || use == kVnni) && use <= best),
              "kquant_gemm: ISA path ", isa, " is not in this build or on this CPU (best ", best, ")");
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "kquant_gemm: bias has ", bias->numel(), " elements, N is ", n);
    bias_f32 = bias->detach().to(at::kFloat).contiguous();  // an inference op (a Parameter may require grad)
  }
  if (m == 0) return;
  const bool bf16_panels = panel_dtype(x, out) == at::kBFloat16;
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
    const bool x16 = forced_x16 || (isa == kAuto && use == kAvx2 && m >= x16_rows());
    if (forced_panel || (isa == kAuto && !x16 && use_panels(m, use, bf16_panels))) {
      const at::Tensor b = bias_f32.defined() ? bias_f32.narrow(0, col, rows) : at::Tensor();
      panels(type, use, o_part, x, w, rows, b);
      col += rows;
      continue;
    }
    const bool wide = use_wide(use, m, type);
    // x per 32 for every format from kX32Rows rows (and on the x16 panels, which scale each 32-k unit apart anyway):
    // a K-quant's 256-wide block of x carries its largest value's scale over 255 others, which a prefill's keys and
    // values keep (SmolLM2's Q4_K_M, float32: greedy tokens 89.5 % of its dequantized self's on VNNI, 100 % per 32)
    XQuant& xq = s == 32 || x16 || m >= kX32Rows ? x32 : x256;
    if (xq.k == 0) {
      xq = quantize_x(x, &xq == &x32 ? 32 : s);
      // the per-32 epilogues' scales and offsets; per 16 only where a K-quant takes them (a decode step of the
      // 32-weight formats needs the 32s alone)
      if (&xq == &x32) unit_scales(xq, m, x16 || m >= kX32Rows);
    }
    // parts of one x may take either tiles (a Q4_K_M qkv's v: Q6_K); x16 holds for every part of a call (m decides)
    if ((wide || x16) && xq.q16.empty()) widen(xq, m, false);
    const bool f32 = out.scalar_type() == at::kFloat;
    const Out o{f32 ? o_part.data_ptr<float>() : nullptr, f32 ? nullptr : o_part.data_ptr<c10::BFloat16>(),
                out.stride(0), bias_f32.defined() ? bias_f32.data_ptr<float>() + col : nullptr, rows};
    const int64_t blocks = (rows + kCols - 1) / kCols;
    switch (type) {
      case kQ4_0: run_format<FQ4_0>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ4_1: run_format<FQ4_1>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ5_0: run_format<FQ5_0>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ5_1: run_format<FQ5_1>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ4_K: run_format<FQ4_K>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ5_K: run_format<FQ5_K>(type, use, wide, x16, xq, m, w, blocks, o); break;
      case kQ6_K: run_format<FQ6_K>(type, use, wide, x16, xq, m, w, blocks, o); break;
      default: TORCH_CHECK(false, "kquant_gemm: GGML type ", type, " has no kernel");
    }
    col += rows;
  }
}

}  // namespace cpu
}  // namespace pagedserve
