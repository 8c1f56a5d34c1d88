// Small-row GEMM for CPU decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), M from 1 to ~16.
//
// Why: at a few rows a linear is a matrix-vector product, bound by reading W once. oneDNN's packed GEMM is
// built for many rows and streamed SmolLM2's weights at ~13 GB/s at one row on a VM that copies ~33 GB/s
// (issue 16). Here W is repacked once at load (engine/model_executor/layers/cpu_linear.py) so that each thread reads one
// contiguous range of it, front to back, and each weight vector loaded feeds every row of x:
//
//   float32:  [N/16][K][16]           16 output columns of one k side by side
//   bfloat16: [N/16][K/2][16][2]      16 columns, each with a (k, k+1) pair: vdpbf16ps' operand layout
//
// N is padded to a multiple of 16 and K (bfloat16) to a multiple of 2 with zeros. Accumulation is float32;
// a bfloat16 output is rounded once (round to nearest even), as F.linear does; a float32 output of a bfloat16
// GEMM holds that rounded value widened (a head's logits: F.linear(...).float() without the bfloat16 copy).
//
// small_gemm_glu fuses a gated MLP's first linear with its activation: W is [gate; up] (2N rows), and each tile
// holds gate blocks and the up blocks of the same columns side by side, so its epilogue writes silu(gate) * up
// (csrc/cpu/activation.cpp's arithmetic) and the [M, 2N] gate/up buffer is never written or read again. A
// SmolLM2 prefill step of 2048 tokens took 1179 -> 1135 ms (bfloat16) and 2197 -> 2143 ms (float32), a decode
// step at 32 streams 64.2 -> 62.5 ms (float32) and ~1 % less (bfloat16), in-process A/Bs on a Zen 4.
//
// small_gemm_argmax_lse is a greedy head without its logits: the outputs are written a cache-sized panel of columns
// at a time into a per-thread buffer and reduced there to each row's argmax, max and sum of exp (run_head). At 256
// decode rows of a 49,152 vocabulary the [rows, vocab] float32 logits are 50 MB written to memory and read back by
// argmax_logsumexp: a tiny model's (hidden 64) float32 step, 2 vCPU Xeon, took 34.4 -> 24.1 ms (in-process A/B on a
// loaded machine; benchmarks/profile_step.py's not-the-model share in docs/benchmarks.md).
//
// Paths, picked at run time from what the build targets (engine/ops/build.py), or forced by `isa` (tests
// run the AVX2 path on an AVX-512 machine): AVX-512 BF16 (vdpbf16ps), AVX-512F, AVX2+FMA. Without
// vdpbf16ps a bfloat16 pair is widened by two integer ops: (pair << 16) is the even k, (pair & 0xffff0000)
// the odd one.
//
// Threads: the 16-column blocks are shared over the caller's OpenMP threads (N is the only parallel axis at a few
// rows): up to kSmallRows rows in pieces each thread takes as it finishes one, above that one contiguous range a
// thread (over_threads); tiny layers run on the calling thread.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "../ops.h"
#include "row_stats.h"
#include "simd.h"

