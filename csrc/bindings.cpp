// The one file that registers pagedserve's compiled ops with Python.
// Each op dispatches on where its tensors live: CUDA tensors go to the CUDA
// kernels (only in a build with PAGEDSERVE_CUDA), everything else to the CPU.
#include <omp.h>
#include <torch/extension.h>

#include "ops.h"

namespace {

bool any_cuda(std::initializer_list<const torch::Tensor*> tensors) {
  for (const torch::Tensor* t : tensors) {
    if (t->is_cuda()) return true;
  }
  return false;
}

[[noreturn]] void no_cuda(const char* op) {
  TORCH_CHECK(false, op, ": got CUDA tensors, but this pagedserve build has no CUDA kernels");
}

void paged_attention(
    torch::Tensor& out,                 // [num_seqs, num_heads, head_size]
    const torch::Tensor& query,         // [num_seqs, num_heads, head_size]
    const torch::Tensor& key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
    const torch::Tensor& value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
    const torch::Tensor& block_tables,  // [num_seqs, max_blocks_per_seq] int32
    const torch::Tensor& context_lens,  // [num_seqs] int32
    double scale,
    int64_t sliding_window,             // 0: the whole context
    double softcap) {                   // 0: none; CPU only (engine/ops/__init__.py runs CUDA's on the reference)
  if (any_cuda({&out, &query, &key_cache, &value_cache})) {
#ifdef PAGEDSERVE_CUDA
    TORCH_CHECK(softcap == 0, "paged_attention: the CUDA kernel has no soft-cap");
    return pagedserve::cuda::paged_attention(out, query, key_cache, value_cache, block_tables,
                                             context_lens, scale, sliding_window);
#else
    no_cuda("paged_attention");
#endif
  }
  pagedserve::cpu::paged_attention(out, query, key_cache, value_cache, block_tables, context_lens,
                                   scale, sliding_window, softcap);
}

void reshape_and_cache(
    const torch::Tensor& key,           // [num_tokens, num_kv_heads, head_size]
    const torch::Tensor& value,         // [num_tokens, num_kv_heads, head_size]
    torch::Tensor& key_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    torch::Tensor& value_cache,         // [num_blocks, num_kv_heads, block_size, head_size]
    const torch::Tensor& slot_mapping)  // [num_tokens] int64
{
  if (any_cuda({&key, &value, &key_cache, &value_cache})) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
#else
    no_cuda("reshape_and_cache");
#endif
  }
  pagedserve::cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
}

void copy_blocks(
    std::vector<torch::Tensor>& key_caches,    // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    std::vector<torch::Tensor>& value_caches,  // num_layers x [num_blocks, num_kv_heads, block_size, head_size]
    const torch::Tensor& block_mapping)        // [num_pairs, 2] int64 (src, dst)
{
  if (!key_caches.empty() && key_caches[0].is_cuda()) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::copy_blocks(key_caches, value_caches, block_mapping);
#else
    no_cuda("copy_blocks");
#endif
  }
  pagedserve::cpu::copy_blocks(key_caches, value_caches, block_mapping);
}

void swap_blocks(
    const std::vector<torch::Tensor>& srcs,  // num_tensors x [num_src_blocks, ...]
    std::vector<torch::Tensor>& dsts,        // num_tensors x [num_dst_blocks, ...]
    const torch::Tensor& block_mapping)      // [num_pairs, 2] int64 (src, dst)
{
  bool cuda = false;
  for (const auto& t : srcs) cuda = cuda || t.is_cuda();
  for (const auto& t : dsts) cuda = cuda || t.is_cuda();
  if (cuda) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::swap_blocks(srcs, dsts, block_mapping);
#else
    no_cuda("swap_blocks");
#endif
  }
  pagedserve::cpu::swap_blocks(srcs, dsts, block_mapping);
}

void rms_norm(torch::Tensor& out,            // [num_tokens, hidden]
              const torch::Tensor& input,    // [num_tokens, hidden]
              const torch::Tensor& weight,   // [hidden]
              double eps) {
  if (any_cuda({&out, &input, &weight})) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::rms_norm(out, input, weight, eps);
#else
    no_cuda("rms_norm");
#endif
  }
  pagedserve::cpu::rms_norm(out, input, weight, eps);
}

