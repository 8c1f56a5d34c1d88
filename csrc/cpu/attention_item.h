// One work item of CPU paged decode attention: every query head of one kv-head
// group (GQA) against one span of one sequence's paged context. Each K and V row
// comes from memory once for the whole group: QK takes 8 K rows at a time and
// feeds each K vector to kQkTile heads from registers (the rest from L1), PV
// feeds each V row to kMaxTile heads' accumulators (larger groups: a pass per
// tile, from cache). float32 accumulation throughout. A thread reads its items'
// rows in one stream, which Lookahead prefetches ahead of the reads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace pagedserve {
namespace cpu {
namespace attn {

using simd::Vec;

constexpr int kMaxTile = 4;  // query heads whose V accumulators share registers

struct Geometry {
  int64_t num_kv_heads, group, head_size, block_size;
  int64_t q_stride_seq, q_stride_head;  // query may be a strided view
  float scale;
  float softcap;  // > 0: scores = tanh(scores / softcap) * softcap (Gemma 2); 0: none
};

// One (sequence, kv head, context span) and where its result goes.
template <typename T>
struct Item {
  const T* query;        // [group, head_size] rows q_stride_head apart
  const T* key_cache;    // [num_blocks, num_kv_heads, block_size, head_size]
  const T* value_cache;  // [num_blocks, num_kv_heads, block_size, head_size]
  const int32_t* table;  // [max_blocks] the sequence's block table
  int64_t kv_head, begin, end;  // tokens [begin, end) of the context
};

// Row `offset` of the item's kv head in logical block `block` of its sequence.
template <typename T>
inline const T* row(const T* cache, const Item<T>& it, int64_t block, int64_t offset, const Geometry& g) {
  const int64_t physical = it.table[block];
  return cache + ((physical * g.num_kv_heads + it.kv_head) * g.block_size + offset) * g.head_size;
}

// The KV rows are read in one order per thread (an item's K rows, its V rows, the next item's K rows, ...), from
// blocks scattered in memory: the hardware prefetcher, which follows address streams and stops at page ends,
// missed the start of each block. Lookahead asks for the rows kLookaheadBytes ahead of the reads, into L2 (T2),
// as the reads go: a decode step's attention over cold KV (32 sequences of 192 tokens, 30 layers, bfloat16)
// went from 9.2-10.4 to 5.6-5.7 ms, ~25 GB/s on a VM that reads ~30 (docs/benchmarks.md, "Two changes since the
// 00:17 round"). The prefetch it replaced, each item's whole K (two blocks ahead) and first V block in one burst
// as the item began, left the core waiting on that burst before it computed: memory and compute took turns.
// 4 KiB ahead ran 6 % slower, 16 and 32 KiB the same; into L1 (T0) 50 % slower.
constexpr int64_t kLookaheadBytes = 8 << 10;

template <typename T>
class Lookahead {
 public:
  explicit Lookahead(const Geometry& g)
      : g_(g), lines_((g.head_size * static_cast<int64_t>(sizeof(T)) + 63) / 64),
        distance_(std::max<int64_t>(1, kLookaheadBytes / (lines_ * 64))) {}

  // Queues the thread's next item; the first one is primed (the rows one distance ahead asked for at once).
  void push(const Item<T>& it) {
    ring_[pushed_ % kRing] = it;
    if (cur_ == pushed_++) {
      begin_stream(0);
      if (pushed_ == 1) advance(distance_);
    }
  }
  // The reader starts item `index` (0, 1, ... in push order): a cursor still behind it jumps there.
  void reader_at(int64_t index) {
    if (cur_ < index) {
      cur_ = index;
      if (cur_ < pushed_) begin_stream(0);
    }
  }
  // The reader read `tokens` more rows: ask for as many at the cursor.
  void advance(int64_t tokens) {
    while (tokens > 0 && cur_ < pushed_) {
      const Item<T>& it = ring_[cur_ % kRing];
      if (tok_ < it.end) {  // rows of one block at a time: contiguous
        const int64_t n = std::min({tokens, g_.block_size - offset_, it.end - tok_});
        const char* p = reinterpret_cast<const char*>(row(stream_ ? it.value_cache : it.key_cache, it, block_,
                                                          offset_, g_));
        for (int64_t line = 0; line < n * lines_; ++line) __builtin_prefetch(p + 64 * line, 0, 1);  // T2
        tokens -= n, tok_ += n, offset_ += n;
        if (offset_ == g_.block_size) offset_ = 0, ++block_;
      }
      if (tok_ >= it.end) {  // K done: V; V done: the next item's K, if queued (an empty span: begin >= end)
        if (stream_ == 0) {
          begin_stream(1);
        } else if (++cur_ < pushed_) {
          begin_stream(0);
        }
      }
    }
  }

