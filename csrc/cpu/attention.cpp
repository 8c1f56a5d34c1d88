// CPU paged decode attention.
//
// One work item is (sequence, kv head): all query heads that share a kv head
// (GQA) are processed together so each K/V row is loaded once and reused.
// The inner loops use AVX2/FMA/F16C intrinsics when the build targets them
// (engine/ops.py adds -mavx2 -mfma -mf16c where the CPU has them; gcc did not
// auto-vectorize these reductions reliably) and plain loops otherwise.
// Accumulation is float32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

constexpr int kLanes = 8;  // one AVX2 register of float32

// Storage -> float32 for one contiguous run of n values.
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the top half of a float32: a shift, which vectorizes.
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(wide, 16));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDSERVE_AVX2
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

// Dot products of one query with four key rows: four independent FMA chains
// keep the pipeline busy where a single chain would wait on its own latency.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                 int64_t n, float* result) {
  float a0[kLanes] = {}, a1[kLanes] = {}, a2[kLanes] = {}, a3[kLanes] = {};
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps(), v2 = _mm256_setzero_ps(), v3 = _mm256_setzero_ps();
  for (; d + kLanes <= n; d += kLanes) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    v0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), v0);
    v1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), v1);
    v2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), v2);
    v3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), v3);
  }
  _mm256_storeu_ps(a0, v0);
  _mm256_storeu_ps(a1, v1);
  _mm256_storeu_ps(a2, v2);
  _mm256_storeu_ps(a3, v3);
#endif
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      a0[j] += q[d + j] * k0[d + j];
      a1[j] += q[d + j] * k1[d + j];
      a2[j] += q[d + j] * k2[d + j];
      a3[j] += q[d + j] * k3[d + j];
    }
  }
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  for (; d < n; ++d) {
    s[0] += q[d] * k0[d];
    s[1] += q[d] * k1[d];
    s[2] += q[d] * k2[d];
    s[3] += q[d] * k3[d];
  }
  for (int j = 0; j < kLanes; ++j) {
    s[0] += a0[j];
    s[1] += a1[j];
    s[2] += a2[j];
    s[3] += a3[j];
  }
  std::memcpy(result, s, sizeof(s));
}

inline float dot1(const float* q, const float* k, int64_t n) {
  float a[kLanes] = {};
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 v = _mm256_setzero_ps();
  for (; d + kLanes <= n; d += kLanes) v = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), v);
  _mm256_storeu_ps(a, v);
#endif
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) a[j] += q[d + j] * k[d + j];
  }
  float s = 0.f;
  for (; d < n; ++d) s += q[d] * k[d];
  for (int j = 0; j < kLanes; ++j) s += a[j];
  return s;
}

// acc += w0 * v0 + w1 * v1: two rows per pass halve the traffic on acc.
inline void axpy2(float* acc, float w0, const float* v0, float w1, const float* v1, int64_t n) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  const __m256 x0 = _mm256_set1_ps(w0), x1 = _mm256_set1_ps(w1);
  for (; d + kLanes <= n; d += kLanes) {
    const __m256 a = _mm256_fmadd_ps(x0, _mm256_loadu_ps(v0 + d), _mm256_loadu_ps(acc + d));
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(x1, _mm256_loadu_ps(v1 + d), a));
  }
#endif
  for (; d < n; ++d) acc[d] += w0 * v0[d] + w1 * v1[d];
}

inline void axpy1(float* acc, float w0, const float* v0, int64_t n) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  const __m256 x0 = _mm256_set1_ps(w0);
  for (; d + kLanes <= n; d += kLanes) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(x0, _mm256_loadu_ps(v0 + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < n; ++d) acc[d] += w0 * v0[d];
}

// acc[0:H] += sum_t p[t] * v[t]: each 32-wide slice of acc stays in four registers
// across all n rows of a block, instead of a load and a store per row pair.
inline void weighted_rows(float* acc, const float* p, const float* v, int64_t n, int64_t H) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX2
  for (; d + 4 * kLanes <= H; d += 4 * kLanes) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(p[t]);
      const float* row = v + t * H + d;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
