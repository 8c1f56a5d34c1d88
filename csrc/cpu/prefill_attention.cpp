// CPU causal attention of one sequence's new tokens over its context (prefill).
//
// GQA without copies: the (token, head) pairs of a kv-head group are the rows of
// one problem against that kv head's keys. Each kv head's keys are packed once,
// transposed so that keys run along the vector lanes: a tile of query rows times
// a run of keys is then plain FMAs, with no horizontal sums (and, for bfloat16
// on AVX512-BF16, vdpbf16ps on key pairs). Scores of a tile are kept whole (a
// prompt's rows fit in cache), softmax runs in float32, and P.V accumulates the
// tile's rows in registers. Results differ from torch's SDPA by summation order
// and by P staying float32 (SDPA rounds it to bfloat16 for bfloat16 inputs).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../ops.h"
#include "parallel.h"
#include "simd.h"

namespace pagedserve {
namespace cpu {

namespace {

using simd::Vec;
constexpr int N = simd::kNative;
constexpr int kRows = N == 16 ? 6 : 4;  // query rows per tile
constexpr int kKeyVecs = 2;             // QK: kRows x kKeyVecs accumulators
constexpr int kKeys = kKeyVecs * N;     // keys per QK step
constexpr int kSlice = N == 16 ? 4 : 2;  // PV: kRows x kSlice accumulators
constexpr int64_t kParallelMinWork = int64_t{1} << 20;  // multiply-adds; see attention.cpp

#if defined(__AVX512BF16__)
constexpr bool kHavePairs = N == 16;  // bf16 keys can be packed as pairs for vdpbf16ps
#else
constexpr bool kHavePairs = false;
#endif

// Where the K or V row of context token j, kv head h lives: a paged cache (or one block).
struct Layout {
  int64_t block, head, tok;  // strides, in elements
};

struct Problem {
  int64_t q_len, ctx, num_kv_heads, group, head_size, padded;  // padded: ctx rounded up to kKeys
  int64_t q_tok, q_head, o_tok;  // strides, in elements
  Layout k, v;
  const int32_t* table;  // [ctx / block_size rounded up] the sequence's blocks
  int64_t block_size;
  float scale;
  int64_t window;  // keys a row sees, itself included; 0: every earlier key
  float softcap;   // > 0: scores = tanh(scores / softcap) * softcap (Gemma 2), before the window and causal cut
  int64_t rows() const { return q_len * group; }  // per kv head: row r is token r / group, head r % group
  int64_t last_key(int64_t row) const { return ctx - q_len + row / group; }  // causal, after the cached prefix
  int64_t first_key(int64_t row) const {  // blocks wholly before row 0's first key are never read
    return window > 0 ? std::max<int64_t>(0, last_key(row) - window + 1) : 0;
  }
  // Row of token j (block b = j / block_size, offset r) for kv head h.
  template <typename T>
  const T* row(const T* base, const Layout& l, int64_t b, int64_t r, int64_t h) const {
    return base + table[b] * l.block + h * l.head + r * l.tok;
  }
};

// Keys [j0, j1) of kv head h, transposed: words [head_size / 2][padded] bf16 pairs
// (Pairs), else floats [head_size][padded]. Keys past ctx stay zero.
template <bool Pairs, typename T>
void pack_keys(uint32_t* words, float* floats, const T* key, int64_t h, int64_t j0, int64_t j1, const Problem& p) {
  const int64_t H = p.head_size;
  for (int64_t j = j0; j < j1; ++j) {
    const T* k = p.row(key, p.k, j / p.block_size, j % p.block_size, h);
    if constexpr (Pairs) {
      uint32_t* dst = words + h * (H / 2) * p.padded + j;
      for (int64_t d = 0; d < H / 2; ++d) std::memcpy(dst + d * p.padded, k + 2 * d, 4);
    } else {
      float* dst = floats + h * H * p.padded + j;
      for (int64_t d = 0; d < H; ++d) dst[d * p.padded] = static_cast<float>(k[d]);
    }
  }
}

// s[m][j0, j0 + kKeys) = scale * q_m . k_j for the tile's rows (q: float32 copies, or bf16 pairs).
template <bool Pairs, typename T>
inline void score_step(float* s, int64_t s_stride, const float* qf, const T* const (&qt)[kRows],
                       const uint32_t* words, const float* floats, int64_t j0, const Problem& p) {
  Vec<N> acc[kRows][kKeyVecs] = {};
  const int64_t H = p.head_size;
#if defined(__AVX512BF16__)
  if constexpr (Pairs) {
    for (int64_t d = 0; d < H / 2; ++d) {
      __m512bh k[kKeyVecs];
      for (int c = 0; c < kKeyVecs; ++c) k[c] = (__m512bh)_mm512_loadu_si512(words + d * p.padded + j0 + c * N);
      for (int m = 0; m < kRows; ++m) {
        int32_t pair;
        std::memcpy(&pair, qt[m] + 2 * d, 4);
        const __m512bh q = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < kKeyVecs; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], q, k[c]);
      }
    }
  } else
#endif
  {
    for (int64_t d = 0; d < H; ++d) {
      Vec<N> k[kKeyVecs];
      for (int c = 0; c < kKeyVecs; ++c) k[c] = simd::load<N>(floats + d * p.padded + j0 + c * N);
      for (int m = 0; m < kRows; ++m) {
        const Vec<N> q = simd::splat<N>(qf[m * H + d]);
        for (int c = 0; c < kKeyVecs; ++c) acc[m][c] += q * k[c];
      }
    }
  }
  for (int m = 0; m < kRows; ++m) {
    for (int c = 0; c < kKeyVecs; ++c) {
      const Vec<N> scaled = acc[m][c] * p.scale;
      simd::store<N>(s + m * s_stride + j0 + c * N, p.softcap > 0.f ? simd::softcap<N>(scaled, p.softcap) : scaled);
    }
  }
}

// In place over s[begin, end): exp(s - max) over keys [first, last], zeros elsewhere; returns the sum.
inline float softmax_row(float* s, int64_t begin, int64_t first, int64_t last, int64_t end) {
  std::fill(s + begin, s + first, 0.f);  // before the sliding window
  float* w = s + first;
  const int64_t len = last + 1 - first;
  float m = -std::numeric_limits<float>::infinity();
  Vec<N> mv = simd::splat<N>(m);
  int64_t j = 0;
  for (; j + N <= len; j += N) mv = simd::max<N>(mv, simd::load<N>(w + j));
  m = simd::reduce_max<N>(mv);
  for (; j < len; ++j) m = std::max(m, w[j]);
  Vec<N> sum = {};
  for (j = 0; j + N <= len; j += N) {
    const Vec<N> e = simd::exp<N>(simd::load<N>(w + j) - m);
    simd::store<N>(w + j, e);
    sum += e;
  }
  if (j < len) {  // the tail, one vector whose lanes past `last` are masked (written only up to `last`)
    alignas(64) float tail[N] = {};
    std::copy(w + j, w + len, tail);
    Vec<N> e = simd::exp<N>(simd::load<N>(tail) - m);
    for (int i = static_cast<int>(len - j); i < N; ++i) e[i] = 0.f;
    simd::store<N>(tail, e);
    std::copy(tail, tail + (len - j), w + j);
    sum += e;
  }
  std::fill(s + last + 1, s + end, 0.f);  // later tokens: causal
  return simd::reduce_add<N>(sum);
}

// out rows of the tile [d0, d0 + S*L) = sum_j P[m][j] v_j / sum[m], for keys [begin, end).
template <int L, int S, typename T>
void pv_slice(T* const (&out)[kRows], const float* P, int64_t p_stride, const float* inv_sum, const T* value,
              int64_t h, int64_t begin, int64_t end, int64_t d0, const Problem& p) {
  Vec<L> acc[kRows][S] = {};
  // One flat loop (GCC keeps the 24 accumulators in registers only then), a table lookup per block.
  int64_t b = begin / p.block_size, r = begin % p.block_size;
  const T* v = p.row(value, p.v, b, r, h) + d0;
  for (int64_t j = begin; j < end; ++j) {
    Vec<L> x[S];
    for (int s = 0; s < S; ++s) {
      x[s] = simd::load<L>(v + s * L);
      simd::keep_in_register<L>(x[s]);  // once per key, not once per row
    }
    for (int m = 0; m < kRows; ++m) {
      const Vec<L> w = simd::splat<L>(P[m * p_stride + j]);
      for (int s = 0; s < S; ++s) acc[m][s] += w * x[s];
    }
    if (++r < p.block_size) {
      v += p.v.tok;
    } else if (j + 1 < end) {
      r = 0;
      v = p.row(value, p.v, ++b, 0, h) + d0;
    }
  }
  for (int m = 0; m < kRows; ++m) {
    for (int s = 0; s < S; ++s) simd::store<L>(out[m] + d0 + s * L, acc[m][s] * inv_sum[m]);
  }
}

template <int L, typename T>
void pv(T* const (&out)[kRows], const float* P, int64_t p_stride, const float* inv_sum, const T* value, int64_t h,
        int64_t begin, int64_t end, const Problem& p) {
  int64_t d0 = 0;
  for (; d0 + kSlice * L <= p.head_size; d0 += kSlice * L) {
    pv_slice<L, kSlice>(out, P, p_stride, inv_sum, value, h, begin, end, d0, p);
  }
  for (; d0 < p.head_size; d0 += L) pv_slice<L, 1>(out, P, p_stride, inv_sum, value, h, begin, end, d0, p);
}

struct Scratch {
  std::vector<float> scores;  // [kRows, padded]
  std::vector<float> query;   // [kRows, head_size] float32 copies
  std::vector<float> out;     // [kRows, head_size] rows past the end land here
};

// Rows [r0, r0 + kRows) of kv head h (a last partial tile repeats its final row into scratch).
template <bool Pairs, typename T>
void attend_tile(T* out, const T* query, const T* value, const uint32_t* words, const float* floats, int64_t h,
                 int64_t r0, const Problem& p, Scratch& sc) {
  const int64_t H = p.head_size;
  const T* qt[kRows];
  T* ot[kRows];
  float inv_sum[kRows];
  T* spare = reinterpret_cast<T*>(sc.out.data());
  for (int m = 0; m < kRows; ++m) {
    const int64_t r = std::min(r0 + m, p.rows() - 1), tok = r / p.group, head = h * p.group + r % p.group;
    qt[m] = query + tok * p.q_tok + head * p.q_head;
    ot[m] = r0 + m < p.rows() ? out + tok * p.o_tok + head * H : spare + m * H;
    if constexpr (!Pairs) {  // float32 copies to broadcast from (pairs are read from the query itself)
      for (int64_t d = 0; d < H; ++d) sc.query[m * H + d] = static_cast<float>(qt[m][d]);
    }
  }
  // Rows are in token order: the tile's keys run from its first row's first key to its last row's last.
  const int64_t first = p.first_key(r0), last = p.last_key(std::min(r0 + kRows, p.rows()) - 1);
  const int64_t begin = first / kKeys * kKeys, end = (last + kKeys) / kKeys * kKeys;
  float* s = sc.scores.data();
  words += h * (H / 2) * p.padded;  // this kv head's packed keys (zeros before the packed range)
  floats += h * H * p.padded;
  for (int64_t j0 = begin; j0 < end; j0 += kKeys) {
    score_step<Pairs, T>(s, p.padded, sc.query.data(), qt, words, floats, j0, p);
  }
  for (int m = 0; m < kRows; ++m) {
    const int64_t r = std::min(r0 + m, p.rows() - 1);
    inv_sum[m] = 1.f / softmax_row(s + m * p.padded, begin, p.first_key(r), p.last_key(r), end);
  }
  // V rows before `first` may be in released blocks: P.V starts there, not at `begin`.
  if (H % N == 0) {
    pv<N>(ot, s, p.padded, inv_sum, value, h, first, last + 1, p);
  } else {
    pv<1>(ot, s, p.padded, inv_sum, value, h, first, last + 1, p);
  }
}

template <bool Pairs, typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const Problem& p) {
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const T* q = reinterpret_cast<const T*>(query.data_ptr());
  const T* k = reinterpret_cast<const T*>(key.data_ptr());
  const T* v = reinterpret_cast<const T*>(value.data_ptr());
  const int64_t H = p.head_size, tiles = (p.rows() + kRows - 1) / kRows;
  std::vector<uint32_t> words(Pairs ? p.num_kv_heads * (H / 2) * p.padded : 0);
  std::vector<float> floats(Pairs ? 0 : p.num_kv_heads * H * p.padded);
  const int64_t keys_per_row = p.window > 0 ? std::min(p.window, p.ctx - p.q_len / 2) : p.ctx - p.q_len / 2;
  const int64_t work = p.num_kv_heads * p.rows() * keys_per_row * H;
  std::atomic<bool> packed{false};
  std::atomic<int64_t> next{0};
#pragma omp parallel if (work >= kParallelMinWork)
  {
    if (omp_get_thread_num() == 0) {  // the caller packs the keys while the team wakes up (parallel.h)
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        pack_keys<Pairs>(words.data(), floats.data(), k, h, p.first_key(0), p.ctx, p);
      }
      packed.store(true, std::memory_order_release);
    }
    while (!packed.load(std::memory_order_acquire)) spin_pause();
    Scratch sc;
    sc.scores.resize(kRows * p.padded);
    sc.query.resize(kRows * H);
    sc.out.resize(kRows * H);
    // Longest rows (the last tiles) first, so that the threads end evenly.
    share_items(next, p.num_kv_heads * tiles, [&](int64_t i) {
      const int64_t h = i % p.num_kv_heads, tile = tiles - 1 - i / p.num_kv_heads;
      attend_tile<Pairs>(o, q, v, words.data(), floats.data(), h, tile * kRows, p, sc);
    });
  }
}

}  // namespace