namespace pagedserve {
namespace cpu {

namespace {

constexpr int64_t kBlock = 16;        // output columns per packed block
// Up to kSmallRows rows the tiles are at most 4 rows by 4 blocks: one pass, each weight vector loaded feeds every
// row, and the weights are streamed once. Above it the GEMM turns compute-bound and the tiles are taller (8 rows,
// 2-3 blocks: 16-24 accumulators), which keeps both FMA ports busy instead of waiting on the loads. The 4-row tiles
// at 5 to 16 rows (a decode batch, a split decode's shard) made 2-4 passes, re-widened every bfloat16 weight on
// each, and ran ~1.4x slower than the tall ones (benchmarks/small_gemm.py, docs/benchmarks.md "Decode at 32
// streams"): at 1 to 4 rows both shapes stream the weights at the same rate.
constexpr int64_t kSmallRows = 4;
// Rows of x per sweep over the weights in a long prefill: 128 rows of K = 1536 are 768 KiB of float32 x, and each
// weight byte read from memory then feeds 64 FLOP (float32) or more.
constexpr int64_t kRowChunk = 128;
constexpr int64_t kMinBlocksPerThread = 8;       // below this a second thread costs more than it saves (decode)
constexpr int64_t kMinBlocksPerThreadWide = 2;   // the same with more than kSmallRows rows of work per block
// Pieces per thread of a small-row GEMM's blocks, handed out as threads finish them (over_threads): static
// halves had a thread that started late hold the region's closing barrier; pieces took the median 30-layer float32
// sweep (two runs at 1 row, one at 4) from 21.3 / 20.9 / 23.5 to 20.4 / 19.5 / 21.0 ms, in-process A/B on a Zen 4
// (best times equal; bfloat16 at 1 row 9.69 -> 9.58 ms).
constexpr int64_t kPiecesPerThread = 8;
// Cache lines (one per k or k pair of a block) prefetched ahead of the loads: the hardware prefetcher alone
// kept too few lines in flight over a few interleaved streams (measured: benchmarks/small_gemm.py). Prefetches
// past a block's end touch the next block, which is read next anyway (or a harmless line past the weight).
constexpr int64_t kPrefetchAhead = 16;

// The prefetch of a tile's weight stream. At up to kSmallRows rows each weight line is read once, by one load, and
// is prefetched into L2 only (T2): into L1 (T0) it took ~4 % more of a one-stream decode step (in-process A/B on a
// Zen 4, alternating 8-step chunks: bfloat16 11.8 -> 11.4 ms, float32 21.1 -> 20.1 ms; the AVX2 paths 2-3 %).
// The taller tiles read each weight line again on every 8-row pass: into L1.
template <int R>
inline void prefetch_weights(const void* line) {
  if constexpr (R <= kSmallRows) {
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T2);
  } else {
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T0);
  }
}

enum Isa : int64_t { kAuto = 0, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };

Isa best_isa() {
#if defined(__AVX512BF16__)
  return kAvx512Bf16;
#elif defined(__AVX512F__)
  return kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kAuto;  // none: small_gemm_isa() reports 0 and engine/model_executor/layers/cpu_linear.py keeps oneDNN
#endif
}

// The path a call runs: `isa` (kAuto: the best) if it is one of the codes above and this build has it. Checked
// first, before any tensor is read or a path or tile table is picked: every other value, a code past the best,
// between the codes or negative, is refused here, on every CPU.
Isa checked_isa(int64_t isa, const char* name) {
  const Isa best = best_isa();
  const bool known = isa == kAuto || isa == kAvx2 || isa == kAvx512 || isa == kAvx512Bf16;
  TORCH_CHECK(known && best != kAuto && isa <= best, name, ": ISA path ", isa, " is not in this build (its best is ",
              static_cast<int64_t>(best), "; 0 picks it)");
  return isa == kAuto ? best : static_cast<Isa>(isa);
}

// Wraps the tile function template FN<R, B> in a struct NAME whose run<R, B> the kernel tables point to.
#define PAGEDSERVE_TILE(NAME, FN)                                                                     \
  struct NAME {                                                                                       \
    template <int R, int B, typename... A>                                                            \
    static void run(A... a) { FN<R, B>(a...); }                                                       \
  };

// A tile's accumulators, [rows][blocks * 16] floats, handed to the epilogue.
struct TileOut {
  float* out_f32;          // output row 0 (float32 output) or nullptr
  c10::BFloat16* out_bf16; // output row 0 (bfloat16 output) or nullptr
  bool widen;              // float32 output of a bfloat16 GEMM: each value rounded to bfloat16 (F.linear(...).float())
  int64_t out_stride;      // elements between output rows
  const float* bias;       // [N] float32 or nullptr (a gated MLP's: [2 * n], gate | up)
  int64_t n;               // valid output columns
  // 0: the tile's B blocks are B output blocks. A gated MLP's fused tile (small_gemm_glu): its first B/2 blocks are
  // gate columns and the last B/2 the up columns of the same outputs, this many weight elements further on; the
  // output is silu(gate) * up.
  int64_t up_offset;
};

// The first weight element of each of a tile's B blocks: block b at w + b * stride, or (o.up_offset) the gate
// blocks b < B/2 from w and their up blocks o.up_offset further on.
template <int B, typename W>
inline void block_starts(const W* w, int64_t stride, int64_t up_offset, const W* (&starts)[B]) {
  constexpr int kHalf = B > 1 ? B / 2 : 1;
  for (int b = 0; b < B; ++b)
    starts[b] = up_offset == 0 ? w + b * stride : w + (b % kHalf) * stride + (b / kHalf) * up_offset;
}

inline void store_row_scalar(const TileOut& o, int64_t row, int64_t col0, const float* acc, int64_t count) {
  const int64_t valid = std::min(count, o.n - col0);
  for (int64_t j = 0; j < valid; ++j) {
    const float v = acc[j] + (o.bias ? o.bias[col0 + j] : 0.0f);
    if (o.out_f32) {
      o.out_f32[row * o.out_stride + col0 + j] = o.widen ? static_cast<float>(c10::BFloat16(v)) : v;
    } else {
      o.out_bf16[row * o.out_stride + col0 + j] = c10::BFloat16(v);  // round to nearest even
    }
  }
}

// One row of a tile's block (acc: 16 floats) into the output, plus the bias, rounded to bfloat16 where the output
// is. A whole block goes in vector stores, the same values as the scalar loop (bfloat16 rounded to nearest even as
// c10::BFloat16 does, NaN as 0x7fc0): the scalar loop held the bfloat16 prefill tiles 13 % back (docs/benchmarks.md,
// "Time to first token").
inline void store_row(const TileOut& o, int64_t row, int64_t col0, const float* acc, int64_t count) {
#if defined(__AVX512F__)
  if (count == kBlock && col0 + kBlock <= o.n) {
    __m512 v = _mm512_loadu_ps(acc);  // the AVX2 tiles (in this build too) align their buffer to 32 only
    v = _mm512_add_ps(v, o.bias ? _mm512_loadu_ps(o.bias + col0) : _mm512_setzero_ps());
    if (o.out_f32 && !o.widen) {
      _mm512_storeu_ps(o.out_f32 + row * o.out_stride + col0, v);
      return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    if (o.out_f32) {  // widened back: the bfloat16 bits in the top half
      _mm512_storeu_ps(o.out_f32 + row * o.out_stride + col0, _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16)));
      return;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.out_bf16 + row * o.out_stride + col0),
                        _mm512_cvtepi32_epi16(rounded));
    return;
  }