 private:
  // Items from the cursor's to the newest: at most three (a cursor still in the item before the reader's, until
  // reader_at moves it, the reader's, the next one).
  static constexpr int64_t kRing = 4;
  void begin_stream(int s) {
    stream_ = s, tok_ = ring_[cur_ % kRing].begin;
    block_ = tok_ / g_.block_size, offset_ = tok_ % g_.block_size;
  }
  const Geometry& g_;
  const int64_t lines_;     // cache lines of one row (one token of one kv head)
  const int64_t distance_;  // rows ahead of the reader
  Item<T> ring_[kRing];     // items in push order, ring_[i % kRing]
  int64_t pushed_ = 0, cur_ = 0;  // items pushed; the one the cursor is in (== pushed_: waits for a push)
  int stream_ = 0;                // 0: the item's K rows, 1: its V rows
  int64_t tok_ = 0, block_ = 0, offset_ = 0;  // the cursor's token, its logical block and offset there
};

// Query heads per pass over the K rows: each K vector feeds GT heads' FMAs from
// registers. 8 keys x 3 heads of accumulators fill 24 of AVX-512's 32 registers.
constexpr int kQkTile = simd::kNative == 16 ? 3 : 1;

// out[h][t] = q_h . k_t for GT heads and M key rows: M accumulators per head,
// then one transpose-and-add per head instead of M horizontal sums. H is a multiple of M.
template <int M, int GT, typename TQ, typename TK>
inline void dots(Vec<M> (&out)[GT], const TQ* q, int64_t q_stride, const TK* const (&k)[M], int64_t H) {
  Vec<M> acc[GT][M] = {};
#if defined(__AVX512BF16__)
  if constexpr (M == 8 && std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<TK, c10::BFloat16>) {
    // vdpbf16ps: two bf16 products per lane, exact in float32, summed in float32.
    for (int64_t d = 0; d < H; d += 16) {
      __m256bh qd[GT];
      for (int h = 0; h < GT; ++h) {
        qd[h] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + h * q_stride + d));
      }
#pragma GCC unroll 8
      for (int t = 0; t < M; ++t) {
        const __m256bh x = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[t] + d));
        for (int h = 0; h < GT; ++h) acc[h][t] = _mm256_dpbf16_ps(acc[h][t], qd[h], x);
      }
    }
    for (int h = 0; h < GT; ++h) out[h] = simd::transpose_add<M>(acc[h]);
    return;
  }
#endif
  for (int64_t d = 0; d < H; d += M) {
    Vec<M> qd[GT];
    for (int h = 0; h < GT; ++h) qd[h] = simd::load<M>(q + h * q_stride + d);
#pragma GCC unroll 8
    for (int t = 0; t < M; ++t) {
      Vec<M> x = simd::load<M>(k[t] + d);
      if constexpr (GT > 1) simd::keep_in_register<M>(x);  // loaded once for all GT heads
      for (int h = 0; h < GT; ++h) acc[h][t] += qd[h] * x;
    }
  }
  for (int h = 0; h < GT; ++h) out[h] = simd::transpose_add<M>(acc[h]);
}