void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_table, int64_t context_len, double scale,
                       int64_t sliding_window, double softcap) {
  TORCH_CHECK(softcap >= 0, "prefill_attention: softcap must be >= 0 (0: none)");
  TORCH_CHECK(sliding_window >= 0, "prefill_attention: sliding_window must be >= 0 (0: the whole context)");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && key_cache.dim() == 4 &&
                  key_cache.sizes() == value_cache.sizes(),
              "prefill_attention: out/query [q_len, num_heads, head_size], "
              "key/value cache [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1 && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "prefill_attention: head vectors must be contiguous, and out's heads too");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "prefill_attention: out, query and the caches must share one dtype");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt,
              "prefill_attention: block_table must be int32 [num_seq_blocks]");
  const int64_t q_len = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "prefill_attention: cache head_size ", key_cache.size(3), " != ",
              head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "prefill_attention: num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(q_len <= context_len && context_len <= block_table.size(0) * block_size, "prefill_attention: ", q_len,
              " new tokens, a context of ", context_len, " and ", block_table.size(0), " blocks of ", block_size);
  const auto table = block_table.contiguous();
  const int32_t* ids = table.data_ptr<int32_t>();
  const int64_t first_read = sliding_window > 0 ? std::max<int64_t>(0, context_len - q_len - sliding_window + 1) : 0;
  for (int64_t b = first_read / block_size; b * block_size < context_len; ++b) {  // a bad id would read outside
    TORCH_CHECK(ids[b] >= 0 && ids[b] < num_blocks, "prefill_attention: block_table[", b, "] = ", ids[b],
                " is outside the cache");
  }
  if (q_len == 0) return;
  const Layout k{key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  const Layout v{value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
  const Problem p{q_len, context_len, num_kv_heads, num_heads / num_kv_heads, head_size,
                  (context_len + kKeys - 1) / kKeys * kKeys, query.stride(0), query.stride(1), out.stride(0),
                  k, v, ids, block_size, static_cast<float>(scale), sliding_window, static_cast<float>(softcap)};
  switch (dtype) {
    case at::kFloat: return run<false, float>(out, query, key_cache, value_cache, p);
    case at::kBFloat16:
      if (kHavePairs && head_size % 2 == 0) {
        return run<kHavePairs, c10::BFloat16>(out, query, key_cache, value_cache, p);
      }
      return run<false, c10::BFloat16>(out, query, key_cache, value_cache, p);
    case at::kHalf: return run<false, c10::Half>(out, query, key_cache, value_cache, p);
    default: TORCH_CHECK(false, "prefill_attention: unsupported dtype ", dtype);
  }
}

}  // namespace cpu
}  // namespace pagedserve
