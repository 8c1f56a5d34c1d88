// The dequantized-panel path of csrc/cpu/kquant_gemm.cpp (a prefill's many rows): out = x @ W^T a panel of column
// blocks at a time, W^T's panel dequantized to float32 or bfloat16 [K, P] on the caller's OpenMP threads (SIMD: the
// codes as the tiles unpack them, w = (D sc) q - (M mn) per column), then torch's GEMM (oneDNN) over it, so a
// prefill costs about what the float model's does and its products are the dequantized model's. kquant_gemm.cpp's
// header has the measurements and the row threshold.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
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

constexpr int64_t kPanelBytes = 4 << 20;  // one dequantized panel of W^T (as q8_gemm's)

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

// The panel path's dequantization of one column block's blocks into W^T rows (T: float32 or bfloat16 [K, ld],
// columns col0..+15): w = (D sc) q - (M mn) per lane, the codes as unpack reads them (byte i of a lane is k 4g + i).
template <class V, class F, int G, typename T>
inline void dequant_groups(const uint8_t* b, int j32, int lane0, T* dst, int64_t ld, typename V::F sc0,
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

template <class V, class F, typename T>
void simd_dequant(const uint8_t* wb, int64_t s0, int64_t s1, T* dst, int64_t ld) {  // dst: [K, ld], column 0
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
        T* d = dst + s * F::kS * ld + lane0;
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

template <class F, typename T>
void plain_dequant(const uint8_t* wb, int64_t s0, int64_t s1, T* dst, int64_t ld) {  // simd_dequant's plain form
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
                T(static_cast<float>(code<F>(b, j32, g, c, i)) * (dd * sc) - mm * mn);
        }
    }
  }
}

// One panel: column blocks [b0, b1) of W^T dequantized into dst ([K, ld], T: float32 or bfloat16) on the caller's
// OpenMP threads, in units of 256 k (one K-quant block, eight of 32) of one column block, the column blocks innermost:
// a thread writes whole lines of dst's rows in order. (Column block by column block, each 64-byte line of a row was
// written in two halves far apart: on a Zen 5 the dequantization of a [8192, 2048] Q4_K weight took ~5.5 ms of the
// 6.8 ms its panel path spent on 16 rows; now 3.1.)
template <class F, typename T>
void dequant_panel(Isa isa, const uint8_t* w, int64_t sb, int64_t b0, int64_t b1, T* dst, int64_t ld) {
  constexpr int64_t g = 256 / F::kS;  // blocks along K a unit
  const int64_t np = b1 - b0, nk = (sb + g - 1) / g;
  over_threads(np * nk, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s0 = u / np * g, s1 = std::min(sb, s0 + g), p = u % np;
      const uint8_t* wb = w + (b0 + p) * sb * F::kBytes;
      if (p + 1 < np) {  // the next unit's bytes, another column block's stream (the hardware prefetcher lags)
        const char* next = reinterpret_cast<const char*>(wb + sb * F::kBytes + s0 * F::kBytes);
        for (int64_t line = 0; line < (s1 - s0) * F::kBytes; line += 64) __builtin_prefetch(next + line, 0, 3);
      }
#if defined(__AVX512F__)
      if (isa >= kAvx512) { simd_dequant<V512<false>, F>(wb, s0, s1, dst + p * kCols, ld); continue; }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {  // bfloat16 panels need AVX-512 BF16: the branch above
        if (isa >= kAvx2) { simd_dequant<V256, F>(wb, s0, s1, dst + p * kCols, ld); continue; }
      }
#endif
      plain_dequant<F>(wb, s0, s1, dst + p * kCols, ld);
    }
  });
}

// kPanel: out = x @ W^T a panel of column blocks at a time: W^T's panel dequantized [K, P] on the caller's OpenMP
// threads, then torch's GEMM (oneDNN) over it, so a prefill costs what the float model's does and equals the
// dequantized model's product. The panel is bfloat16 where x and out are and the CPU multiplies bfloat16 natively
// (written as such: the float32 panel and its conversion cost a 128-token prefill of the 1.17B Q4_0 ~45 ms of 490 on
// a Zen 5), else float32.
template <class F>
void run_panels(Isa isa, at::Tensor& out, const at::Tensor& x, const uint8_t* w, int64_t n, const at::Tensor& bias) {
  const int64_t k = x.size(1), sb = k / F::kS, blocks = (n + kCols - 1) / kCols;
  const at::ScalarType pt = panel_dtype(x, out);
  const bool bf16 = pt == at::kBFloat16;
  const int64_t esize = bf16 ? 2 : 4;
  const int64_t panel_blocks = std::min(blocks, std::max<int64_t>(1, kPanelBytes / (k * esize * kCols)));
  const at::Tensor xin = x.scalar_type() == pt ? x : x.to(pt);
  at::Tensor scratch = at::empty({k * (panel_blocks * kCols + kPanelPad)}, x.options().dtype(pt));
  for (int64_t b0 = 0; b0 < blocks; b0 += panel_blocks) {
    const int64_t b1 = std::min(blocks, b0 + panel_blocks), ld = (b1 - b0) * kCols + kPanelPad;
    const int64_t c0 = b0 * kCols, cols = std::min(n, b1 * kCols) - c0;
    if (bf16) dequant_panel<F>(isa, w, sb, b0, b1, scratch.data_ptr<c10::BFloat16>(), ld);
    else dequant_panel<F>(isa, w, sb, b0, b1, scratch.data_ptr<float>(), ld);
    const at::Tensor wt = scratch.narrow(0, 0, k * ld).view({k, ld}).narrow(1, 0, cols);
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