template <int M, int GT, typename TQ, typename TK>
inline void qk_tile(float* logits, int64_t padded, const TQ* q, const TK* const (&k)[M], const Geometry& g) {
  Vec<M> s[GT];
  dots<M, GT>(s, q, g.q_stride_head, k, g.head_size);
  for (int h = 0; h < GT; ++h) {
    const Vec<M> scaled = s[h] * g.scale;
    simd::store<M>(logits + h * padded, g.softcap > 0.f ? simd::softcap<M>(scaled, g.softcap) : scaled);
  }
}

// A 16-bit cache where one head takes a pass over the K rows (kQkTile 1: AVX2's 16 registers hold one head's 8
// keys' sums) widens each group of M rows to float32 once, into kf (L1), for all the group's heads: the widening
// was 2 of the 3 instructions a product. Zen 5 held to AVX2, one thread, SmolLM2's 9 / 3 heads of 64, bfloat16, 8
// sequences (`kernels.py --smollm2 --ops paged`): a layer's decode attention at 192 tokens 0.107 -> 0.082 ms, at 512
// 0.285 -> 0.222; with K, q and V widened 16 values at a time (simd::widen16_permuted) 0.068 and 0.178.
constexpr int64_t kWidenMaxHead = 256;

// The K rows of tokens j .. j + M - 1 (block / offset: token j's, advanced past them); the padding lanes past the
// item's end repeat the last row.
template <int M, typename T>
inline void key_rows(const T* (&k)[M], const Item<T>& it, int64_t j, int64_t& block, int64_t& offset,
                     const Geometry& g) {
  for (int t = 0; t < M; ++t) {
    if (j + t == it.end) {
      for (; t < M; ++t) k[t] = k[t - 1];
      return;
    }
    k[t] = row(it.key_cache, it, block, offset, g);
    if (++offset == g.block_size) offset = 0, ++block;
  }
}

// Whether a bfloat16 row is widened 16 values at a time in simd::widen16_permuted's lane order (AVX2).
template <int N, typename T>
constexpr bool kPermutedBf16 =
#if defined(__AVX2__)
    N == 8 && std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif
constexpr int64_t kWidenMaxQ = 4096;  // floats of a group's q rows widened once (qk_widened, permuted)

// AVX2, bfloat16, head_size a multiple of 16: K rows and the group's q rows in widen16_permuted's lane order (the same
// order on both sides of a dot product); else in order.
template <int N, typename T>
void qk_widened(float* logits, int64_t padded, const Item<T>& it, const Geometry& g, Lookahead<T>& la) {
  constexpr int M = N > 8 ? 8 : N;
  alignas(64) float kf[M * kWidenMaxHead];
  alignas(64) float qf[kPermutedBf16<N, T> ? kWidenMaxQ : 1];
  const float* k[M];
  const int64_t H = g.head_size;
  const bool permuted = kPermutedBf16<N, T> && H % 16 == 0 && g.group * H <= kWidenMaxQ;
  auto widen = [&](float* dst, const T* src) {
#if defined(__AVX2__)
    if constexpr (kPermutedBf16<N, T>) {
      if (permuted) {
        for (int64_t d = 0; d < H; d += 16) {
          Vec<8> lo, hi;
          simd::widen16_permuted(src + d, lo, hi);
          simd::store<8>(dst + d, lo);
          simd::store<8>(dst + d + 8, hi);
        }
        return;
      }
    }
#endif
    for (int64_t d = 0; d < H; d += N) simd::store<N>(dst + d, simd::load<N>(src + d));
  };
  if (permuted) {
    for (int64_t h = 0; h < g.group; ++h) widen(qf + h * H, it.query + h * g.q_stride_head);
  }
  int64_t block = it.begin / g.block_size, offset = it.begin % g.block_size;
  for (int64_t j = it.begin; j < it.end; j += M) {
    la.advance(M);
    const T* src[M];
    key_rows(src, it, j, block, offset, g);
    for (int t = 0; t < M; ++t) {
      widen(kf + t * H, src[t]);
      k[t] = kf + t * H;
    }
    for (int64_t h = 0; h < g.group; ++h) {
      float* l = logits + h * padded + (j - it.begin);
      if (permuted) qk_tile<M, 1>(l, padded, static_cast<const float*>(qf + h * H), k, g);
      else qk_tile<M, 1>(l, padded, it.query + h * g.q_stride_head, k, g);
    }
  }
}