#elif defined(__AVX2__)
  if (count == kBlock && col0 + kBlock <= o.n && o.out_f32) {
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_loadu_ps(acc + 8 * h);
      v = _mm256_add_ps(v, o.bias ? _mm256_loadu_ps(o.bias + col0 + 8 * h) : _mm256_setzero_ps());
      if (o.widen) {  // rounded to bfloat16 as above, NaN as 0x7fc0
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_and_si256(
            _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
            _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
        v = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      _mm256_storeu_ps(o.out_f32 + row * o.out_stride + col0 + 8 * h, v);
    }
    return;
  }
#endif
  store_row_scalar(o, row, col0, acc, count);
}

// One row of a fused gated-MLP tile into the output: silu(gate + bias) * (up + bias) over a block of 16 columns, each
// linear's output rounded to bfloat16 first where the output is bfloat16, then simd::silu_mul as
// csrc/cpu/activation.cpp computes it: the same bits as small_gemm into [gate | up], then silu_and_mul.
inline void store_glu_row(const TileOut& o, int64_t row, int64_t col0, const float* gate, const float* up) {
  constexpr int N = simd::kNative;
  for (int i = 0; i < kBlock; i += N) {
    simd::Vec<N> g = simd::load<N>(gate + i), u = simd::load<N>(up + i);
    if (o.bias) {
      g = g + simd::load<N>(o.bias + col0 + i);
      u = u + simd::load<N>(o.bias + o.n + col0 + i);
    }
    if (o.out_f32) {
      simd::store<N>(o.out_f32 + row * o.out_stride + col0 + i, simd::silu_mul<N, false>(g, u));
    } else {
      const simd::Vec<N> act = simd::silu_mul<N, true>(simd::round_bf16<N>(g), simd::round_bf16<N>(u));
      simd::store<N>(o.out_bf16 + row * o.out_stride + col0 + i, act);
    }
  }
}

// A tile row's B blocks of accumulators (buf[b]: 16 floats) into the output: B blocks, or B/2 fused gate/up pairs.
template <int B>
inline void store_tile_row(const TileOut& o, int64_t row, int64_t col0, const float (&buf)[B][kBlock]) {
  if (o.up_offset) {
    for (int b = 0; b < B / 2; ++b) store_glu_row(o, row, col0 + b * kBlock, buf[b], buf[b + B / 2]);
  } else {
    for (int b = 0; b < B; ++b) store_row(o, row, col0 + b * kBlock, buf[b], kBlock);
  }
}

// ------------------------------------------------------------------ AVX-512

#if defined(__AVX512F__)

// float32 weights [blocks][K][16]; x float32 rows (stride xs). R rows, B blocks of 16 columns.
template <int R, int B>
void tile_f32_avx512(const float* x, int64_t xs, const float* w, int64_t k, const TileOut& o, int64_t row0,
                     int64_t col0, const float* next) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const float* wb[B];
  block_starts<B>(w, k * kBlock, o.up_offset, wb);
  for (int64_t i = 0; i < k; ++i) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + i * kBlock), _MM_HINT_T1);
    __m512 wv[B];
    for (int b = 0; b < B; ++b) {
      prefetch_weights<R>(wb[b] + (i + kPrefetchAhead) * kBlock);
      wv[b] = _mm512_loadu_ps(wb[b] + i * kBlock);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * xs + i]);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
    }
  }
  alignas(64) float buf[B][kBlock];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) _mm512_store_ps(buf[b], acc[r][b]);
    store_tile_row<B>(o, row0 + r, col0, buf);
  }
}

