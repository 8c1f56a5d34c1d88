// CPU paged decode attention: the op's checks, the split of the work over
// OpenMP threads, and the final normalization. The math of one work item (a
// kv-head group over a span of one sequence) is in attention_item.h.
//
// Work items are (sequence, kv head). With fewer items than threads can share
// evenly (small batches), each context is also cut into spans of whole blocks,
// attended separately and merged by their max logit and softmax sum (as
// flash-decoding does): batch 1 then still uses every thread.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "attention_item.h"
#include "parallel.h"

namespace pagedserve {
namespace cpu {

namespace {

using attn::Geometry;
using attn::Item;

// Below this many multiply-adds (one pass, QK or PV) a call stays on the calling
// thread: waking the OpenMP team (parallel.h) costs more than it saves. In a decode
// step each layer's cache is read cold (megabytes of weights went through the caches
// since), so one thread is slower than on a warm cache: at 1 to 4 sequences of 128-528
// tokens, splitting from 64k (with 64-token spans) took 4-10 % off the whole step, where
// the old 1M / 256-token limits kept them on one thread (docs/benchmarks.md, 2026-11-25).
constexpr int64_t kParallelMinWork = int64_t{1} << 16;
constexpr int64_t kMinSpan = 64;        // tokens: shorter spans cost more to merge than they save

struct Plan {
  int64_t span;       // tokens per work item (a multiple of block_size unless num_spans == 1)
  int64_t num_spans;  // per sequence
  bool parallel;
};

// Contexts longer than this are cut into spans of it (rounded up to whole blocks), whatever the batch: a
// sequence's result then depends on its own context only, never on what else the step holds. Speculative
// decoding verifies k + 1 rows of one sequence in a step and must give the bits one row gives alone (the same
// greedy tokens); a plan sized by the batch (as before: fewer items than threads -> more spans) did not. At one
// sequence of 128-528 tokens this is about the split the batch-sized plan chose (3 kv heads x 1-3 spans).
constexpr int64_t kSpanTokens = 256;

// begins[s]: the first token sequence s attends to (0, or the start of its sliding window).
Plan make_plan(const int32_t* lens, const int32_t* begins, int64_t num_seqs, const Geometry& g) {
  int64_t max_len = 1, total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    max_len = std::max<int64_t>(max_len, lens[s] - begins[s]);
    total += lens[s] - begins[s];
  }
  const int64_t threads = omp_get_max_threads();
  const bool parallel = threads > 1 && total * g.num_kv_heads * g.group * g.head_size >= kParallelMinWork;
  const int64_t span = (std::max(kMinSpan, kSpanTokens) + g.block_size - 1) / g.block_size * g.block_size;
  if (span < max_len) return Plan{span, (max_len + span - 1) / span, parallel};
  return Plan{max_len, 1, parallel};
}

// Per-thread buffers, grown as needed and kept across calls.
struct Scratch {
  std::vector<float> logits;     // [group, span rounded up to N]
  std::vector<float> acc;        // [group, head_size]
  std::vector<float> max_logit;  // [group]
  std::vector<float> sum;        // [group]
};

template <int N, typename T>
void write_rows(T* out,            // [group, head_size] of one sequence's output
                const float* acc,  // [group, head_size]
                const float* sum, const Geometry& g) {
  for (int64_t h = 0; h < g.group; ++h) {
    const float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;  // no context: zeros
    for (int64_t d = 0; d < g.head_size; d += N) {
      simd::store<N>(out + h * g.head_size + d, simd::load<N>(acc + h * g.head_size + d) * inv);
    }
  }
}

// Merges the spans of one (sequence, head): out = sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i.
template <typename T>
void merge_spans(T* out,               // [head_size]
                 const float* states,  // [num_spans, head_size + 2]: acc, max logit, sum
                 int64_t num_spans, int64_t head_size, float* row) {
  const int64_t stride = head_size + 2;
  float m = -std::numeric_limits<float>::infinity(), total = 0.f;
  for (int64_t i = 0; i < num_spans; ++i) {
    if (states[i * stride + head_size + 1] > 0.f) m = std::max(m, states[i * stride + head_size]);
  }
  std::fill(row, row + head_size, 0.f);
  for (int64_t i = 0; i < num_spans; ++i) {
    const float* st = states + i * stride;
    if (st[head_size + 1] <= 0.f) continue;  // an empty span
    const float w = std::exp(st[head_size] - m);
    total += w * st[head_size + 1];
    for (int64_t d = 0; d < head_size; ++d) row[d] += w * st[d];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int64_t d = 0; d < head_size; ++d) out[d] = static_cast<T>(row[d] * inv);
}

template <int N, typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const int32_t* tables, int64_t max_blocks, const int32_t* lens, const int32_t* begins, int64_t num_seqs,
         const Geometry& g) {
  T* out_ptr = reinterpret_cast<T*>(out.data_ptr());
  const T* q_ptr = reinterpret_cast<const T*>(query.data_ptr());
  const T* k_ptr = reinterpret_cast<const T*>(key_cache.data_ptr());
  const T* v_ptr = reinterpret_cast<const T*>(value_cache.data_ptr());
  const Plan plan = make_plan(lens, begins, num_seqs, g);
  const int64_t H = g.head_size, heads = g.num_kv_heads * g.group;
  const int64_t num_items = num_seqs * g.num_kv_heads * plan.num_spans;
  // Span results [num_seqs, num_heads, num_spans, head_size + 2], only when contexts are split.
  // (Kept across calls: every layer of every step asks for one; only its first call per size allocates.)
  // A pointer, not the vector: inside the parallel region a thread_local names each thread's own.
  static thread_local std::vector<float> kept;
  if (plan.num_spans > 1 && kept.size() < static_cast<size_t>(num_items * g.group * (H + 2))) {
    kept.resize(num_items * g.group * (H + 2));
  }
  float* const states = kept.data();
  std::atomic<int64_t> next{0};
#pragma omp parallel if (plan.parallel)
  {
    static thread_local Scratch sc;
    sc.logits.resize(std::max<size_t>(sc.logits.size(), g.group * ((plan.span + N - 1) / N * N)));
    sc.acc.resize(g.group * H);
    sc.max_logit.resize(g.group);
    sc.sum.resize(g.group);
    struct Where {
      int64_t seq, kv_head, span;
    };
    auto where = [&](int64_t item) {
      return Where{item / (g.num_kv_heads * plan.num_spans), item / plan.num_spans % g.num_kv_heads,
                   item % plan.num_spans};
    };
    auto item_of = [&](int64_t item) {
      const auto [seq, kv_head, span] = where(item);
      return Item<T>{q_ptr + seq * g.q_stride_seq + kv_head * g.group * g.q_stride_head, k_ptr, v_ptr,
                     tables + seq * max_blocks, kv_head, begins[seq] + span * plan.span,
                     std::min<int64_t>(lens[seq], begins[seq] + (span + 1) * plan.span)};
    };
    attn::Lookahead<T> la(g);  // this thread's rows, read ahead: its item, then the next it takes
    share_items_ahead(next, num_items, [&](int64_t item, int64_t index, int64_t following) {
      const Item<T> it = item_of(item);
      if (index == 0) la.push(it);
      if (following >= 0) la.push(item_of(following));
      la.reader_at(index);
      const auto [seq, kv_head, span] = where(item);
      std::fill(sc.sum.begin(), sc.sum.end(), 0.f);
      if (it.end > it.begin) {
        attn::attend<N>(sc.acc.data(), sc.max_logit.data(), sc.sum.data(), sc.logits.data(), it, g, la);
      } else {
        std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
      }
      if (plan.num_spans == 1) {
        write_rows<N>(out_ptr + (seq * heads + kv_head * g.group) * H, sc.acc.data(), sc.sum.data(), g);
        return;
      }
      for (int64_t h = 0; h < g.group; ++h) {  // -> states[seq, kv_head * group + h, span]
        float* st = states + (((seq * heads + kv_head * g.group + h) * plan.num_spans) + span) * (H + 2);
        std::copy(sc.acc.begin() + h * H, sc.acc.begin() + (h + 1) * H, st);
        st[H] = sc.max_logit[h];
        st[H + 1] = sc.sum[h];
      }
    });
  }
  if (plan.num_spans > 1) {  // a few rows: on the calling thread, no second wake-up of the team
    std::vector<float> row(H);
    for (int64_t r = 0; r < num_seqs * heads; ++r) {
      merge_spans(out_ptr + r * H, states + r * plan.num_spans * (H + 2), plan.num_spans, H, row.data());
    }
  }
}

template <typename T>
void dispatch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const int32_t* tables, int64_t max_blocks, const int32_t* lens, const int32_t* begins, int64_t num_seqs,
              const Geometry& g) {
  // The widest vectors that tile a head; other head sizes run one lane at a time.
  if (g.head_size % simd::kNative == 0) {
    run<simd::kNative, T>(out, query, key_cache, value_cache, tables, max_blocks, lens, begins, num_seqs, g);
  } else {
    run<1, T>(out, query, key_cache, value_cache, tables, max_blocks, lens, begins, num_seqs, g);
  }
}

}  // namespace

