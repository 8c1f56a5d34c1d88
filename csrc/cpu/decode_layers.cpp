// A CPU step's decoder layers as one C++ loop (the CPU twin of a captured CUDA graph), for every family the one
// decoder serves: the per-architecture spec (engine/model_executor/models/llama_args.py) reaches it as which
// weight slots are present (q/k norms, Gemma's norms of the attention and MLP outputs), a RoPE table per layer
// (Gemma 3's sliding and global layers) and the MLP's activation; no per-model path.
//
// The eager model (engine/model_executor/models/llama.py) runs each layer as ~12 Python-level op calls: that Python and dispatch
// cost ~150 us a layer, ~4.5 ms a step of SmolLM2's 30 layers, next to ~14 ms of weight reading in a decode step
// (docs/benchmarks.md, "Compiled decode step"). Here the same kernels are called directly, in the same order on
// the same buffers, so the result is bit-identical to the eager path's; only the calls between them are gone.
// One difference in the calls, not in the bits: the MLP's gate/up linear and its activation run as one fused
// kernel (small_gemm_glu, whose epilogue computes silu_and_mul's arithmetic) where the CPU path has one.
// Every linear is a small-row GEMM over its pack_small_rows weight, or an int8 one over Q8_0 weights (q8_gemm,
// engine/model_executor/layers/quant.py); a mixture-of-experts layer's MLP is its router and moe_forward
// (moe_mlp). A step may hold prefill spans (prompts, or chunks of them) before its decode tokens, as the
// eager step does.
#include <algorithm>

#include <c10/util/Exception.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

// A layer's tensors in `weights`, in this order (an absent bias or norm is an empty tensor). kPostNorm is the
// norm before the MLP (HF Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm); kAttnOutNorm and
// kMlpOutNorm are Gemma's norms of the attention and MLP outputs before their residual add; kSharedGateUp,
// kSharedDown and kSharedGate a mixture-of-experts layer's shared expert (Qwen2-MoE) and its gate's float weight.
enum Slot : int64_t {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kAttnOutNorm, kPostNorm, kGateUp, kGateUpBias, kDown,
  kDownBias, kMlpOutNorm, kSharedGateUp, kSharedDown, kSharedGate, kSlots
};

// The MLP's activation of its gate (llama_args.py MLP_ACTS, in order).
enum MlpAct : int64_t { kSilu = 0, kGeluTanh = 1 };

// Rows of the MLP per pass in a long step (a multiple of small_gemm's 128-row chunk, so its passes are unchanged).
constexpr int64_t kMlpRows = 512;

c10::optional<at::Tensor> bias_of(const at::Tensor& b) {
  return b.defined() && b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt;
}

// A linear over its packed weight: int8 (engine/model_executor/layers/quant.py's uint8 Q8_0 form), GGML block formats
// (engine/model_executor/layers/formats.py's int8 blob of parts) or small_gemm's float32 / bfloat16.
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  if (w.scalar_type() == at::kByte) {
    q8_gemm(out, x, w, bias_of(bias), 0);
  } else if (w.scalar_type() == at::kChar) {
    kquant_gemm(out, x, w, bias_of(bias), 0);
  } else {
    small_gemm(out, x, w, bias_of(bias), 0);
  }
}

// A gated MLP on x's rows into out's: gate_up and its activation in one pass where the path has fused tiles (the
// same bits as the two calls), else gate_up into its buffer (made on first use) and the activation; then down.
void gated_mlp(at::Tensor& out_rows, const at::Tensor& x_rows, const at::Tensor& w_gate_up, const at::Tensor& b_gate_up,
               const at::Tensor& w_down, const at::Tensor& b_down, at::Tensor& act_rows, at::Tensor& gate_up,
               int64_t mlp_rows, int64_t mlp_act) {
  const int64_t n = x_rows.size(0), inter = act_rows.size(1);
  if (mlp_act != kSilu || w_gate_up.scalar_type() == at::kByte ||  // GELU or quantized weights: no fused tiles
      w_gate_up.scalar_type() == at::kChar || !small_gemm_glu(act_rows, x_rows, w_gate_up, bias_of(b_gate_up), 0)) {
    if (!gate_up.defined() || gate_up.size(1) != 2 * inter) gate_up = at::empty({mlp_rows, 2 * inter}, x_rows.options());
    at::Tensor gate_up_rows = gate_up.narrow(0, 0, n);
    linear(gate_up_rows, x_rows, w_gate_up, b_gate_up);
    if (mlp_act == kSilu) {
      silu_and_mul(act_rows, gate_up_rows);
    } else {
      gelu_tanh_and_mul(act_rows, gate_up_rows);
    }
  }
  linear(out_rows, act_rows, w_down, b_down);
}

