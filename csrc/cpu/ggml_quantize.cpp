// Float weights into llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) for `--quantization q4_k / q5_k / q6_k`: the
// algorithm of ggml-quants.c's quantize_row_*_ref (what llama-quantize runs without an imatrix), in C's float32
// arithmetic and order: per 32 weights (Q4_K, Q5_K) a scale and a min searched over nstep candidate scales for the
// least weighted squared error (weights av_x + |x|), then rounded to 6 bits under the block's float16 d / dmin;
// per 16 weights (Q6_K) a signed scale, 19 candidates, 8-bit scales under one d. Sequential sums and no fused
// multiply-adds (fp-contract off below), so the bytes are llama-quantize's (tests/model/test_ggml_quantize.py).
//
// Why C++: engine/model_executor/layers/ggml_quantize.py's torch port (the reference, and the path without the
// compiled ops) runs each candidate as whole-tensor ops: ~15 s per 2048 x 8192 Q4_K weight on one core of the
// 2-vCPU Xeon (model 85), most of an hour for a 1B model; here the search stays in registers, rows in parallel.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "../ops.h"

#pragma GCC optimize("fp-contract=off")  // this file's functions: no fused multiply-adds (C's rounding, llama.cpp's)

namespace pagedserve {
namespace cpu {

namespace {

constexpr int kQK = 256;
constexpr float kGroupMaxEps = 1e-15f;

// Round to nearest, ties to even, for |x| < 2^22 (C's nearest_int of ggml-quants.c: the float's mantissa after
// adding 1.5 * 2^23).
inline int nearest_int(float x) {
  float v = x + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, sizeof i);
  return (i & 0x007fffff) - 0x00400000;
}

inline uint16_t f16_bits(float x) { return c10::Half(x).x; }
inline float f16_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// One group of n weights at levels 0..nmax as scale * l - min (returns the scale; *neg_min = min's negation).
float qkx2(int n, int nmax, const float* x, const float* w, uint8_t* L, float* neg_min, float rmin, float rdelta,
           int nstep) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < lo) lo = x[i];
    if (x[i] > hi) hi = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    std::fill(L, L + n, 0);
    *neg_min = -lo;
    return 0.f;
  }
  float iscale = nmax / (hi - lo), scale = 1 / iscale, best = 0;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - lo)))));
    float diff = scale * L[i] + lo - x[i];
    best += w[i] * (diff * diff);
  }
  uint8_t aux[32];
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * step + nmax) / (hi - lo);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - lo))));
      aux[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float err = 0;
    for (int i = 0; i < n; ++i) {
      float diff = this_scale * aux[i] + this_min - x[i];
      err += w[i] * (diff * diff);
    }
    if (err < best) {
      std::memcpy(L, aux, n);
      best = err;
      scale = this_scale;
      lo = this_min;
    }
  }
  *neg_min = -lo;
  return scale;
}