#endif
  if (d == H) return;
  int64_t t = 0;  // head sizes that are not a multiple of 32: the rest, two rows per pass
  for (; t + 2 <= n; t += 2) axpy2(acc + d, p[t], v + t * H + d, p[t + 1], v + (t + 1) * H + d, H - d);
  if (t < n) axpy1(acc + d, p[t], v + t * H + d, H - d);
}

// exp(x - m) for a row of n logits, written in place. AVX2: Cephes' expf polynomial on
// eight lanes (relative error < 2e-7, as glibc's), instead of one libm call per logit.
inline void exp_shifted(float* l, float m, int64_t n) {
  int64_t t = 0;
#ifdef PAGEDSERVE_AVX2
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f), one = _mm256_set1_ps(1.f);
  for (; t + kLanes <= n; t += kLanes) {
    __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(l + t), vm), lo);  // x <= 0
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(k, c2, _mm256_fnmadd_ps(k, c1, x));  // x - k ln2 in two parts
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), one);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(l + t, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
#endif
  for (; t < n; ++t) l[t] = std::exp(l[t] - m);
}

// Per-thread buffers, reused across work items.
struct Scratch {
  std::vector<float> query;   // [group, head_size], pre-scaled
  std::vector<float> logits;  // [group, context_len]
  std::vector<float> rows;    // [block_size, head_size] converted K or V block
  std::vector<float> acc;     // [group, head_size]
  std::vector<float> inv_sum; // [group]
};

struct Shapes {
  int64_t num_kv_heads, group, head_size, block_size, max_blocks;
  int64_t q_stride_seq, q_stride_head;  // query may be a strided view
  float scale;
};

// Returns the float32 rows of one (block, kv head): the cache itself for
// float32, else a converted copy in scratch.
template <typename T>
inline const float* block_rows(const T* cache, int64_t block, int64_t kv_head, int64_t n, const Shapes& sh,
                               std::vector<float>& buf) {
  const T* src = cache + (block * sh.num_kv_heads + kv_head) * sh.block_size * sh.head_size;
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, buf.data(), n * sh.head_size);
    return buf.data();
  }
}

template <typename T>
void attend_one(T* out,                  // [num_seqs, num_heads, head_size]
                const T* query,          // [num_seqs, num_heads, head_size] (strided)
                const T* key_cache,      // [num_blocks, num_kv_heads, block_size, head_size]
                const T* value_cache,    // [num_blocks, num_kv_heads, block_size, head_size]
                const int32_t* table,    // [max_blocks] this sequence's block table
                int64_t context_len, int64_t seq, int64_t kv_head, const Shapes& sh, Scratch& sc) {
  const int64_t G = sh.group, H = sh.head_size, B = sh.block_size;
  const int64_t first_head = kv_head * G;
  T* out_rows = out + (seq * sh.num_kv_heads * G + first_head) * H;
  if (context_len <= 0) {  // nothing to attend to: defined as zeros
    std::fill(sc.acc.begin(), sc.acc.begin() + G * H, 0.f);
    from_float(sc.acc.data(), out_rows, G * H, 1.f);
    return;
  }
  sc.logits.resize(G * context_len);
  for (int64_t g = 0; g < G; ++g) {
    const T* q = query + seq * sh.q_stride_seq + (first_head + g) * sh.q_stride_head;
    to_float(q, sc.query.data() + g * H, H);
    for (int64_t d = 0; d < H; ++d) sc.query[g * H + d] *= sh.scale;
  }

  // Pass 1: logits = (scale * q) . k for every cached token.
  const int64_t num_blocks = (context_len + B - 1) / B;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = std::min(B, context_len - b * B);
    const float* k = block_rows(key_cache, table[b], kv_head, n, sh, sc.rows);
    for (int64_t g = 0; g < G; ++g) {
      const float* q = sc.query.data() + g * H;
      float* l = sc.logits.data() + g * context_len + b * B;
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) dot4(q, k + t * H, k + (t + 1) * H, k + (t + 2) * H, k + (t + 3) * H, H, l + t);
      for (; t < n; ++t) l[t] = dot1(q, k + t * H, H);
    }
  }

  // Safe softmax: subtract the max so exp never overflows.
  std::vector<float>& inv_sum = sc.inv_sum;
  for (int64_t g = 0; g < G; ++g) {
    float* l = sc.logits.data() + g * context_len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < context_len; ++t) m = std::max(m, l[t]);
    exp_shifted(l, m, context_len);
    float sum = 0.f;
    for (int64_t t = 0; t < context_len; ++t) sum += l[t];
    inv_sum[g] = 1.f / sum;
  }

  // Pass 2: out = sum_t p_t * v_t, normalized once at the end.
  std::fill(sc.acc.begin(), sc.acc.begin() + G * H, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = std::min(B, context_len - b * B);
    const float* v = block_rows(value_cache, table[b], kv_head, n, sh, sc.rows);
    for (int64_t g = 0; g < G; ++g) {
      const float* p = sc.logits.data() + g * context_len + b * B;
      weighted_rows(sc.acc.data() + g * H, p, v, n, H);
    }
  }
  for (int64_t g = 0; g < G; ++g) from_float(sc.acc.data() + g * H, out_rows + g * H, H, inv_sum[g]);
}

