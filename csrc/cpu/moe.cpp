// A mixture-of-experts MLP on CPU: each token's top-k experts (gated SiLU MLPs), weighted and summed.
//
// The tokens are grouped by expert (a counting sort of the (token, slot) pairs), so each selected expert's weights
// are read once for all the rows routed to it: a decode step with R rows and top-k reads at most min(E, R * k)
// experts, each once, instead of R * k. Each expert's rows are gathered into one contiguous block and run through
// the dense linears' kernels: small_gemm_glu / small_gemm (float32, bfloat16: csrc/cpu/small_gemm.cpp, whose tiles
// serve one row to a prefill's thousands), q8_gemm + silu_and_mul (Q8_0 int8 weights: csrc/cpu/q8_gemm.cpp, its
// panel path for many rows) or kquant_gemm + silu_and_mul (a GGUF's Q4_K / Q6_K / Q5_0 / ... experts in their own
// blocks, one formats.py pack_parts blob an expert: csrc/cpu/kquant_gemm.cpp, its panels for many rows; gate | up
// and down may differ in type, as a Q4_K_M file's Q4_K gate / up and Q6_K down). The weights of all experts are
// stacked, each expert's in the packed form the dense kernel reads (engine/model_executor/layers/moe.py packs them
// at load); one tensor's experts share a type, so its packed rows are equal-sized. The weighted sum is kept in
// float32 in expert order (HF's index_add_ order) and rounded once to the activations' dtype, so `out` may be `x`
// itself (the compiled decode step's MLP writes over its input rows). moe_route is HF's router after the gate's
// logits (softmax in float32, top-k, renormalised, rounded), moe_forward the two in one call.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ops/empty.h>

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

// Bytes of expert weights the experts' GEMMs were given since the last moe_bytes_read(true): what a step streams
// (benchmarks/profile_step.py sets it against the active parameters' bytes).
std::atomic<int64_t> expert_bytes{0};

bool quantized(const at::Tensor& w) { return w.scalar_type() == at::kByte || w.scalar_type() == at::kChar; }

// A linear over one expert's packed weight: Q8_0 (uint8), a GGML block-format blob (int8; `isa` picks
// kquant_gemm's path, 0 the best) or small_gemm's float32 / bfloat16 form.
void expert_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t isa) {
  if (w.scalar_type() == at::kByte) {
    q8_gemm(out, x, w, c10::nullopt, 0);
  } else if (w.scalar_type() == at::kChar) {
    kquant_gemm(out, x, w, c10::nullopt, isa);
  } else {
    small_gemm(out, x, w, c10::nullopt, 0);
  }
}

template <typename T>
void scatter_add(float* acc, int64_t hidden, const T* y, const int64_t* tokens, const float* weights, int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    float* dst = acc + tokens[r] * hidden;
    const T* src = y + r * hidden;
    const float w = weights[r];
#pragma omp simd
    for (int64_t h = 0; h < hidden; ++h) dst[h] += w * static_cast<float>(src[h]);
  }
}

template <typename T>
void gather_rows(T* dst, const T* x, int64_t x_stride, int64_t hidden, const int64_t* tokens, int64_t n) {
  for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * hidden, x + tokens[r] * x_stride, hidden * sizeof(T));
}

template <typename T>
void store_rows(at::Tensor& out, const float* acc, int64_t t, int64_t hidden) {
  T* o = out.data_ptr<T>();
  for (int64_t i = 0; i < t; ++i) {
    T* row = o + i * out.stride(0);
    const float* a = acc + i * hidden;
    for (int64_t h = 0; h < hidden; ++h) row[h] = static_cast<T>(a[h]);
  }
}

}  // namespace

void moe_route(const at::Tensor& logits, int64_t top_k, bool renormalize, bool round_bf16, at::Tensor& ids,
               at::Tensor& weights) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "moe_route: logits [T, E] float32 or bfloat16, rows contiguous");
  const int64_t t = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k ", top_k, " of ", experts, " experts");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && ids.is_contiguous() &&
                  weights.is_contiguous() && ids.numel() == t * top_k && weights.numel() == t * top_k,
              "moe_route: ids [T, k] int64 and weights [T, k] float32, contiguous");
  std::vector<float> probs(experts);
  std::vector<char> taken(experts);
  int64_t* id = ids.data_ptr<int64_t>();
  float* w = weights.data_ptr<float>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  for (int64_t i = 0; i < t; ++i) {
    // softmax in float32 (HF: softmax(logits.float())), then the k largest, first index first among equals
    float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      probs[e] = bf16 ? static_cast<float>(logits.data_ptr<c10::BFloat16>()[i * logits.stride(0) + e])
                      : logits.data_ptr<float>()[i * logits.stride(0) + e];
      top = std::max(top, probs[e]);
    }
    for (int64_t e = 0; e < experts; ++e) sum += (probs[e] = std::exp(probs[e] - top));
    for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      }
      taken[best] = 1;
      id[i * top_k + j] = best;
      w[i * top_k + j] = probs[best];
      chosen += probs[best];
    }
    for (int64_t j = 0; j < top_k; ++j) {
      float& v = w[i * top_k + j];
      if (renormalize) v /= chosen;
      if (round_bf16) v = static_cast<float>(c10::BFloat16(v));  // HF rounds them to the model's dtype
    }
  }
}