// bfloat16 weights [blocks][K/2][16][2] without vdpbf16ps; x as float32 rows (widened by the caller).
template <int R, int B>
void tile_bf16_avx512(const float* x, int64_t xs, const uint32_t* w, int64_t kp, const TileOut& o, int64_t row0,
                      int64_t col0, const uint32_t* next) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint32_t* wb[B];
  block_starts<B>(w, kp * kBlock, o.up_offset, wb);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < kp; ++p) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + p * kBlock), _MM_HINT_T1);
    __m512 even[B], odd[B];
    for (int b = 0; b < B; ++b) {
      prefetch_weights<R>(wb[b] + (p + kPrefetchAhead) * kBlock);
      const __m512i pairs = _mm512_loadu_si512(wb[b] + p * kBlock);
      even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      odd[b] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r * xs + 2 * p]);
      const __m512 x1 = _mm512_set1_ps(x[r * xs + 2 * p + 1]);
      for (int b = 0; b < B; ++b) {
        acc[r][b] = _mm512_fmadd_ps(x0, even[b], acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(x1, odd[b], acc[r][b]);
      }
    }
  }
  alignas(64) float buf[B][kBlock];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) _mm512_store_ps(buf[b], acc[r][b]);
    store_tile_row<B>(o, row0 + r, col0, buf);
  }
}

PAGEDSERVE_TILE(F32Avx512, tile_f32_avx512)
PAGEDSERVE_TILE(Bf16Avx512, tile_bf16_avx512)

#endif  // __AVX512F__

#if defined(__AVX512BF16__)

// bfloat16 weights [blocks][K/2][16][2] with vdpbf16ps; x as bfloat16 pairs (uint32, row stride xs pairs).
template <int R, int B>
void tile_bf16_dp(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t kp, const TileOut& o, int64_t row0,
                  int64_t col0, const uint32_t* next) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint32_t* wb[B];
  block_starts<B>(w, kp * kBlock, o.up_offset, wb);
  for (int64_t p = 0; p < kp; ++p) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + p * kBlock), _MM_HINT_T1);
    __m512bh wv[B];
    if constexpr (R <= kSmallRows) {  // the taller tiles ran no faster with it (prefill GEMMs: compute-bound)
      for (int b = 0; b < B; ++b) prefetch_weights<R>(wb[b] + (p + kPrefetchAhead) * kBlock);
    }
    for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wb[b] + p * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + p]));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  alignas(64) float buf[B][kBlock];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) _mm512_store_ps(buf[b], acc[r][b]);
    store_tile_row<B>(o, row0 + r, col0, buf);
  }
}

PAGEDSERVE_TILE(Bf16Dp, tile_bf16_dp)

#endif  // __AVX512BF16__

// ------------------------------------------------------------------ AVX2 + FMA (one block = two ymm halves)

#if defined(__AVX2__) && defined(__FMA__)

template <int R, int B>
void tile_f32_avx2(const float* x, int64_t xs, const float* w, int64_t k, const TileOut& o, int64_t row0,
                   int64_t col0, const float* next) {
  __m256 acc[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * B; ++h) acc[r][h] = _mm256_setzero_ps();
  const float* wb[B];
  block_starts<B>(w, k * kBlock, o.up_offset, wb);
  for (int64_t i = 0; i < k; ++i) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + i * kBlock), _MM_HINT_T1);
    __m256 wv[2 * B];
    for (int b = 0; b < B; ++b) {
      prefetch_weights<R>(wb[b] + (i + kPrefetchAhead) * kBlock);
      wv[2 * b] = _mm256_loadu_ps(wb[b] + i * kBlock);
      wv[2 * b + 1] = _mm256_loadu_ps(wb[b] + i * kBlock + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * xs + i]);
      for (int h = 0; h < 2 * B; ++h) acc[r][h] = _mm256_fmadd_ps(xv, wv[h], acc[r][h]);
    }
  }
  alignas(32) float buf[B][kBlock];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      _mm256_store_ps(buf[b], acc[r][2 * b]);
      _mm256_store_ps(buf[b] + 8, acc[r][2 * b + 1]);
    }
    store_tile_row<B>(o, row0 + r, col0, buf);
  }
}

template <int R, int B>
void tile_bf16_avx2(const float* x, int64_t xs, const uint32_t* w, int64_t kp, const TileOut& o, int64_t row0,
                    int64_t col0, const uint32_t* next) {
  __m256 acc[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * B; ++h) acc[r][h] = _mm256_setzero_ps();
  const uint32_t* wb[B];
  block_starts<B>(w, kp * kBlock, o.up_offset, wb);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < kp; ++p) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + p * kBlock), _MM_HINT_T1);
    __m256 even[2 * B], odd[2 * B];
    for (int b = 0; b < B; ++b)
      prefetch_weights<R>(wb[b] + (p + kPrefetchAhead) * kBlock);
    for (int h = 0; h < 2 * B; ++h) {
      const __m256i pairs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[h / 2] + p * kBlock + (h % 2) * 8));
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_set1_ps(x[r * xs + 2 * p]);
      const __m256 x1 = _mm256_set1_ps(x[r * xs + 2 * p + 1]);
      for (int h = 0; h < 2 * B; ++h) {
        acc[r][h] = _mm256_fmadd_ps(x0, even[h], acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(x1, odd[h], acc[r][h]);
      }
    }
  }
  alignas(32) float buf[B][kBlock];
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < B; ++b) {
      _mm256_store_ps(buf[b], acc[r][2 * b]);
      _mm256_store_ps(buf[b] + 8, acc[r][2 * b + 1]);
    }
    store_tile_row<B>(o, row0 + r, col0, buf);
  }
}