void fused_add_rms_norm(torch::Tensor& input,          // [num_tokens, hidden]
                        torch::Tensor& residual,       // [num_tokens, hidden]
                        const torch::Tensor& weight,   // [hidden]
                        double eps) {
  if (any_cuda({&input, &residual, &weight})) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::fused_add_rms_norm(input, residual, weight, eps);
#else
    no_cuda("fused_add_rms_norm");
#endif
  }
  pagedserve::cpu::fused_add_rms_norm(input, residual, weight, eps);
}

void silu_and_mul(torch::Tensor& out,            // [num_tokens, d]
                  const torch::Tensor& input) {  // [num_tokens, 2 * d]
  if (any_cuda({&out, &input})) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::silu_and_mul(out, input);
#else
    no_cuda("silu_and_mul");
#endif
  }
  pagedserve::cpu::silu_and_mul(out, input);
}

void rotary_embedding(const torch::Tensor& positions,        // [num_tokens] int64
                      torch::Tensor& x,                      // [num_tokens, num_heads, head_size]
                      const torch::Tensor& cos_sin_cache) {  // [max_position, head_size] float32
  if (any_cuda({&positions, &x, &cos_sin_cache})) {
#ifdef PAGEDSERVE_CUDA
    return pagedserve::cuda::rotary_embedding(positions, x, cos_sin_cache);
#else
    no_cuda("rotary_embedding");
#endif
  }
  pagedserve::cpu::rotary_embedding(positions, x, cos_sin_cache);
}

// prefill_attention and argmax_logsumexp are CPU-only: engine/ops/__init__.py sends CUDA tensors to the torch reference.
void cpu_only(std::initializer_list<const torch::Tensor*> tensors, const char* op) {
  if (any_cuda(tensors)) no_cuda(op);
}

void gelu_tanh_and_mul(torch::Tensor& out, const torch::Tensor& input) {
  cpu_only({&out, &input}, "gelu_tanh_and_mul");
  pagedserve::cpu::gelu_tanh_and_mul(out, input);
}

void rms_norm_heads(torch::Tensor& x, const torch::Tensor& weight, double eps) {
  cpu_only({&x, &weight}, "rms_norm_heads");
  pagedserve::cpu::rms_norm_heads(x, weight, eps);
}

void prefill_attention(torch::Tensor& out,                 // [q_len, num_heads, head_size]
                       const torch::Tensor& query,         // [q_len, num_heads, head_size]
                       const torch::Tensor& key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
                       const torch::Tensor& value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
                       const torch::Tensor& block_table,   // [num_seq_blocks] int32
                       int64_t context_len, double scale,
                       int64_t sliding_window,             // 0: the whole context
                       double softcap) {                   // 0: none
  cpu_only({&out, &query, &key_cache, &value_cache}, "prefill_attention");
  pagedserve::cpu::prefill_attention(out, query, key_cache, value_cache, block_table, context_len, scale,
                                     sliding_window, softcap);
}

void argmax_logsumexp(const torch::Tensor& logits,  // [rows, vocab]
                      torch::Tensor& argmax,         // [rows] int64
                      torch::Tensor& logsumexp) {    // [rows] float32
  cpu_only({&logits, &argmax, &logsumexp}, "argmax_logsumexp");
  pagedserve::cpu::argmax_logsumexp(logits, argmax, logsumexp);
}

void small_gemm(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                const c10::optional<torch::Tensor>& bias, int64_t isa) {
  cpu_only({&out, &x, &packed}, "small_gemm");
  pagedserve::cpu::small_gemm(out, x, packed, bias, isa);
}

bool small_gemm_glu(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                    const c10::optional<torch::Tensor>& bias, int64_t isa) {
  cpu_only({&out, &x, &packed}, "small_gemm_glu");
  return pagedserve::cpu::small_gemm_glu(out, x, packed, bias, isa);
}

void small_gemm_argmax_lse(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, int64_t n, torch::Tensor& argmax,
                           torch::Tensor& max, torch::Tensor& logsumexp, int64_t isa) {
  cpu_only({&x, &packed, &argmax, &max, &logsumexp}, "small_gemm_argmax_lse");
  pagedserve::cpu::small_gemm_argmax_lse(x, packed, bias, n, argmax, max, logsumexp, isa);
}

void q8_gemm(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
             const c10::optional<torch::Tensor>& bias, int64_t isa) {
  cpu_only({&out, &x, &packed}, "q8_gemm");
  pagedserve::cpu::q8_gemm(out, x, packed, bias, isa);
}

