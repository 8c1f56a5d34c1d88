// The wide tiles of csrc/cpu/kquant_gemm.cpp (issue 53: a decode step's 2 to ~16 rows): x's two int8 parts joined
// into one int16 per weight, x16 = 254 xh + xl (|x16| <= 32258: the same quantized x, scale dx / 254), multiplied
// with the codes widened to int16 by vpmaddwd (AVX2, AVX-512) or vpdpwssd (AVX-512 VNNI), so a row costs one 16-bit
// product per weight pair instead of the int8 tiles' two parts x (vpmaddubsw + vpmaddwd). The codes are unpacked
// and widened once per tile and reused by its R rows (their x16 stream from L1); a 32-k chunk's int32 sums (at most
// 32 * 63 * 32258 < 2^31) are scaled per lane by D sc in float32 once per chunk and row, the offsets (M mn, as the
// int8 tiles: S2 = 254 S2h + S2l, exact in int32) once per block and row.
//
// Measured (the Xeon @ 2.50GHz, one thread, [2048, 8192] and [8192, 2048] weights): kquant_gemm.cpp's header.
#include "kquant_blocks.h"

namespace pagedserve {
namespace cpu {
namespace kquant {

namespace {

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

#if defined(__AVX2__) && defined(__FMA__)

constexpr int kJoin = static_cast<int>(kLowSteps);  // x16 = kJoin * xh + xl
constexpr int kPrefetch = 4096;                     // as the int8 tiles: bytes of the stream ahead

template <class F>
constexpr int kLineBytes = (F::kBytes / F::kJ32 + 63) / 64 * 64;  // a 32-k chunk's share of the stream

// Group G of a 32-k chunk for R rows: codes of k 4G..4G+3 (w0) and 16+4G.. (w1), 4 k of a column a 32-bit lane,
// widened to int16 pairs (k0, k2) and (k1, k3), against x16 stored in that order (quantize_x: x0 x2 x1 x3 per 4 k).
// Split: w1's sub-block is its own (Q6_K's sub-blocks of 16) and sums into ib.
template <class V, class F, int R, int G, bool Split>
inline void group(const uint8_t* b, int j32, int lane0, const int16_t* const* xr, int64_t k0, typename V::I* ia,
                  typename V::I* ib) {
  using I = typename V::I;
  I w0, w1;
  unpack<V, F, G>(b, j32, lane0, w0, w1);
  const I lo = V::set32(0x00ff00ff);
  const I w0l = V::and_(w0, lo), w0h = V::template shift16<-8>(w0);
  const I w1l = V::and_(w1, lo), w1h = V::template shift16<-8>(w1);
  for (int r = 0; r < R; ++r) {
    const int16_t* x = xr[r] + k0 + 4 * G;
    ia[r] = V::dot16(ia[r], w0l, V::set32(pair16(x)));
    ia[r] = V::dot16(ia[r], w0h, V::set32(pair16(x + 2)));
    I& t = Split ? ib[r] : ia[r];
    t = V::dot16(t, w1l, V::set32(pair16(x + 16)));
    t = V::dot16(t, w1h, V::set32(pair16(x + 18)));
    // the sums stay in registers: without this GCC reassociates a chunk's 16 products of a row into a tree and
    // spills every product to the stack first (measured: 2-3x the cycles)
    __asm__("" : "+v"(ia[r]));
    if constexpr (Split) __asm__("" : "+v"(ib[r]));
  }
}

// One row of a 5- or 6-bit format on AVX2 without the x16 widening: the codes (u8) against x's two int8 parts by
// vpmaddubsw, each part's pair sums added in int16 over the groups a code width allows (|sum| <= 2 q_max 127 a
// product: 5-bit codes 4 groups, 6-bit 2), then joined in int32 by one vpmaddwd each (xh's by 254, xl's by 1): the
// same exact sum of q x16 as `group`, in fewer instructions where no other row shares the widening.
// Zen 5 held to AVX2, one thread, one row of [2048, 8192] (2026-11-29): Q5_0 0.46 -> 0.40 ms, Q5_1 0.47 -> 0.41,
// Q5_K 0.43 -> 0.38, Q6_K 0.47 -> 0.43; the 1.17B Q6_K file's decode step 21.0 / 20.9 -> 20.5 / 19.8 ms. The 4-bit
// formats stay on `group` (Q4_K even, Q4_0 and Q4_1 0.31 -> 0.42: GCC spills their unrolled halves' sums).
template <class V, class F>
struct Bytes1 {
  static_assert(F::kBits > 4, "the 4-bit formats take group");
  using I = typename V::I;
  static constexpr int kGroups = F::kBits == 5 ? 4 : 2;  // groups between joins (w0's and w1's sums apart)
  I ha = V::zero(), la = V::zero(), hb = V::zero(), lb = V::zero();
  template <int G>
  void group(const uint8_t* b, int j32, int lane0, const int8_t* xh, const int8_t* xl, int64_t k0) {
    I w0, w1;
    unpack<V, F, G>(b, j32, lane0, w0, w1);
    const int64_t k = k0 + 4 * G;
    ha = _mm256_add_epi16(ha, V::maddubs(w0, V::set32(four(xh + k))));
    la = _mm256_add_epi16(la, V::maddubs(w0, V::set32(four(xl + k))));
    hb = _mm256_add_epi16(hb, V::maddubs(w1, V::set32(four(xh + k + 16))));
    lb = _mm256_add_epi16(lb, V::maddubs(w1, V::set32(four(xl + k + 16))));
  }
  void join(I& ia, I& ib, bool split) {  // into the int32 sums of k 0-15 (ia) and 16-31 (ib, or ia unless split)
    const I h = V::set16(kJoin), l = V::set16(1);
    ia = V::add(ia, V::add(V::madd(ha, h), V::madd(la, l)));
    I& t = split ? ib : ia;
    t = V::add(t, V::add(V::madd(hb, h), V::madd(lb, l)));
    ha = la = hb = lb = V::zero();
  }
};

template <class V, class F>
constexpr bool kBytes1 = V::kL == 8 && F::kBits > 4;

// Rows row0 .. row0 + R - 1 of x (x16) against one 16-column block over all of K: H halves of V::kL columns. X32: x
// of a K-quant scaled per 32 (a prefill's rows, kquant_gemm.cpp kX32Rows), its scale applied per chunk and its
// offsets summed per sub-block in float (unit_scales' xs16 / xs32), as the x16 panels do; else per block of F::kS.
template <class V, class F, int R, bool X32, bool kBytes = false>
void tile(const XQuant& xq, int64_t row0, const uint8_t* w, int64_t sb, const Out& o, int64_t col0) {
  static_assert(!kBytes || R == 1, "Bytes1: one row");
  using I = typename V::I;
  using FV = typename V::F;
  constexpr int H = kCols / V::kL;
  constexpr bool kSplit = F::kSub == 16;
  FV acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = V::fzero();
  const int16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xq.q16.data() + (row0 + r) * xq.k;
  const int64_t n32 = xq.k / 32, n16 = xq.k / 16, ns = xq.k / F::kS;
  for (int64_t s = 0; s < sb; ++s) {
    const uint8_t* b = w + s * F::kBytes;
    for (int h = 0; h < H; ++h) {
      const int lane0 = h * V::kL;
      const FV dd = V::halfs(b + F::kOffD + lane0 * 2);
      FV blk[R];
      for (int r = 0; r < R; ++r) blk[r] = V::fzero();
      for (int j32 = 0; j32 < F::kJ32; ++j32) {
        if (h == 0) {  // this chunk's share of the stream kPrefetch ahead (the hardware prefetcher alone lags)
          const uint8_t* ahead = b + kPrefetch + j32 * kLineBytes<F>;
          for (int line = 0; line < kLineBytes<F>; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        }
        FV sa = dd, sb2 = dd;  // D sc per lane of k 0-15 and 16-31
        if constexpr (F::kSub != 0) {
          const I p = V::pairs(b + F::kOffSc + (F::kSub == 32 ? j32 / 2 : j32) * 32 + lane0 * 2);
          const FV even = V::cvt(V::sra16of32(V::template shl32<16>(p))), odd = V::cvt(V::sra16of32(p));
          if constexpr (F::kSub == 32) sa = sb2 = V::mul(dd, (j32 & 1) ? odd : even);
          else sa = V::mul(dd, even), sb2 = V::mul(dd, odd);
        }
        I ia[R], ib[R];
        for (int r = 0; r < R; ++r) ia[r] = ib[r] = V::zero();
        const int64_t k0 = s * F::kS + j32 * 32;
        if constexpr (kBytes) {
          Bytes1<V, F> p1;
          const int8_t* xh = xq.row(kParts * row0);
          const int8_t* xl = xq.row(kParts * row0 + 1);
          p1.template group<0>(b, j32, lane0, xh, xl, k0);
          p1.template group<1>(b, j32, lane0, xh, xl, k0);
          if constexpr (Bytes1<V, F>::kGroups == 2) p1.join(ia[0], ib[0], kSplit);
          p1.template group<2>(b, j32, lane0, xh, xl, k0);
          p1.template group<3>(b, j32, lane0, xh, xl, k0);
          p1.join(ia[0], ib[0], kSplit);
        } else {
          group<V, F, R, 0, kSplit>(b, j32, lane0, xr, k0, ia, ib);
          group<V, F, R, 1, kSplit>(b, j32, lane0, xr, k0, ia, ib);
          group<V, F, R, 2, kSplit>(b, j32, lane0, xr, k0, ia, ib);
          group<V, F, R, 3, kSplit>(b, j32, lane0, xr, k0, ia, ib);
        }
        for (int r = 0; r < R; ++r) {
          if constexpr (X32) {  // this chunk's x scale
            const FV dx = V::fset(xq.dx32[(row0 + r) * n32 + s * F::kJ32 + j32]);
            blk[r] = V::fmadd(V::mul(V::cvt(ia[r]), dx), sa, blk[r]);
            if constexpr (kSplit) blk[r] = V::fmadd(V::mul(V::cvt(ib[r]), dx), sb2, blk[r]);
          } else {
            blk[r] = V::fmadd(V::cvt(ia[r]), sa, blk[r]);
            if constexpr (kSplit) blk[r] = V::fmadd(V::cvt(ib[r]), sb2, blk[r]);
          }
        }
      }
      FV mm;
      if constexpr (F::kStoresM) mm = V::halfs(b + F::kOffM + lane0 * 2);
      else mm = V::mul(dd, V::fset(static_cast<float>(F::kMMul)));
      if constexpr (X32) {  // acc += blk - mm sum_j mn_j xs_j, xs_j = dx_j sum x16 over sub-block j
        FV off[R];
        x32_offsets<V, F, R>(b, lane0, xq, row0, s, off);
        for (int r = 0; r < R; ++r) acc[h][r] = V::fadd(acc[h][r], V::fnmadd(mm, off[r], blk[r]));
        continue;
      }
      for (int r = 0; r < R; ++r) {
        const int64_t eh = kParts * (row0 + r), el = eh + 1;  // the expanded rows of xh and xl
        FV off;
        if constexpr (F::kSub == 0) {
          off = V::fset(static_cast<float>(kJoin * xq.s32[eh * n32 + s] + xq.s32[el * n32 + s]));
        } else {
          const int64_t n = F::kSub == 32 ? n32 : n16;
          const int16_t* bh = (F::kSub == 32 ? xq.s32.data() : xq.s16.data()) + eh * n + s * F::kSubs;
          const int16_t* bl = (F::kSub == 32 ? xq.s32.data() : xq.s16.data()) + el * n + s * F::kSubs;
          I s2h = V::zero(), s2l = V::zero();
          for (int p2 = 0; p2 < F::kSubs / 2; ++p2) {
            const I mp = V::pairs(b + (F::kOwnMins ? F::kOffMn : F::kOffSc) + p2 * 32 + lane0 * 2);
            s2h = V::add(s2h, V::madd(mp, V::set32(pair16(bh + 2 * p2))));
            s2l = V::add(s2l, V::madd(mp, V::set32(pair16(bl + 2 * p2))));
          }
          off = V::cvt(V::add(V::mullo(s2h, V::set32(kJoin)), s2l));
        }
        acc[h][r] = V::fmadd(V::fnmadd(mm, off, blk[r]), V::fset(xq.d[el * ns + s]), acc[h][r]);
      }
    }
  }
  alignas(64) float buf[kCols];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < H; ++h) V::store(buf + h * V::kL, acc[h][r]);
    store_cols(o, row0 + r, col0, kCols, buf);
  }
}

template <class V, class F, bool X32>
void blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  const int64_t sb = xq.k / F::kS;
  constexpr int64_t kMax = V::kL == 16 ? 8 : 4;  // rows a tile: AVX2's 16 ymm hold 4 rows' sums, AVX-512's 32 zmm 8
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* wb = w + blk * sb * F::kBytes;
    for (int64_t r = 0; r < m;) {
      const int64_t left = m - r;
      if (kMax == 8 && left >= 8) tile<V, F, kMax == 8 ? 8 : 4, X32>(xq, r, wb, sb, o, blk * kCols), r += 8;
      else if (left >= 4) tile<V, F, 4, X32>(xq, r, wb, sb, o, blk * kCols), r += 4;
      else if (left == 3) tile<V, F, 3, X32>(xq, r, wb, sb, o, blk * kCols), r += 3;
      else if (left == 2) tile<V, F, 2, X32>(xq, r, wb, sb, o, blk * kCols), r += 2;
      else tile<V, F, 1, X32, kBytes1<V, F>>(xq, r, wb, sb, o, blk * kCols), r += 1;
    }
  }
}

// A K-quant's x scaled per 32 (xq.s < F::kS) takes the X32 tiles.
template <class V, class F>
void blocks(const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  if constexpr (F::kSub != 0) {
    if (xq.s < F::kS) return blocks<V, F, true>(xq, m, w, b0, b1, o);
  }
  blocks<V, F, false>(xq, m, w, b0, b1, o);
}

template <class V>
void run(int64_t type, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1, const Out& o) {
  switch (type) {
    case kQ4_0: return blocks<V, FQ4_0>(xq, m, w, b0, b1, o);
    case kQ4_1: return blocks<V, FQ4_1>(xq, m, w, b0, b1, o);
    case kQ5_0: return blocks<V, FQ5_0>(xq, m, w, b0, b1, o);
    case kQ5_1: return blocks<V, FQ5_1>(xq, m, w, b0, b1, o);
    case kQ4_K: return blocks<V, FQ4_K>(xq, m, w, b0, b1, o);
    case kQ5_K: return blocks<V, FQ5_K>(xq, m, w, b0, b1, o);
    case kQ6_K: return blocks<V, FQ6_K>(xq, m, w, b0, b1, o);
    default: TORCH_CHECK(false, "kquant_gemm: GGML type ", type, " has no wide tile");
  }
}

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

}  // namespace

bool wide_tiles(int64_t type, Isa isa, const XQuant& xq, int64_t m, const uint8_t* w, int64_t b0, int64_t b1,
                const Out& o) {
#if defined(__AVX512F__)
  if (isa == kVnni) return run<V512<true>>(type, xq, m, w, b0, b1, o), true;
  if (isa == kAvx512) return run<V512<false>>(type, xq, m, w, b0, b1, o), true;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == kAvx2) return run<V256>(type, xq, m, w, b0, b1, o), true;
#endif
  return false;
}

}  // namespace kquant
}  // namespace cpu
}  // namespace pagedserve