PAGEDSERVE_TILE(F32Avx2, tile_f32_avx2)
PAGEDSERVE_TILE(Bf16Avx2, tile_bf16_avx2)

#endif  // __AVX2__ && __FMA__

// ------------------------------------------------------------------ driver

// A tile kernel: R rows, B blocks; X is the x element type it reads, W the packed weight element type.
template <typename X, typename W>
using TileFn = void (*)(const X*, int64_t, const W*, int64_t, const TileOut&, int64_t, int64_t, const W*);

// Tile kernels for every r <= RMax rows and b <= BMax blocks: fn[(r - 1) * BMax + (b - 1)]. A fused gated-MLP
// table (kGlu) counts gate blocks: its entry for b reads b gate and b up blocks, 2b accumulators a row.
template <typename X, typename W, int RMax, int BMax>
struct Kernels {
  static constexpr int kRows = RMax;
  static constexpr int kBlocks = BMax;
  TileFn<X, W> fn[RMax * BMax];
};

// Tile is a struct with `template <int R, int B> static void run(...)` forwarding to one tile function.
template <typename Tile, typename X, typename W, int RMax, int BMax, int kPer, int... I>
constexpr Kernels<X, W, RMax, BMax> make_kernels(std::integer_sequence<int, I...>) {
  return {{&Tile::template run<I / BMax + 1, (I % BMax + 1) * kPer>...}};
}
template <typename Tile, typename X, typename W, int RMax, int BMax, bool kGlu = false>
constexpr Kernels<X, W, RMax, BMax> kernels_of() {
  return make_kernels<Tile, X, W, RMax, BMax, kGlu ? 2 : 1>(std::make_integer_sequence<int, RMax * BMax>{});
}

// Runs the tiles of blocks [b0, b1) for all m rows: kRowChunk rows at a time (their x stays in L2 while every
// block passes over it), and within a chunk kBlocks blocks at a time, kRows rows per pass (the weight tile is
// read once from memory and again from cache for each further pass).
// With kPrefetchNext (the tall tiles of a prefill), the first passes over a tile also pull the next tile into L2,
// one block per pass and one cache line per k: without it the first pass over each tile waits on memory (it needs
// the weights ~4x faster than one core reads them). Measured +1-3 % on a cold 128-row sweep (docs/benchmarks.md,
// "Time to first token").
// w_block: elements of W per block; xs: elements between x rows. A fused gated-MLP run (o.up_offset) counts gate
// blocks: each comes with its up block, and the next tile's prefetch covers both.
template <bool kPrefetchNext, typename X, typename W, int RMax, int BMax>
void run_blocks(const Kernels<X, W, RMax, BMax>& k, const X* x, int64_t xs, const W* w, int64_t w_block,
                int64_t depth, const TileOut& o, int64_t m, int64_t b0, int64_t b1) {
  const int per_block = o.up_offset ? 2 : 1;  // weight blocks read per output block
  for (int64_t c = 0; c < m; c += kRowChunk) {
    const int64_t c1 = std::min(m, c + kRowChunk);
    for (int64_t b = b0; b < b1; b += BMax) {
      const int nb = static_cast<int>(std::min<int64_t>(BMax, b1 - b));
      // The tile after this one: the next blocks of this chunk, else the first of the next chunk, else none.
      const int64_t after = b + nb < b1 ? b + nb : (c1 < m ? b0 : b1);
      const int64_t next_blocks = kPrefetchNext ? std::min<int64_t>(BMax, b1 - after) : 0;
      int64_t pass = 0;
      for (int64_t r = c; r < c1; r += RMax, ++pass) {
        const int nr = static_cast<int>(std::min<int64_t>(RMax, c1 - r));
        const W* next = nullptr;
        if (pass < next_blocks * per_block) {  // the next tile's blocks (gate blocks, then their up blocks)
          next = pass < next_blocks ? w + (after + pass) * w_block
                                    : w + (after + pass - next_blocks) * w_block + o.up_offset;
        }
        k.fn[(nr - 1) * BMax + (nb - 1)](x + r * xs, xs, w + b * w_block, depth, o, r, b * kBlock, next);
      }
    }
  }
}

// fn(b0, b1) over the blocks on up to omp_get_max_threads() threads, at least min_blocks each. tile_blocks = 0: one
// contiguous range per thread (the wide tiles' next-tile prefetch follows the range). tile_blocks > 0: pieces of
// whole tiles, kPiecesPerThread per thread, each thread taking the next as it finishes one, so a thread that starts
// late or runs slower (the other thread's Python, a VM's neighbour) takes fewer pieces instead of holding the
// region's closing barrier while the other spins.
template <typename Fn>
void over_threads(int64_t blocks, int64_t min_blocks, int64_t tile_blocks, Fn&& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), blocks / min_blocks));
  if (threads == 1) return fn(int64_t{0}, blocks);
  if (tile_blocks == 0) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      fn(blocks * t / nt, blocks * (t + 1) / nt);
    }
    return;
  }
  const int64_t per = (blocks + threads * kPiecesPerThread - 1) / (threads * kPiecesPerThread);
  const int64_t piece = (per + tile_blocks - 1) / tile_blocks * tile_blocks;
  const int64_t pieces = (blocks + piece - 1) / piece;
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < pieces;
       i = next.fetch_add(1, std::memory_order_relaxed))
    fn(i * piece, std::min(blocks, (i + 1) * piece));
}