// A mixture-of-experts layer's MLP slots (engine/model_executor/models/compiled_decode.py): kGateUp the router's
// packed weight, kGateUpBias int64 {intermediate, top_k, renormalize, round_weights, experts, shared intermediate}
// (its dtype marks the layer), kDown / kDownBias the stacked experts' gate | up and down (csrc/cpu/moe.cpp: float,
// uint8 Q8_0 or int8 blobs of GGML blocks, as moe.py / the GGUF loader packed them), and a
// shared expert's slots. In place on x's rows, as the eager MoEMLP computes it: moe_forward over the router's
// logits, + sigmoid(x . shared gate) * shared(x) (the same ATen calls for the gate as the eager torch ones).
void moe_mlp(at::Tensor& x_rows, const at::Tensor* w, at::Tensor& router_logits, int64_t mlp_rows, int64_t mlp_act,
             at::Tensor& shared_act, at::Tensor& shared_out, at::Tensor& shared_gate_up) {
  const int64_t* cfg = w[kGateUpBias].data_ptr<int64_t>();
  const int64_t n = x_rows.size(0);
  at::Tensor shared, gate;
  if (cfg[5] > 0) {  // the shared expert reads x before the experts overwrite it
    if (!shared_act.defined() || shared_act.size(1) != cfg[5]) {
      shared_act = at::empty({mlp_rows, cfg[5]}, x_rows.options());
      shared_out = at::empty({mlp_rows, x_rows.size(1)}, x_rows.options());
    }
    at::Tensor act_rows = shared_act.narrow(0, 0, n);
    shared = shared_out.narrow(0, 0, n);
    gated_mlp(shared, x_rows, w[kSharedGateUp], at::Tensor(), w[kSharedDown], at::Tensor(), act_rows, shared_gate_up,
              mlp_rows, mlp_act);
    gate = at::linear(x_rows, w[kSharedGate]);  // [n, 1]
  }
  if (!router_logits.defined() || router_logits.size(1) != cfg[4]) {
    router_logits = at::empty({mlp_rows, cfg[4]}, x_rows.options());
  }
  at::Tensor logits = router_logits.narrow(0, 0, n);
  small_gemm(logits, x_rows, w[kGateUp], c10::nullopt, 0);  // the router stays float (moe.py)
  moe_forward(x_rows, x_rows, logits, w[kDown], w[kDownBias], cfg[0], cfg[1], cfg[2] != 0, cfg[3] != 0);
  if (cfg[5] > 0) x_rows.add_(at::mul(at::sigmoid(gate), shared));
}

}  // namespace

int64_t decode_layer_slots() { return kSlots; }