void paged_attention(
    at::Tensor& out,                 // [num_seqs, num_heads, head_size]
    const at::Tensor& query,         // [num_seqs, num_heads, head_size]
    const at::Tensor& key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
    const at::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq] int32
    const at::Tensor& context_lens,  // [num_seqs] int32
    double scale,
    int64_t sliding_window,
    double softcap) {
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0: none)");
  checks::paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, sliding_window);
  const auto dtype = query.scalar_type();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  // Each query sees its last sliding_window tokens (itself included); blocks before that are never read,
  // and may have been released. Validate the rest up front: a bad block id would read outside the cache.
  std::vector<int32_t> begins(num_seqs, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(len_ptr[s] >= 0 && len_ptr[s] <= max_blocks * block_size, "context_lens[", s, "] = ", len_ptr[s],
                " is negative or exceeds its block table");
    if (sliding_window > 0) begins[s] = static_cast<int32_t>(std::max<int64_t>(0, len_ptr[s] - sliding_window));
    for (int64_t b = begins[s] / block_size; b * block_size < len_ptr[s]; ++b) {
      const int32_t id = table_ptr[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, "][", b, "] = ", id, " is outside the cache");
    }
  }
  const Geometry g{num_kv_heads, num_heads / num_kv_heads, head_size, block_size,
                   query.stride(0), query.stride(1), static_cast<float>(scale), static_cast<float>(softcap)};
  switch (dtype) {
    case at::kFloat:
      return dispatch<float>(out, query, key_cache, value_cache, table_ptr, max_blocks, len_ptr, begins.data(),
                             num_seqs, g);
    case at::kBFloat16:
      return dispatch<c10::BFloat16>(out, query, key_cache, value_cache, table_ptr, max_blocks, len_ptr, begins.data(),
                                      num_seqs, g);
    case at::kHalf:
      return dispatch<c10::Half>(out, query, key_cache, value_cache, table_ptr, max_blocks, len_ptr, begins.data(),
                                  num_seqs, g);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", dtype);
  }
}

}  // namespace cpu
}  // namespace pagedserve