// The row-count split of one path: `small` tiles up to kSmallRows rows (one pass), `wide` ones above.
template <typename X, typename W, int R1, int B1, int R2, int B2>
void run_path(const Kernels<X, W, R1, B1>& small, const Kernels<X, W, R2, B2>& wide, const X* x, int64_t xs,
              const W* w, int64_t w_block, int64_t depth, const TileOut& o, int64_t m, int64_t blocks) {
  if (m <= kSmallRows) {
    over_threads(blocks, kMinBlocksPerThread, B1, [&](int64_t b0, int64_t b1) {
      run_blocks<false>(small, x, xs, w, w_block, depth, o, m, b0, b1);
    });
  } else {
    over_threads(blocks, kMinBlocksPerThreadWide, 0, [&](int64_t b0, int64_t b1) {
      run_blocks<true>(wide, x, xs, w, w_block, depth, o, m, b0, b1);
    });
  }
}

// small_gemm_argmax_lse's results, one per row: the first index of the row's largest output, that output, and
// log(sum(exp(outputs))).
struct HeadStats {
  int64_t* argmax;
  float* max;
  float* lse;
};

// Bytes of a head panel's outputs (rows x the panel's columns, float32): they stay in L2 while their rows' stats
// are taken, so the [rows, vocab] logits are never written to memory and read back.
constexpr int64_t kHeadPanelBytes = 256 << 10;

// A head's GEMM in panels of output blocks, each panel's [m, columns] outputs written to a per-thread buffer and
// reduced at once to per-row (max, argmax, sum of exp) (csrc/cpu/row_stats.h); the panels' stats are then combined
// in column order, so the result does not depend on which thread ran which panel. Panels are handed out as threads
// finish them (over_threads' pieces): at a few rows each panel streams its part of the weights, at many rows its
// outputs fill kHeadPanelBytes. Threads run their panels' tiles without a nested team.
template <typename X, typename W, int R1, int B1, int R2, int B2>
void run_head(const Kernels<X, W, R1, B1>& small, const Kernels<X, W, R2, B2>& wide, const X* x, int64_t xs,
              const W* w, int64_t w_block, int64_t depth, const TileOut& o, int64_t m, int64_t blocks,
              const HeadStats& hs) {
  constexpr int N = simd::kNative;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t max_threads = std::max(1, omp_get_max_threads());
  const int64_t by_cache = std::max<int64_t>(4, kHeadPanelBytes / (static_cast<int64_t>(sizeof(float)) * kBlock * m));
  const int64_t by_balance = std::max<int64_t>(1, blocks / (max_threads * kPiecesPerThread));
  const int64_t panel = std::min(by_cache, by_balance), panels = (blocks + panel - 1) / panel;
  std::vector<float> pmax(panels * m), psum(panels * m);
  std::vector<int64_t> parg(panels * m);
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    std::vector<float> buf(m * panel * kBlock);
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < panels;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t b0 = i * panel, nb = std::min(panel, blocks - b0), col0 = b0 * kBlock;
      const int64_t cols = std::min(nb * kBlock, o.n - col0);
      TileOut po = o;
      po.out_f32 = buf.data(), po.out_bf16 = nullptr, po.out_stride = nb * kBlock, po.n = cols;
      po.bias = o.bias ? o.bias + col0 : nullptr;
      if (m <= kSmallRows) {
        run_blocks<false>(small, x, xs, w + b0 * w_block, w_block, depth, po, m, 0, nb);
      } else {
        run_blocks<true>(wide, x, xs, w + b0 * w_block, w_block, depth, po, m, 0, nb);
      }
      for (int64_t r = 0; r < m; ++r) {
        const float* row = buf.data() + r * po.out_stride;
        float mx;
        parg[i * m + r] = col0 + row_argmax<N>(row, cols, &mx);
        pmax[i * m + r] = mx;
        psum[i * m + r] = row_sumexp<N>(row, cols, mx);
      }
    }
  };
  const int64_t threads = std::min(max_threads, panels);
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    work();
  } else {
    work();
  }
  for (int64_t r = 0; r < m; ++r) {
    float mx = kNegInf, sum = 0.0f;
    int64_t arg = parg[r];  // every value NaN or -inf: the first panel's pick, as row_argmax's
    for (int64_t i = 0; i < panels; ++i) {
      const float pm = pmax[i * m + r], ps = psum[i * m + r];
      if (pm > mx) {  // strict: an equal maximum in a later panel keeps the first index
        sum = sum * std::exp(mx - pm) + ps;
        mx = pm, arg = parg[i * m + r];
      } else if (pm > kNegInf) {
        sum += ps * std::exp(pm - mx);
      }
    }
    hs.argmax[r] = arg, hs.max[r] = mx;
    hs.lse[r] = mx == kNegInf ? mx : mx + std::log(sum);
  }
}

