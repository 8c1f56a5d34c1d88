// The dequantized-panel path of csrc/cpu/kquant_gemm.cpp (a prefill's many rows): out = x @ W^T a panel of column
// blocks at a time, W^T's panel dequantized to float32 [K, P] on the caller's OpenMP threads (SIMD: the codes as the
// tiles unpack them, w = (D sc) q - (M mn) per column), then torch's GEMM (oneDNN) over it, so a prefill costs about
// what the float model's does and its products are the dequantized model's. kquant_gemm.cpp's header has the
// measurements and the row threshold.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "kquant_blocks.h"

namespace pagedserve {
namespace cpu {
namespace kquant {

namespace {

constexpr int64_t kPanelBytes = 4 << 20;  // one dequantized float32 panel of W^T (as q8_gemm's)

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

// The panel path's dequantization of one column block's blocks into W^T rows (float32 [K, ld], columns col0..+15):
// w = (D sc) q - (M mn) per lane, the codes as unpack reads them (byte i of a lane is k 4g + i).
template <class V, class F, int G>
inline void dequant_groups(const uint8_t* b, int j32, int lane0, float* dst, int64_t ld, typename V::F sc0,
                           typename V::F sc1, typename V::F mn0, typename V::F mn1) {
  typename V::I w0, w1;
  unpack<V, F, G>(b, j32, lane0, w0, w1);
  const typename V::I ff = V::set32(0xff);
  auto put = [&](typename V::I w, int64_t kk, typename V::F sc, typename V::F mn) {
    V::store(dst + (kk + 0) * ld, V::fmsub(V::cvt(V::and_(w, ff)), sc, mn));
    V::store(dst + (kk + 1) * ld, V::fmsub(V::cvt(V::and_(V::template srl32<8>(w), ff)), sc, mn));
    V::store(dst + (kk + 2) * ld, V::fmsub(V::cvt(V::and_(V::template srl32<16>(w), ff)), sc, mn));
    V::store(dst + (kk + 3) * ld, V::fmsub(V::cvt(V::template srl32<24>(w)), sc, mn));
  };
  put(w0, j32 * 32 + 4 * G, sc0, mn0);
  put(w1, j32 * 32 + 16 + 4 * G, sc1, mn1);
}

template <class V, class F>
void simd_dequant(const uint8_t* wb, int64_t s0, int64_t s1, float* dst, int64_t ld) {  // dst: [K, ld], column 0
  using FV = typename V::F;
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = wb + s * F::kBytes;
    for (int lane0 = 0; lane0 < kCols; lane0 += V::kL) {
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      const FV mm = F::kStoresM ? V::halfs(b + F::kOffM + lane0 * 2) : V::mul(dd, V::fset(float(F::kMMul)));
      for (int j32 = 0; j32 < F::kJ32; ++j32) {
        FV sc0 = dd, sc1 = dd, mn0 = mm, mn1 = mm;
        if constexpr (F::kSub != 0) {  // sub-scales (and offsets) of this chunk's k 0-15 and 16-31, per lane
          const int pair = F::kSub == 32 ? j32 / 2 : j32;
          auto pick = [&](int off, bool odd) {
            const typename V::I p = V::pairs(b + off + pair * 32 + lane0 * 2);
            return V::cvt(odd ? V::sra16of32(p) : V::sra16of32(V::template shl32<16>(p)));
          };
          const FV a0 = pick(F::kOffSc, F::kSub == 32 ? (j32 & 1) : 0);
          const FV a1 = F::kSub == 32 ? a0 : pick(F::kOffSc, 1);
          const FV n0 = F::kOwnMins ? pick(F::kOffMn, j32 & 1) : a0, n1 = F::kOwnMins ? n0 : a1;
          sc0 = V::mul(dd, a0), sc1 = V::mul(dd, a1), mn0 = V::mul(mm, n0), mn1 = V::mul(mm, n1);
        }
        float* d = dst + s * F::kS * ld + lane0;
        dequant_groups<V, F, 0>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 1>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 2>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
        dequant_groups<V, F, 3>(b, j32, lane0, d, ld, sc0, sc1, mn0, mn1);
      }
    }
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

template <class F>
void plain_dequant(const uint8_t* wb, int64_t s0, int64_t s1, float* dst, int64_t ld) {  // simd_dequant's plain form
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = wb + s * F::kBytes;
    for (int c = 0; c < kCols; ++c) {
      const float dd = half_at(b + F::kOffD, c);
      const float mm = F::kStoresM ? half_at(b + F::kOffM, c) : dd * static_cast<float>(F::kMMul);
      for (int j32 = 0; j32 < F::kJ32; ++j32)
        for (int g = 0; g < 8; ++g) {
          const int sub = F::kSub == 16 ? 2 * j32 + (g >> 2) : j32;
          const float sc = F::kSub ? static_cast<float>(pair_at(b + F::kOffSc, sub, c)) : 1.0f;
          const float mn = F::kSub ? static_cast<float>(pair_at(b + (F::kOwnMins ? F::kOffMn : F::kOffSc), sub, c))
                                   : 1.0f;
          for (int i = 0; i < 4; ++i)
            dst[(s * F::kS + j32 * 32 + 4 * g + i) * ld + c] =
                static_cast<float>(code<F>(b, j32, g, c, i)) * (dd * sc) - mm * mn;
        }
    }
  }
}

// kPanel: out = x @ W^T a panel of column blocks at a time: W^T's panel dequantized to float32 [K, P] on the
// caller's OpenMP threads, then torch's GEMM (oneDNN; bfloat16 where x and out are and the CPU multiplies bfloat16
// natively), so a prefill costs what the float model's does and equals the dequantized model's product.
template <class F>
void run_panels(Isa isa, at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n, const at::Tensor& bias) {
  const int64_t k = x.size(1), sb = k / F::kS, blocks = (n + kCols - 1) / kCols;
  const int64_t panel_blocks = std::min(blocks, std::max<int64_t>(1, kPanelBytes / (k * 4 * kCols)));
  const bool bf16 = x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && cpu_has_bf16_dot();
  const at::ScalarType pt = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor xin = x.scalar_type() == pt ? x : x.to(pt);
  at::Tensor scratch = at::empty({k * panel_blocks * kCols}, x.options().dtype(at::kFloat));
  for (int64_t b0 = 0; b0 < blocks; b0 += panel_blocks) {
    const int64_t b1 = std::min(blocks, b0 + panel_blocks), ld = (b1 - b0) * kCols;
    const int64_t c0 = b0 * kCols, cols = std::min(n, b1 * kCols) - c0;
    float* dst = scratch.data_ptr<float>();
    over_threads((b1 - b0) * sb, [&](int64_t u0, int64_t u1) {  // units of one block along K of one column block
      for (int64_t u = u0; u < u1;) {
        const int64_t p = u / sb, s0 = u % sb, s1 = std::min(sb, s0 + (u1 - u));
        const uint8_t* wb = w + (b0 + p) * sb * F::kBytes;
        u += s1 - s0;
#if defined(__AVX512F__)
        if (isa >= kAvx512) { simd_dequant<V512<false>, F>(wb, s0, s1, dst + p * kCols, ld); continue; }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        if (isa >= kAvx2) { simd_dequant<V256, F>(wb, s0, s1, dst + p * kCols, ld); continue; }
#endif
        plain_dequant<F>(wb, s0, s1, dst + p * kCols, ld);
      }
    });
    at::Tensor wt = scratch.narrow(0, 0, k * ld).view({k, ld}).narrow(1, 0, cols);
    if (pt != at::kFloat) wt = wt.to(pt);
    at::Tensor o = out.narrow(1, c0, cols);
    panel_mm(o, xin, wt, bias.defined() ? bias.narrow(0, c0, cols) : bias, out.scalar_type() == pt);
  }
}

}  // namespace

void panels(int64_t type, Isa isa, at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n,
            const at::Tensor& bias) {
  switch (type) {
    case kQ4_0: return run_panels<FQ4_0>(isa, out, x, w, n, bias);
    case kQ4_1: return run_panels<FQ4_1>(isa, out, x, w, n, bias);
    case kQ5_0: return run_panels<FQ5_0>(isa, out, x, w, n, bias);
    case kQ5_1: return run_panels<FQ5_1>(isa, out, x, w, n, bias);
    case kQ4_K: return run_panels<FQ4_K>(isa, out, x, w, n, bias);
    case kQ5_K: return run_panels<FQ5_K>(isa, out, x, w, n, bias);
    case kQ6_K: return run_panels<FQ6_K>(isa, out, x, w, n, bias);
    default: TORCH_CHECK(false, "kquant_gemm: GGML type ", type, " has no kernel");
  }
}

}  // namespace kquant
}  // namespace cpu
}  // namespace pagedserve