at::Tensor llama_decode_layers(const at::Tensor& embeddings, const at::Tensor& positions,
                               const std::vector<at::Tensor>& cos_sins,
                               const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& key_caches,
                               const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping,
                               const std::vector<int64_t>& prefill_spans,
                               const std::vector<at::Tensor>& prefill_tables, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, const std::vector<int64_t>& windows,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t intermediate_size,
                               double eps, double scale, int64_t mlp_act, double softcap) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(cos_sins.size()) == layers, "llama_decode_layers: a RoPE table per layer");
  TORCH_CHECK(mlp_act == kSilu || mlp_act == kGeluTanh, "llama_decode_layers: unknown MLP activation ", mlp_act);
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.is_contiguous(), "llama_decode_layers: embeddings [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kSlots && value_caches.size() == key_caches.size() &&
                  static_cast<int64_t>(windows.size()) == layers,
              "llama_decode_layers: ", kSlots, " weights, a key cache, a value cache and a window per layer; got ",
              weights.size(), " weights, ", key_caches.size(), " and ", value_caches.size(), " caches, ",
              windows.size(), " windows");
  const int64_t t = embeddings.size(0), hidden = embeddings.size(1);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  TORCH_CHECK(positions.numel() == t && slot_mapping.numel() == t,
              "llama_decode_layers: one position and one slot per token");
  const int64_t spans = static_cast<int64_t>(prefill_tables.size());
  TORCH_CHECK(static_cast<int64_t>(prefill_spans.size()) == 3 * spans,
              "llama_decode_layers: a (start, end, context_len) triple and a table per prefill span");
  int64_t prefill_tokens = 0;  // the spans are contiguous from row 0, in order (the eager step's layout)
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t start = prefill_spans[3 * s], end = prefill_spans[3 * s + 1], context = prefill_spans[3 * s + 2];
    TORCH_CHECK(start == prefill_tokens && end > start && end <= t && context >= end - start,
                "llama_decode_layers: prefill span ", s, " is [", start, ", ", end, ") over ", context,
                " tokens after ", prefill_tokens, " prefill rows of ", t);
    prefill_tokens = end;
  }
  const int64_t decodes = t - prefill_tokens;
  TORCH_CHECK(decodes == 0 || (context_lens.numel() == decodes && block_tables.size(0) == decodes),
              "llama_decode_layers: a context length and a block table row per decode token (", decodes, ")");

  // The step's buffers, reused by every layer (the eager path allocates them per call).
  const auto opts = embeddings.options();
  at::Tensor residual = embeddings.clone();  // the stream: embeddings, then + each layer's attention and MLP outputs
  at::Tensor x = at::empty({t, hidden}, opts);
  at::Tensor qkv = at::empty({t, q_size + 2 * kv_size}, opts);
  at::Tensor attn = at::empty({t, num_heads, head_size}, opts);
  // The MLP runs kMlpRows rows at a time (its rows are independent): a 4096-token prefill step's gate_up and
  // activation buffers would otherwise be 75 MiB in float32, on top of the KV cache at a server's peak memory.
  const int64_t mlp_rows = std::min(t, kMlpRows);
  at::Tensor gate_up;  // [mlp_rows, 2 * intermediate_size], made only where small_gemm_glu declines
  at::Tensor act = at::empty({mlp_rows, intermediate_size}, opts);
  at::Tensor router_logits;  // [mlp_rows, experts], made at a mixture-of-experts model's first sparse layer
  at::Tensor shared_act, shared_out, shared_gate_up;  // a shared expert's buffers (Qwen2-MoE), made on first use
  // Strided views of qkv, as the eager model takes them.
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({t, num_heads + num_kv_heads, head_size});
  const at::Tensor q = qk.narrow(1, 0, num_heads);
  const at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_size});
  at::Tensor attn_rows = attn.view({t, q_size});
  // Per prefill span: its rows of the output, the query, and (no cached prefix) its own K/V seen as one block
  // [1, num_kv_heads, len, head_size] with the table {0}, as engine/model_executor/layers/attention.py's _prefill_cpu passes them.
  const at::Tensor one_block = at::zeros({1}, positions.options().dtype(at::kInt));
  std::vector<at::Tensor> span_out, span_q, span_k, span_v;
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t start = prefill_spans[3 * s], len = prefill_spans[3 * s + 1] - start;
    span_out.push_back(attn.narrow(0, start, len));
    span_q.push_back(q.narrow(0, start, len));
    span_k.push_back(k.narrow(0, start, len).transpose(0, 1).unsqueeze(0));
    span_v.push_back(v.narrow(0, start, len).transpose(0, 1).unsqueeze(0));
  }
  at::Tensor decode_out = attn.narrow(0, prefill_tokens, decodes);
  const at::Tensor decode_q = q.narrow(0, prefill_tokens, decodes);

  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kSlots;
    if (l == 0) {
      rms_norm(x, residual, w[kInputNorm], eps);
    } else {  // x holds the previous layer's MLP output
      fused_add_rms_norm(x, residual, w[kInputNorm], eps);
    }
    linear(qkv, x, w[kQkv], w[kQkvBias]);
    if (w[kQNorm].numel()) {  // Qwen3, Gemma 3: each head of q and k normed before RoPE
      at::Tensor q_heads = q, k_heads = k;
      rms_norm_heads(q_heads, w[kQNorm], eps);
      rms_norm_heads(k_heads, w[kKNorm], eps);
    }
    rotary_embedding(positions, qk, cos_sins[l]);
    at::Tensor key_cache = key_caches[l], value_cache = value_caches[l];
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping);
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t context = prefill_spans[3 * s + 2];
      if (prefill_tables[s].numel() == 0) {
        prefill_attention(span_out[s], span_q[s], span_k[s], span_v[s], one_block, context, scale, windows[l],
                          softcap);
      } else {  // the blocks hold the cached prefix and, just written, this span's K/V
        prefill_attention(span_out[s], span_q[s], key_cache, value_cache, prefill_tables[s], context, scale,
                          windows[l], softcap);
      }
    }
    if (decodes) {
      paged_attention(decode_out, decode_q, key_cache, value_cache, block_tables, context_lens, scale, windows[l],
                      softcap);
    }
    linear(x, attn_rows, w[kO], w[kOBias]);
    if (w[kAttnOutNorm].numel()) rms_norm(x, x, w[kAttnOutNorm], eps);  // in place, as the norm allows
    fused_add_rms_norm(x, residual, w[kPostNorm], eps);
    for (int64_t r = 0; r < t; r += mlp_rows) {  // x's rows r.. are read by gate_up before down overwrites them
      const int64_t n = std::min(mlp_rows, t - r);
      at::Tensor x_rows = x.narrow(0, r, n), act_rows = act.narrow(0, 0, n);
      if (w[kGateUpBias].scalar_type() == at::kLong) {  // a mixture-of-experts layer (moe_slots)
        moe_mlp(x_rows, w, router_logits, mlp_rows, mlp_act, shared_act, shared_out, shared_gate_up);
        continue;
      }
      gated_mlp(x_rows, x_rows, w[kGateUp], w[kGateUpBias], w[kDown], w[kDownBias], act_rows, gate_up, mlp_rows,
                mlp_act);
      if (w[kMlpOutNorm].numel()) rms_norm(x_rows, x_rows, w[kMlpOutNorm], eps);
    }
  }
  return layers ? residual.add_(x) : residual;
}

}  // namespace cpu
}  // namespace pagedserve