// One ISA path's tiles: R1 x B1 up to kSmallRows rows and R2 x B2 above; a gated MLP's fused tiles (glu) hold G1 or
// G2 gate/up block pairs instead (0: the path has none, and glu is never asked of it).
template <typename Tile, int R1, int B1, int R2, int B2, int G1, int G2, typename X, typename W>
void run_tiles(bool glu, const X* x, int64_t xs, const W* w, int64_t w_block, int64_t depth, const TileOut& o,
               int64_t m, int64_t blocks, const HeadStats* head = nullptr) {
  if constexpr (G1 > 0 && G2 > 0) {
    if (glu) {
      static constexpr auto small = kernels_of<Tile, X, W, R1, G1, true>();
      static constexpr auto wide = kernels_of<Tile, X, W, R2, G2, true>();
      return run_path(small, wide, x, xs, w, w_block, depth, o, m, blocks);
    }
  }
  static constexpr auto small = kernels_of<Tile, X, W, R1, B1>();
  static constexpr auto wide = kernels_of<Tile, X, W, R2, B2>();
  if (head != nullptr) return run_head(small, wide, x, xs, w, w_block, depth, o, m, blocks, *head);
  run_path(small, wide, x, xs, w, w_block, depth, o, m, blocks);
}

// bfloat16 x rows widened to float32 (the paths without vdpbf16ps), K padded to `width` with zeros.
std::vector<float> widened(const at::Tensor& x, int64_t width) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> buf(m * width, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + r * x.stride(0);
    for (int64_t i = 0; i < k; ++i) buf[r * width + i] = static_cast<float>(src[i]);
  }
  return buf;
}

}  // namespace

int64_t small_gemm_isa() { return best_isa(); }

namespace {

// small_gemm (glu false) and small_gemm_glu (glu true; false when this path has no fused tiles or the output
// columns are not whole blocks: nothing is written then); with `head`, small_gemm_argmax_lse: no `out`, the
// outputs' head_n columns reduced to per-row stats (run_head).
bool gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
          int64_t isa, bool glu, const HeadStats* head = nullptr, int64_t head_n = 0) {
  const char* name = head ? "small_gemm_argmax_lse" : glu ? "small_gemm_glu" : "small_gemm";
  const Isa use = checked_isa(isa, name);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 1 && (head || out.dim() == 2), name,
              ": x [M, K], out [M, N], packed 1-D");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && (head || out.device().is_cpu()), name,
              ": CPU tensors");
  // A float32 out of a bfloat16 GEMM holds the bfloat16 result widened (a head's logits without a copy); a head's
  // stats are taken over those same values.
  const bool widen = !glu && x.scalar_type() == at::kBFloat16 && (head || out.scalar_type() == at::kFloat);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() && (head || out.scalar_type() == x.scalar_type() || widen),
              name, ": x, out and the packed weight share one dtype (or a bfloat16 GEMM's out is float32), got ",
              x.scalar_type(), ", ", head ? x.scalar_type() : out.scalar_type(), ", ", packed.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && (head || out.stride(1) == 1) && packed.is_contiguous(), name, ": rows contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = head ? head_n : out.size(1);
  const int64_t n_weight = glu ? 2 * n : n;  // the packed weight's columns: a gated MLP's are gate | up
  TORCH_CHECK(head || out.size(0) == m, name, ": out has ", head ? m : out.size(0), " rows, x ", m);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, name, ": float32 or bfloat16, got ", x.scalar_type());
  const int64_t blocks = (n_weight + kBlock - 1) / kBlock;
  const int64_t depth = bf16 ? (k + 1) / 2 : k;  // pairs (bfloat16) or k (float32) per block column
  TORCH_CHECK(packed.numel() == blocks * kBlock * depth * (bf16 ? 2 : 1), name, ": packed weight has ",
              packed.numel(), " elements, expected ", blocks * kBlock * depth * (bf16 ? 2 : 1), " for N=", n_weight,
              " K=", k);
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_weight, name, ": bias has ", bias->numel(), " elements, the weight's N is ",
                n_weight);
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  // Fused tiles: the AVX-512 paths (16 accumulators or more with a gate and an up block a row; the AVX2 tiles' 16
  // ymm registers hold one block of 4 rows), gate and up columns in whole blocks.
  if (glu && (use < kAvx512 || n % kBlock != 0)) return false;
  if (m == 0 || n == 0) return true;  // (a head's n > 0: checked by small_gemm_argmax_lse)
  const int64_t w_block = kBlock * depth * (bf16 ? 2 : 1);  // elements of the packed dtype per block
  // Output blocks (a gated MLP's count gate blocks) and, fused, the up blocks' distance in packed elements.
  const int64_t out_blocks = glu ? n / kBlock : blocks, up_offset = glu ? out_blocks * w_block : 0;
  const bool out_f32 = !head && out.scalar_type() == at::kFloat;  // a head's panels are float32 (run_head)
  TileOut o{out_f32 ? out.data_ptr<float>() : nullptr,
            out_f32 || head ? nullptr : out.data_ptr<c10::BFloat16>(), widen, head ? 0 : out.stride(0),
            bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, n,
            bf16 ? up_offset / 2 : up_offset};  // in the tiles' units: uint32 pairs for bfloat16