void kquant_gemm(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& blob,
                 const c10::optional<torch::Tensor>& bias, int64_t isa) {
  cpu_only({&out, &x, &blob}, "kquant_gemm");
  pagedserve::cpu::kquant_gemm(out, x, blob, bias, isa);
}

void moe_experts(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& topk_ids,
                 const torch::Tensor& topk_weights, const torch::Tensor& w13, const torch::Tensor& w2, int64_t inter,
                 int64_t isa) {
  cpu_only({&out, &x, &topk_ids, &topk_weights, &w13, &w2}, "moe_experts");
  pagedserve::cpu::moe_experts(out, x, topk_ids, topk_weights, w13, w2, inter, isa);
}

void moe_forward(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& logits, const torch::Tensor& w13,
                 const torch::Tensor& w2, int64_t inter, int64_t top_k, bool renormalize, bool round_weights) {
  cpu_only({&out, &x, &logits, &w13, &w2}, "moe_forward");
  pagedserve::cpu::moe_forward(out, x, logits, w13, w2, inter, top_k, renormalize, round_weights);
}

torch::Tensor llama_decode_layers(const torch::Tensor& embeddings, const torch::Tensor& positions,
                                  const std::vector<torch::Tensor>& cos_sins,
                                  const std::vector<torch::Tensor>& weights,
                                  const std::vector<torch::Tensor>& key_caches,
                                  const std::vector<torch::Tensor>& value_caches, const torch::Tensor& slot_mapping,
                                  const std::vector<int64_t>& prefill_spans,
                                  const std::vector<torch::Tensor>& prefill_tables,
                                  const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                  const std::vector<int64_t>& windows, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_size, int64_t intermediate_size, double eps, double scale,
                                  int64_t mlp_act, double softcap) {
  cpu_only({&embeddings, &positions}, "llama_decode_layers");
  for (const auto& c : cos_sins) cpu_only({&c}, "llama_decode_layers");
  for (const auto& c : key_caches) cpu_only({&c}, "llama_decode_layers");
  return pagedserve::cpu::llama_decode_layers(embeddings, positions, cos_sins, weights, key_caches, value_caches,
                                              slot_mapping, prefill_spans, prefill_tables, block_tables,
                                              context_lens, windows, num_heads,
                                              num_kv_heads, head_size, intermediate_size, eps, scale, mlp_act, softcap);
}

// OpenMP threads for the parallel regions the CALLING thread opens from now on (the compiled ops',
// and oneDNN's GEMMs, which share this OpenMP runtime); other threads keep theirs. Returns the old value.
int64_t set_thread_omp_threads(int64_t n) {
  TORCH_CHECK(n >= 1, "set_thread_omp_threads: n must be >= 1");
  const int64_t previous = omp_get_max_threads();
  omp_set_num_threads(static_cast<int>(n));
  return previous;
}