// Q4_K (bits 4: 144 bytes d, dmin, scales[12], qs[128]) and Q5_K (bits 5: 176 bytes, qh[32] before qs) of 256 x.
void block_k(const float* x, uint8_t* out, int bits) {
  const int nmax = (1 << bits) - 1;
  uint8_t L[kQK];
  float scales[8], mins[8], w[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* g = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += g[l] * g[l];
    float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(g[l]);
    scales[j] = bits == 4 ? qkx2(32, nmax, g, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20)
                          : qkx2(32, nmax, g, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  uint8_t sc[12] = {0};
  float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls_all[8], lm_all[8];
  for (int j = 0; j < 8; ++j) {
    uint8_t ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    uint8_t lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    ls_all[j] = ls, lm_all[j] = lm;
    if (j < 4) {
      sc[j] = ls, sc[j + 4] = lm;
    } else {
      sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
      sc[j - 4] |= (ls >> 4) << 6;
      sc[j] |= (lm >> 4) << 6;
    }
  }
  const uint16_t d16 = f16_bits(max_scale / 63.f), dmin16 = f16_bits(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    const float d = f16_value(d16) * ls_all[j];
    if (!d) continue;
    const float dm = f16_value(dmin16) * lm_all[j];
    for (int i = 0; i < 32; ++i) L[32 * j + i] = std::max(0, std::min(nmax, nearest_int((x[32 * j + i] + dm) / d)));
  }
  std::memcpy(out, &d16, 2);
  std::memcpy(out + 2, &dmin16, 2);
  std::memcpy(out + 4, sc, 12);
  uint8_t* q = out + 16;
  if (bits == 5) {  // bit 4 of the 64-weight run r's first / second 32 in qh bits 2r / 2r + 1
    uint8_t* qh = q;
    std::memset(qh, 0, 32);
    q += 32;
    for (int r = 0; r < 4; ++r) {
      for (int i = 0; i < 32; ++i) {
        qh[i] |= ((L[64 * r + i] >> 4) << (2 * r)) | ((L[64 * r + 32 + i] >> 4) << (2 * r + 1));
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 32; ++i) q[32 * r + i] = (L[64 * r + i] & 0xF) | ((L[64 * r + 32 + i] & 0xF) << 4);
  }
}

// make_qx_quants, rmse_type 1 (weights x^2): n weights at signed levels -nmax..nmax-1; L holds l + nmax.
float qx(int n, int nmax, const float* x, int8_t* L) {
  float peak = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    float ax = std::fabs(x[i]);
    if (ax > amax) amax = ax, peak = x[i];
  }
  if (amax < kGroupMaxEps) {
    std::fill(L, L + n, 0);
    return 0.f;
  }
  auto trial = [&](float iscale, float* sumlx, float* suml2) {
    *sumlx = *suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
      float w = x[i] * x[i];
      *sumlx += w * x[i] * l;
      *suml2 += w * l * l;
    }
  };
  auto levels = [&](float iscale) {
    for (int i = 0; i < n; ++i) L[i] = nmax + std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
  };
  float iscale = -nmax / peak, sumlx, suml2;
  trial(iscale, &sumlx, &suml2);
  levels(iscale);
  float scale = suml2 ? sumlx / suml2 : 0.f, best = scale * sumlx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    iscale = -(nmax + 0.1f * step) / peak;
    trial(iscale, &sumlx, &suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      levels(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q6_K of 256 x: 210 bytes ql[128], qh[64], scales[16] int8, d.
void block_q6k(const float* x, uint8_t* out) {
  int8_t L[kQK];
  float scales[16], max_scale = 0, max_abs = 0;
  for (int b = 0; b < 16; ++b) {
    scales[b] = qx(16, 32, x + 16 * b, L + 16 * b);
    if (std::fabs(scales[b]) > max_abs) max_abs = std::fabs(scales[b]), max_scale = scales[b];
  }
  std::memset(out, 0, 210);
  if (max_abs < kGroupMaxEps) return;  // d = 0, every byte zero
  const float iscale = -128.f / max_scale;
  const uint16_t d16 = f16_bits(1 / iscale);
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  for (int b = 0; b < 16; ++b) sc[b] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[b])));
  for (int b = 0; b < 16; ++b) {
    const float d = f16_value(d16) * sc[b];
    if (!d) continue;
    for (int i = 0; i < 16; ++i) L[16 * b + i] = std::max(-32, std::min(31, nearest_int(x[16 * b + i] / d))) + 32;
  }
  uint8_t *ql = out, *qh = out + 128;
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32) {
    const int8_t* l = L + 128 * h;
    for (int i = 0; i < 32; ++i) {
      ql[i] = (l[i] & 0xF) | ((l[i + 64] & 0xF) << 4);
      ql[i + 32] = (l[i + 32] & 0xF) | ((l[i + 96] & 0xF) << 4);
      qh[i] = (l[i] >> 4) | ((l[i + 32] >> 4) << 2) | ((l[i + 64] >> 4) << 4) | ((l[i + 96] >> 4) << 6);
    }
  }
  std::memcpy(out + 208, &d16, 2);
}

}  // namespace

// weight float32 [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * block bytes] of ggml type 12 (Q4_K),
// 13 (Q5_K) or 14 (Q6_K); rows split over OpenMP threads.
at::Tensor ggml_quantize_k(const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "ggml_quantize_k: weight float32 [N, K], contiguous");
  TORCH_CHECK(type == 12 || type == 13 || type == 14, "ggml_quantize_k: type 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % kQK == 0, "ggml_quantize_k: K (", k, ") is not a multiple of 256");
  const int64_t bytes = type == 12 ? 144 : type == 13 ? 176 : 210, blocks = k / kQK;
  at::Tensor out = at::empty({n, blocks * bytes}, weight.options().dtype(at::kByte));
  const float* x = weight.data_ptr<float>();
  uint8_t* y = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + b * kQK;
      uint8_t* yb = y + (r * blocks + b) * bytes;
      if (type == 14) {
        block_q6k(xb, yb);
      } else {
        block_k(xb, yb, type == 12 ? 4 : 5);
      }
    }
  }
  return out;
}

}  // namespace cpu
}  // namespace pagedserve