void moe_forward(at::Tensor& out, const at::Tensor& x, const at::Tensor& logits, const at::Tensor& w13,
                 const at::Tensor& w2, int64_t inter, int64_t top_k, bool renormalize, bool round_weights) {
  const int64_t t = x.size(0);
  at::Tensor ids = at::empty({t, top_k}, x.options().dtype(at::kLong));
  at::Tensor weights = at::empty({t, top_k}, x.options().dtype(at::kFloat));
  moe_route(logits, top_k, renormalize, round_weights && x.scalar_type() == at::kBFloat16, ids, weights);
  moe_experts(out, x, ids, weights, w13, w2, inter, 0);
}

void moe_experts(at::Tensor& out, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                 const at::Tensor& w13, const at::Tensor& w2, int64_t inter, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "moe_experts: x and out [T, hidden], one dtype, rows contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moe_experts: float32 or bfloat16 activations, got ", x.scalar_type());
  const int64_t t = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == t && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "moe_experts: topk_ids [T, k] int64, contiguous");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "moe_experts: topk_weights [T, k] float32, contiguous");
  // float weights of one dtype, or quantized ones of any two forms (Q4_K gate | up blobs over Q8_0 down rows)
  TORCH_CHECK(w13.dim() == 2 && w2.dim() == 2 && w13.size(0) == w2.size(0) && w13.is_contiguous() &&
                  w2.is_contiguous() &&
                  (w13.scalar_type() == w2.scalar_type() || (quantized(w13) && quantized(w2))),
              "moe_experts: w13 and w2 [E, packed] of one float dtype or both quantized, contiguous");
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && topk_ids.device().is_cpu(), "moe_experts: CPU tensors");
  const int64_t experts = w13.size(0), k = topk_ids.size(1);
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* gates = topk_weights.data_ptr<float>();

  // Counting sort of the (token, slot) pairs by expert, tokens ascending within an expert.
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t i = 0; i < t * k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < experts, "moe_experts: expert id ", ids[i], " out of [0, ", experts, ")");
    ++start[ids[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> tokens(t * k), fill(start.begin(), start.end() - 1);
  std::vector<float> weights(t * k);
  for (int64_t i = 0; i < t * k; ++i) {
    const int64_t slot = fill[ids[i]]++;
    tokens[slot] = i / k;
    weights[slot] = gates[i];
  }
  int64_t most = 0;  // an expert holds each token at most once (top-k ids are distinct)
  for (int64_t e = 0; e < experts; ++e) most = std::max(most, start[e + 1] - start[e]);

  const auto opts = x.options();
  std::vector<float> acc(t * hidden, 0.0f);
  at::Tensor xs = at::empty({most, hidden}, opts), act = at::empty({most, inter}, opts);
  at::Tensor y = at::empty({most, hidden}, opts), gate_up;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;  // never read: an expert no token chose
    const int64_t* rows = tokens.data() + start[e];
    at::Tensor xe = xs.narrow(0, 0, n), ae = act.narrow(0, 0, n), ye = y.narrow(0, 0, n);
    if (bf16) {
      gather_rows(xe.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0), hidden, rows, n);
    } else {
      gather_rows(xe.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), hidden, rows, n);
    }
    const at::Tensor we13 = w13.select(0, e), we2 = w2.select(0, e);
    // every byte of the expert's packed rows is streamed once (a blob's 64-128-byte header and its columns padded
    // to 16 included), whatever the row count: taller tiles re-read a column block from cache, not memory
    expert_bytes.fetch_add(we13.nbytes() + we2.nbytes(), std::memory_order_relaxed);
    // gate | up and silu(gate) * up in one pass where the path has fused tiles (float weights, AVX-512)
    if (quantized(w13) || !small_gemm_glu(ae, xe, we13, c10::nullopt, 0)) {
      if (!gate_up.defined()) gate_up = at::empty({most, 2 * inter}, opts);
      at::Tensor gu = gate_up.narrow(0, 0, n);
      expert_linear(gu, xe, we13, isa);
      silu_and_mul(ae, gu);
    }
    expert_linear(ye, ae, we2, isa);
    if (bf16) {
      scatter_add(acc.data(), hidden, ye.data_ptr<c10::BFloat16>(), rows, weights.data() + start[e], n);
    } else {
      scatter_add(acc.data(), hidden, ye.data_ptr<float>(), rows, weights.data() + start[e], n);
    }
  }
  if (bf16) {
    store_rows<c10::BFloat16>(out, acc.data(), t, hidden);
  } else {
    store_rows<float>(out, acc.data(), t, hidden);
  }
}

int64_t moe_bytes_read(bool reset) {
  return reset ? expert_bytes.exchange(0) : expert_bytes.load();
}

}  // namespace cpu
}  // namespace pagedserve