bool built_with_cuda() {
#ifdef PAGEDSERVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve paged-attention, KV-cache and elementwise ops";
  // The ops run with the GIL released: the engine steps on a worker thread, and the
  // server's event loop must keep answering (health checks, new requests) meanwhile.
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, release_gil(),
        "decode attention over a paged KV cache (writes out)");
  m.def("prefill_attention", &prefill_attention, release_gil(),
        "causal GQA attention of one sequence's new tokens over its context (writes out)");
  m.def("reshape_and_cache", &reshape_and_cache, release_gil(), "write new K/V rows into their cache slots");
  m.def("copy_blocks", &copy_blocks, release_gil(), "copy blocks inside every layer's cache");
  m.def("swap_blocks", &swap_blocks, release_gil(), "copy blocks from each source tensor to its destination");
  m.def("rms_norm", &rms_norm, release_gil(), "RMSNorm of each row (writes out)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, release_gil(),
        "residual += input; input = rms_norm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, release_gil(), "silu(gate) * up of [gate | up] rows (writes out)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, release_gil(),
        "gelu_tanh(gate) * up of [gate | up] rows (writes out; CPU)");
  m.def("rms_norm_heads", &rms_norm_heads, release_gil(), "RMSNorm of each head vector, in place (CPU)");
  m.def("rotary_embedding", &rotary_embedding, release_gil(), "neox RoPE in place on [tokens, heads, head_size]");
  m.def("argmax_logsumexp", &argmax_logsumexp, release_gil(),
        "per row: index of the first largest logit and log(sum(exp(logits))) (writes argmax, logsumexp)");
  m.def("small_gemm", &small_gemm, release_gil(), py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("isa") = 0, "out = x @ W^T (+ bias) for a few rows over a small-row packed W");
  m.def("small_gemm_glu", &small_gemm_glu, release_gil(), py::arg("out"), py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("isa") = 0,
        "out = silu(gate) * up of x @ W^T (+ bias) = [gate | up], fused; false when this path has no fused tiles");
  m.def("small_gemm_argmax_lse", &small_gemm_argmax_lse, release_gil(), py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("n"), py::arg("argmax"), py::arg("max"), py::arg("logsumexp"), py::arg("isa") = 0,
        "per row of x @ W^T (+ bias): argmax, max and logsumexp, the outputs never written (a greedy head)");
  m.def("llama_decode_layers", &llama_decode_layers, release_gil(),
        "every decoder layer of a Llama-family CPU step in one call (the eager layers' arithmetic in their order; "
        "gate/up and its activation in one small_gemm_glu where the path has fused tiles)");
  m.def("decode_layer_slots", &pagedserve::cpu::decode_layer_slots, "tensors per layer in llama_decode_layers");
  m.def("small_gemm_isa", &pagedserve::cpu::small_gemm_isa, "the best small_gemm path built (0: none)");
  m.def("q8_gemm", &q8_gemm, release_gil(), py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias"),
        py::arg("isa") = 0, "out = x @ W^T (+ bias) over Q8_0 (int8) weights packed by engine/model_executor/layers/quant.py");
  m.def("moe_experts", &moe_experts, release_gil(), py::arg("out"), py::arg("x"), py::arg("topk_ids"),
        py::arg("topk_weights"), py::arg("w13"), py::arg("w2"), py::arg("inter"), py::arg("isa") = 0,
        "a mixture-of-experts MLP: tokens grouped by expert, each chosen expert's packed weights read once");
  m.def("moe_forward", &moe_forward, release_gil(),
        "a mixture-of-experts MLP from its router's logits: softmax, top-k, then moe_experts (out may be x)");
  m.def("moe_bytes_read", &pagedserve::cpu::moe_bytes_read, py::arg("reset") = false,
        "bytes of expert weights moe_experts has read (since the last reset)");
  m.def("q8_gemm_isa", &pagedserve::cpu::q8_gemm_isa, "the best q8_gemm path on this CPU and build (0: none)");
  m.def("kquant_gemm", &kquant_gemm, release_gil(), py::arg("out"), py::arg("x"), py::arg("blob"), py::arg("bias"),
        py::arg("isa") = 0, "out = x @ W^T (+ bias) over GGML block formats packed by engine/model_executor/layers/formats.py");
  m.def("kquant_gemm_isa", &pagedserve::cpu::kquant_gemm_isa, "the best kquant_gemm path on this CPU and build");
  m.def("ggml_quantize_k", &pagedserve::cpu::ggml_quantize_k, release_gil(), py::arg("weight"), py::arg("type"),
        "float32 [N, K] -> uint8 K-quant blocks (ggml type 12 Q4_K, 13 Q5_K, 14 Q6_K), llama.cpp's reference bytes");
  m.def("kquant_pack", &pagedserve::cpu::kquant_pack, release_gil(), py::arg("raw"), py::arg("type"), py::arg("out"),
        py::arg("row0"), py::arg("total_rows"),
        "a part's GGUF rows (uint8 [N, row bytes]) into the packed layout its kernel reads, written into out");
  m.def("set_thread_omp_threads", &set_thread_omp_threads,
        "OpenMP threads of the calling thread's parallel regions; returns the previous count");
  m.def("built_with_cuda", &built_with_cuda, "whether the CUDA kernels are compiled in");
#ifdef PAGEDSERVE_CUDA
  m.def("paged_attention_workspace_bytes", &pagedserve::cuda::paged_attention_workspace_bytes,
        "bytes of scratch CUDA paged_attention allocates for (num_seqs, num_heads, head_size, max_context_len, "
        "sliding_window): 0 means the single-pass kernel, > 0 the partitioned (v2) kernel and its reduce");
#endif
}