#if defined(__AVX512BF16__)
  if (bf16 && use == kAvx512Bf16) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
    const uint32_t* xp;
    int64_t xs;
    std::vector<c10::BFloat16> copy;
    if (k % 2 == 0 && x.stride(0) % 2 == 0) {  // pairs read in place
      xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
      xs = x.stride(0) / 2;
    } else {  // an odd K: rows padded with a zero
      copy.assign(m * depth * 2, c10::BFloat16(0.0f));
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(copy.data() + r * depth * 2, x.data_ptr<c10::BFloat16>() + r * x.stride(0), k * 2);
      xp = reinterpret_cast<const uint32_t*>(copy.data());
      xs = depth;
    }
    // Fused: 8 rows of a gate and an up block (16 accumulators); 6 rows of two pairs ran 1.5-5 % slower at 8 to 128.
    run_tiles<Bf16Dp, 4, 4, 8, 3, 2, 1>(glu, xp, xs, w, w_block / 2, depth, o, m, out_blocks, head);
    return true;
  }
#endif
  // The paths below read x as float32 rows: bfloat16 widened into a buffer (K padded to the packed depth),
  // float32 in place (a copy cost a fresh buffer and a pass over x per call: 5-10 ms of a 128-row sweep of
  // SmolLM2's 120 linears in an A/B).
  const std::vector<float> xf = bf16 ? widened(x, 2 * depth) : std::vector<float>();
  const float* xp = bf16 ? xf.data() : x.data_ptr<float>();
  const int64_t xs = bf16 ? 2 * depth : x.stride(0);
#if defined(__AVX512F__)
  if (use >= kAvx512) {
    if (bf16) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
      run_tiles<Bf16Avx512, 4, 2, 8, 2, 1, 1>(glu, xp, xs, w, w_block / 2, depth, o, m, out_blocks, head);
    } else {
      run_tiles<F32Avx512, 4, 4, 8, 3, 2, 1>(glu, xp, xs, packed.data_ptr<float>(), w_block, depth, o, m, out_blocks,
                                             head);
    }
    return true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  // No fused tiles (glu declined above). bfloat16: 16 ymm hold one block (two ymm halves) of at most 4 rows (8
  // accumulators, 4 widened pairs, 2 broadcasts); float32: 6-row tiles above (12 accumulators, 2 weights, 1 x).
  if (bf16) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
    run_tiles<Bf16Avx2, 4, 1, 4, 1, 0, 0>(false, xp, xs, w, w_block / 2, depth, o, m, out_blocks, head);
  } else {
    run_tiles<F32Avx2, 4, 1, 6, 1, 0, 0>(false, xp, xs, packed.data_ptr<float>(), w_block, depth, o, m, out_blocks,
                                         head);
  }
  return true;
#endif
  TORCH_CHECK(false, name, ": this build has no SIMD path (AVX2+FMA at least)");
}

}  // namespace

void small_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                int64_t isa) {
  gemm(out, x, packed, bias, isa, false);
}

bool small_gemm_glu(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                    const c10::optional<at::Tensor>& bias, int64_t isa) {
  return gemm(out, x, packed, bias, isa, true);
}

void small_gemm_argmax_lse(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n, at::Tensor& argmax, at::Tensor& max, at::Tensor& logsumexp, int64_t isa) {
  const int64_t m = x.dim() == 2 ? x.size(0) : -1;
  TORCH_CHECK(n > 0, "small_gemm_argmax_lse: n (the output columns) must be positive, got ", n);
  TORCH_CHECK(argmax.scalar_type() == at::kLong && max.scalar_type() == at::kFloat &&
                  logsumexp.scalar_type() == at::kFloat,
              "small_gemm_argmax_lse: argmax int64, max and logsumexp float32");
  for (const at::Tensor* t : {&argmax, &max, &logsumexp}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == m && t->is_contiguous(),
                "small_gemm_argmax_lse: argmax, max and logsumexp are contiguous [rows] CPU tensors");
  }
  const HeadStats stats{argmax.data_ptr<int64_t>(), max.data_ptr<float>(), logsumexp.data_ptr<float>()};
  gemm(at::Tensor(), x, packed, bias, isa, false, &stats, n);
}

}  // namespace cpu
}  // namespace pagedserve
