// What the CPU multiplies natively, asked once, and what the quantized GEMMs share (q8_gemm.cpp, kquant_*.cpp): where
// a tile writes, and the dequantized-panel paths' GEMM step.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

namespace pagedserve {
namespace cpu {

// AVX-512 VNNI (vpdpbusd) with AVX-512 BW: the int8 tiles' fastest path.
inline bool cpu_has_vnni() {
#if defined(__AVX512F__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// oneDNN multiplies bfloat16 natively (AVX-512 BF16, AMX): a bfloat16 x meets a bfloat16 panel; elsewhere the
// panel is float32 (oneDNN's bfloat16 GEMM without these instructions converts every tile first).
inline bool cpu_has_bf16_dot() {
#if defined(__AVX512F__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// A dequantized panel's dtype: bfloat16 where x and out are bfloat16 and the CPU multiplies bfloat16 natively, else
// float32 (a float32 row, the head's float32 logits included, keeps float32 products).
inline at::ScalarType panel_dtype(const at::Tensor& x, const at::Tensor& out) {
  return x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot() ? at::kBFloat16
                                                                                                     : at::kFloat;
}

// Where a tile writes: float32 or bfloat16 rows, the bias, and the valid columns.
struct Out {
  float* f32;
  c10::BFloat16* bf16;
  int64_t stride;
  const float* bias;
  int64_t n;
};

// Elements a dequantized panel's row has beyond its columns: rows a power of two apart (1024 bfloat16 columns: 2 KiB)
// fall in two of L1's 64 sets, and a panel's unit writes 32 to 256 rows at once.
constexpr int64_t kPanelPad = 32;

// o = xin @ wt (+ bias), o a column slice of the output: straight into o where it has the panel's dtype (direct),
// else through a temporary of the panel's dtype and one copy.
inline void panel_mm(at::Tensor& o, const at::Tensor& xin, const at::Tensor& wt, const at::Tensor& bias, bool direct) {
  if (direct) {
    if (bias.defined()) {
      at::addmm_out(o, bias.to(wt.scalar_type()), xin, wt);
    } else {
      at::mm_out(o, xin, wt);
    }
  } else {
    at::Tensor t = at::mm(xin, wt);
    if (bias.defined()) t.add_(bias);
    o.copy_(t);
  }
}

}  // namespace cpu
}  // namespace pagedserve