// logits[h][0, len) = scale * q_h . k_j for every head h of the group; lanes
// [len, padded) hold repeats of the last token's score or are left unset.
// M keys per step: the tree that sums the lanes costs about 3 M-lane
// operations per key, so 8 lanes beat 16 even where zmm registers exist.
template <int N, typename T>
void qk(float* logits,  // [group, padded]
        int64_t padded, const Item<T>& it, const Geometry& g, Lookahead<T>& la) {
  constexpr int M = N > 8 ? 8 : N;
  constexpr bool kWiden = kQkTile == 1 && !std::is_same_v<T, float>;
  if constexpr (kWiden) {
    if (g.group > 1 && g.head_size <= kWidenMaxHead && g.head_size % N == 0) {
      return qk_widened<N>(logits, padded, it, g, la);
    }
  }
  const T* k[M];
  int64_t block = it.begin / g.block_size, offset = it.begin % g.block_size;  // no division per row
  for (int64_t j = it.begin; j < it.end; j += M) {
    la.advance(M);
    key_rows(k, it, j, block, offset, g);
    for (int64_t h = 0; h < g.group; h += kQkTile) {
      float* l = logits + h * padded + (j - it.begin);
      const T* q = it.query + h * g.q_stride_head;
      switch (std::min<int64_t>(kQkTile, g.group - h)) {
        case 1: qk_tile<M, 1>(l, padded, q, k, g); break;
        case 2: qk_tile<M, 2>(l, padded, q, k, g); break;
        default: qk_tile<M, kQkTile>(l, padded, q, k, g); break;
      }
    }
  }
}

// In place: p = exp(l - max) over [0, len), zeros in [len, padded); returns the max, sum in *sum.
template <int N>
float softmax_numerators(float* l, int64_t len, int64_t padded, float* sum) {
  Vec<N> mv = simd::splat<N>(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + N <= len; t += N) mv = simd::max<N>(mv, simd::load<N>(l + t));
  float m = simd::reduce_max<N>(mv);
  for (; t < len; ++t) m = std::max(m, l[t]);
  Vec<N> sv = {};
  for (t = 0; t < padded; t += N) {
    Vec<N> p = simd::exp<N>(simd::load<N>(l + t) - m);
    if (t + N > len) {
      for (int i = static_cast<int>(len - t); i < N; ++i) p[i] = 0.f;
    }
    simd::store<N>(l + t, p);
    sv += p;
  }
  *sum = simd::reduce_add<N>(sv);
  return m;
}