template <typename T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const int32_t* tables, const int32_t* lens,
                          const Shapes& sh, int64_t num_seqs) {
  T* out_ptr = reinterpret_cast<T*>(out.data_ptr());
  const T* q_ptr = reinterpret_cast<const T*>(query.data_ptr());
  const T* k_ptr = reinterpret_cast<const T*>(key_cache.data_ptr());
  const T* v_ptr = reinterpret_cast<const T*>(value_cache.data_ptr());
  const int64_t num_items = num_seqs * sh.num_kv_heads;
#pragma omp parallel
  {
    Scratch sc;
    sc.query.resize(sh.group * sh.head_size);
    sc.rows.resize(sh.block_size * sh.head_size);
    sc.acc.resize(sh.group * sh.head_size);
    sc.inv_sum.resize(sh.group);
    // Dynamic: context lengths differ between sequences.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t seq = item / sh.num_kv_heads;
      const int64_t kv_head = item % sh.num_kv_heads;
      attend_one<T>(out_ptr, q_ptr, k_ptr, v_ptr, tables + seq * sh.max_blocks, lens[seq], seq, kv_head, sh, sc);
    }
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
    double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "out/query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key/value cache must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && out.is_contiguous(),
              "out and the caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1, "query head vectors must be contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "out, query and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0), num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "cache head_size ", key_cache.size(3), " != query head_size ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs, "block_tables must be [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs, "context_lens must be [num_seqs]");
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  // Validate up front: a bad block id would read outside the cache.
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(len_ptr[s] <= max_blocks * block_size, "context_lens[", s, "] = ", len_ptr[s],
                " exceeds its block table");
    for (int64_t b = 0; b * block_size < len_ptr[s]; ++b) {
      const int32_t id = table_ptr[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, "][", b, "] = ", id, " is outside the cache");
    }
  }
  const Shapes sh{num_kv_heads, num_heads / num_kv_heads, head_size, block_size, max_blocks,
                  query.stride(0), query.stride(1), static_cast<float>(scale)};
  switch (dtype) {
    case at::kFloat:
      paged_attention_impl<float>(out, query, key_cache, value_cache, table_ptr, len_ptr, sh, num_seqs);
      break;
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(out, query, key_cache, value_cache, table_ptr, len_ptr, sh, num_seqs);
      break;
    case at::kHalf:
      paged_attention_impl<c10::Half>(out, query, key_cache, value_cache, table_ptr, len_ptr, sh, num_seqs);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", dtype);
  }
}

}  // namespace cpu
}  // namespace pagedserve