// acc[h][d0, d0 + S*N) = sum_j p[h][j] * v_j[d0, ...) for GT heads: the V row slice
// is loaded (and widened) once and feeds GT * S accumulators held in registers.
// la: the lookahead, advanced as the rows go, on the first pass over them (nullptr on the others).
template <int N, int GT, int S, typename T>
void pv_slice(float* acc,       // [GT, head_size]
              const float* p,   // [GT, padded] softmax numerators
              int64_t padded, int64_t d0, const Item<T>& it, const Geometry& g, Lookahead<T>* la) {
  // AVX2, bfloat16: a V row's 16 values widened by simd::widen16_permuted, the sums unpermuted once at the end
  constexpr bool kPermuted = kPermutedBf16<N, T> && S % 2 == 0;
  Vec<N> a[GT][S] = {};
  const int64_t B = g.block_size, H = g.head_size;
  for (int64_t j = it.begin, block = j / B, offset = j % B; j < it.end; ++block, offset = 0) {
    const T* v = row(it.value_cache, it, block, offset, g) + d0;  // block by block: one table lookup each
    const int64_t n = std::min(B - offset, it.end - j);
    const float* pj = p + (j - it.begin);
    j += n;
    for (int64_t r = 0; r < n; ++r, v += H) {
      if (la && r % 8 == 0) la->advance(8);
      Vec<N> x[S];
      if constexpr (kPermuted) {
#if defined(__AVX2__)
        for (int s = 0; s < S; s += 2) simd::widen16_permuted(v + s * N, x[s], x[s + 1]);
#endif
        for (int s = 0; s < S; ++s) simd::keep_in_register<N>(x[s]);
      } else {
        for (int s = 0; s < S; ++s) {
          x[s] = simd::load<N>(v + s * N);
          simd::keep_in_register<N>(x[s]);  // once per row, not once per head
        }
      }
      for (int h = 0; h < GT; ++h) {
        const Vec<N> w = simd::splat<N>(pj[h * padded + r]);
        for (int s = 0; s < S; ++s) a[h][s] += w * x[s];
      }
    }
  }
  for (int h = 0; h < GT; ++h) {
#if defined(__AVX2__)
    if constexpr (kPermuted) {
      for (int s = 0; s < S; s += 2) simd::unpermute16(a[h][s], a[h][s + 1]);
    }
#endif
    for (int s = 0; s < S; ++s) simd::store<N>(acc + h * H + d0 + s * N, a[h][s]);
  }
}

template <int N, int GT, typename T>
void pv_tile(float* acc, const float* p, int64_t padded, const Item<T>& it, const Geometry& g,
             Lookahead<T>* la) {
  // zmm: 4 vectors per head (16 accumulators for 4 heads); ymm/xmm have 16 registers in all.
  constexpr int S = N == 16 ? 4 : 2;
  int64_t d0 = 0;
  for (; d0 + S * N <= g.head_size; d0 += S * N) pv_slice<N, GT, S>(acc, p, padded, d0, it, g, d0 ? nullptr : la);
  for (; d0 < g.head_size; d0 += N) pv_slice<N, GT, 1>(acc, p, padded, d0, it, g, d0 ? nullptr : la);
}

// acc[h][:] = sum_j p[h][j] * v_j for every head of the group, in tiles of up to kMaxTile heads.
template <int N, typename T>
void pv(float* acc,      // [group, head_size]
        const float* p,  // [group, padded]
        int64_t padded, const Item<T>& it, const Geometry& g, Lookahead<T>& la) {
  for (int64_t h0 = 0; h0 < g.group; h0 += kMaxTile) {
    float* a = acc + h0 * g.head_size;
    const float* ph = p + h0 * padded;
    Lookahead<T>* l = h0 ? nullptr : &la;
    switch (std::min<int64_t>(kMaxTile, g.group - h0)) {
      case 1: pv_tile<N, 1>(a, ph, padded, it, g, l); break;
      case 2: pv_tile<N, 2>(a, ph, padded, it, g, l); break;
      case 3: pv_tile<N, 3>(a, ph, padded, it, g, l); break;
      default: pv_tile<N, 4>(a, ph, padded, it, g, l); break;
    }
  }
}

// Attention of the item's group over its span: unnormalized acc [group, head_size]
// plus each head's max logit and sum of exp(l - max). logits: [group, padded] scratch.
// la: the thread's lookahead, with `it` pushed and reader_at() it.
template <int N, typename T>
void attend(float* acc, float* max_logit, float* sum, float* logits, const Item<T>& it, const Geometry& g,
            Lookahead<T>& la) {
  const int64_t len = it.end - it.begin, padded = (len + N - 1) / N * N;
  qk<N>(logits, padded, it, g, la);
  for (int64_t h = 0; h < g.group; ++h) {
    max_logit[h] = softmax_numerators<N>(logits + h * padded, len, padded, sum + h);
  }
  pv<N>(acc, logits, padded, it, g, la);
}

}  // namespace attn
}  // namespace cpu
}  // namespace pagedserve
