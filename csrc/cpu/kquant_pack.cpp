// A GGUF part's raw rows into the layout its kernel reads, at load (issues 53, 54): the tiles of
// csrc/cpu/kquant_gemm.cpp (header there) for Q4_0 .. Q6_K, csrc/cpu/q8_gemm.cpp's layout for Q8_0; the bytes of
// engine/model_executor/layers/formats.py pack_kquant / quant.py pack_q8 (their torch forms are the reference the
// tests compare with, byte for byte).
//
// Why C++: the torch form unpacks every code to a byte and permutes whole chunks (a dozen temporaries per chunk);
// the real Gemma 3 270M Q4_K_M file spent ~54 s of its load there. Here each column block of 16 decodes its 16 rows'
// blocks one block along K at a time into a Column each (the tile's only temporary) and writes the tile in place;
// column blocks in parallel.
#include "kquant_blocks.h"

#include "../ops.h"

namespace pagedserve {
namespace cpu {

namespace {

using namespace kquant;

// One row's block of S weights decoded as formats.py components() gives it: codes q (0 .. 2^bits - 1), D and M as
// float16 bits (M: the stored value -m of Q4_1 / Q5_1, dmin of the K-quants), sc / mn per sub-block.
struct Column {
  uint8_t q[256];
  uint16_t d, m;
  int8_t sc[16], mn[16];
};

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline void nibbles32(const uint8_t* qs, uint8_t* q) {  // 16 bytes -> 32 codes: low nibbles, then high
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 15;
    q[i + 16] = qs[i] >> 4;
  }
}

inline void fifth_bits32(const uint8_t* qh, uint8_t* q) {  // bit i of a little-endian uint32: code i's fifth bit
  for (int i = 0; i < 32; ++i) q[i] |= ((qh[i >> 3] >> (i & 7)) & 1) << 4;
}

// Q4_K / Q5_K: 6-bit scales and mins of 8 sub-blocks in 12 bytes (llama.cpp get_scale_min_k4).
inline void k_scales(const uint8_t* s, int8_t* sc, int8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = static_cast<int8_t>(s[j] & 63);
    mn[j] = static_cast<int8_t>(s[j + 4] & 63);
    sc[j + 4] = static_cast<int8_t>((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<int8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

inline void q4_low256(const uint8_t* qs, uint8_t* q) {  // 128 bytes -> 256 codes: per 64, 32 low then 32 high
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = qs[32 * j + l] & 15;
      q[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  }
}

template <int64_t Type>
void decode(const uint8_t* b, Column& c) {  // b: one GGUF block of Type
  if constexpr (Type == kQ4_0) {
    c.d = u16(b);
    nibbles32(b + 2, c.q);
  } else if constexpr (Type == kQ4_1) {
    c.d = u16(b);
    c.m = u16(b + 2) ^ 0x8000;  // M = -m: the sign bit
    nibbles32(b + 4, c.q);
  } else if constexpr (Type == kQ5_0) {
    c.d = u16(b);
    nibbles32(b + 6, c.q);
    fifth_bits32(b + 2, c.q);
  } else if constexpr (Type == kQ5_1) {
    c.d = u16(b);
    c.m = u16(b + 2) ^ 0x8000;
    nibbles32(b + 8, c.q);
    fifth_bits32(b + 4, c.q);
  } else if constexpr (Type == kQ4_K) {
    c.d = u16(b);
    c.m = u16(b + 2);
    k_scales(b + 4, c.sc, c.mn);
    q4_low256(b + 16, c.q);
  } else if constexpr (Type == kQ5_K) {
    c.d = u16(b);
    c.m = u16(b + 2);
    k_scales(b + 4, c.sc, c.mn);
    q4_low256(b + 48, c.q);
    for (int j = 0; j < 8; ++j) {  // bit j of qh[l]: weight 32 j + l
      for (int l = 0; l < 32; ++l) c.q[32 * j + l] |= ((b[16 + l] >> j) & 1) << 4;
    }
  } else {  // Q6_K: ql [128], qh [64], int8 scales [16], d
    static_assert(Type == kQ6_K, "decode: a type without a tile layout");
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h) {  // per 128 weights: low nibbles of 64 bytes, then high; 2 bits of 32 bytes x 4
      for (int l = 0; l < 32; ++l) {
        uint8_t* q = c.q + 128 * h + l;
        const int hb = qh[32 * h + l];
        q[0] = (ql[64 * h + l] & 15) | ((hb & 3) << 4);
        q[32] = (ql[64 * h + 32 + l] & 15) | (((hb >> 2) & 3) << 4);
        q[64] = (ql[64 * h + l] >> 4) | (((hb >> 4) & 3) << 4);
        q[96] = (ql[64 * h + 32 + l] >> 4) | (((hb >> 6) & 3) << 4);
      }
    }
    std::memcpy(c.sc, b + 192, 16);
    c.d = u16(b + 208);
  }
}

// One tile (16 columns, one block along K) of kquant_gemm.cpp's layout from the columns' decoded blocks.
template <class F>
void write_tile(const Column* cols, uint8_t* t) {  // cols [16], t [F::kBytes]
  for (int j = 0; j < F::kJ32; ++j) {
    for (int c = 0; c < kCols; ++c) {
      const uint8_t* q = cols[c].q + 32 * j;  // groups g of 4 k: q[4 g + i]
      for (int i = 0; i < 4; ++i) {
        for (int g = 0; g < 4; ++g) t[j * 256 + g * 64 + c * 4 + i] = (q[4 * g + i] & 15) | ((q[4 * (g + 4) + i] & 15) << 4);
        if constexpr (F::kBits == 5) {
          int v = 0;
          for (int g = 0; g < 8; ++g) v |= ((q[4 * g + i] >> 4) & 1) << g;
          t[F::kOffHi + j * 64 + c * 4 + i] = static_cast<uint8_t>(v);
        }
        if constexpr (F::kBits == 6) {
          for (int h = 0; h < 2; ++h) {
            int v = 0;
            for (int g = 0; g < 4; ++g) v |= ((q[4 * (4 * h + g) + i] >> 4) & 3) << (2 * g);
            t[F::kOffHi + j * 128 + h * 64 + c * 4 + i] = static_cast<uint8_t>(v);
          }
        }
      }
    }
  }
  for (int c = 0; c < kCols; ++c) {
    std::memcpy(t + F::kOffD + 2 * c, &cols[c].d, 2);
    if constexpr (F::kStoresM) std::memcpy(t + F::kOffM + 2 * c, &cols[c].m, 2);
    for (int j = 0; j < F::kSubs; ++j) {  // [subs/2][16][2]: sub-blocks 2i, 2i + 1 of a column side by side
      t[F::kOffSc + (j / 2) * 32 + c * 2 + (j & 1)] = static_cast<uint8_t>(cols[c].sc[j]);
      if constexpr (F::kOwnMins) t[F::kOffMn + (j / 2) * 32 + c * 2 + (j & 1)] = static_cast<uint8_t>(cols[c].mn[j]);
    }
  }
}

// Rows [row0, row0 + n) of raw (row stride `stride` bytes) into their column blocks' tiles (out: the whole part).
template <int64_t Type, class F>
void pack_tiles(const uint8_t* raw, int64_t stride, int64_t n, int64_t row0, int64_t k, int64_t block_bytes,
                uint8_t* out) {
  const int64_t sb = k / F::kS, cb0 = row0 / kCols, blocks = (n + kCols - 1) / kCols;
  over_threads(blocks, [&](int64_t b0, int64_t b1) {
    Column cols[kCols];
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int64_t live = std::min<int64_t>(kCols, n - cb * kCols);  // the last block's missing columns: zeros
      std::memset(static_cast<void*>(cols), 0, sizeof(cols));
      for (int64_t s = 0; s < sb; ++s) {
        for (int64_t c = 0; c < live; ++c) decode<Type>(raw + (cb * kCols + c) * stride + s * block_bytes, cols[c]);
        write_tile<F>(cols, out + ((cb0 + cb) * sb + s) * F::kBytes);
      }
    }
  });
}

// Q8_0 (34-byte blocks: d, 32 int8) into q8_gemm.cpp's layout: weights [N/16][KB][8][16][4] as q + 128 (a missing
// column's weights 128, i.e. q = 0), then scales [N/16][KB][16] float16 (a missing column's 0).
void pack_q8(const uint8_t* raw, int64_t stride, int64_t n, int64_t row0, int64_t total, int64_t kb, uint8_t* out) {
  const int64_t cb0 = row0 / kCols, blocks = (n + kCols - 1) / kCols;
  uint8_t* scales = out + (total + kCols - 1) / kCols * kb * kCols * 32;
  over_threads(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int64_t live = std::min<int64_t>(kCols, n - cb * kCols);
      for (int64_t b = 0; b < kb; ++b) {
        uint8_t* w = out + ((cb0 + cb) * kb + b) * kCols * 32;
        uint8_t* d = scales + ((cb0 + cb) * kb + b) * kCols * 2;
        for (int64_t c = 0; c < kCols; ++c) {
          if (c >= live) {
            for (int g = 0; g < 8; ++g) std::memset(w + g * 64 + c * 4, 0x80, 4);
            std::memset(d + 2 * c, 0, 2);
            continue;
          }
          const uint8_t* blk = raw + (cb * kCols + c) * stride + b * 34;
          std::memcpy(d + 2 * c, blk, 2);
          for (int g = 0; g < 8; ++g) {
            for (int i = 0; i < 4; ++i) w[g * 64 + c * 4 + i] = blk[2 + 4 * g + i] ^ 0x80;
          }
        }
      }
    }
  });
}

struct Geometry {
  int64_t weights, bytes, tile;  // weights and bytes of a GGUF block; bytes of a tile (Q8_0: 16 x 34)
};

Geometry geometry(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, FQ4_0::kBytes};
    case kQ4_1: return {32, 20, FQ4_1::kBytes};
    case kQ5_0: return {32, 22, FQ5_0::kBytes};
    case kQ5_1: return {32, 24, FQ5_1::kBytes};
    case kQ8_0: return {32, 34, kCols * 34};
    case kQ4_K: return {256, 144, FQ4_K::kBytes};
    case kQ5_K: return {256, 176, FQ5_K::kBytes};
    case kQ6_K: return {256, 210, FQ6_K::kBytes};
    default: return {0, 0, 0};
  }
}

}  // namespace

void kquant_pack(const at::Tensor& raw, int64_t type, at::Tensor& out, int64_t row0, int64_t total_rows) {
  const Geometry g = geometry(type);
  TORCH_CHECK(g.weights > 0, "kquant_pack: GGML type ", type, " has no packed layout");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.stride(1) == 1 && raw.size(1) % g.bytes == 0,
              "kquant_pack: raw is uint8 [N, KB * ", g.bytes, "] with contiguous rows, got ", raw.sizes());
  TORCH_CHECK(out.dim() == 1 && out.scalar_type() == at::kByte && out.is_contiguous(),
              "kquant_pack: out is 1-D contiguous uint8");
  const int64_t n = raw.size(0), kb = raw.size(1) / g.bytes, k = kb * g.weights;
  TORCH_CHECK(row0 >= 0 && row0 % kCols == 0 && row0 + n <= total_rows && (n % kCols == 0 || row0 + n == total_rows),
              "kquant_pack: rows [", row0, ", ", row0 + n, ") of ", total_rows, " do not start and end on ", kCols,
              "-row blocks");
  const int64_t bytes = (total_rows + kCols - 1) / kCols * kb * g.tile;
  TORCH_CHECK(out.numel() == bytes, "kquant_pack: out has ", out.numel(), " bytes, the packed [", total_rows, ", ",
              k, "] weight ", bytes);
  const uint8_t* r = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t stride = raw.stride(0);
  switch (type) {
    case kQ4_0: return pack_tiles<kQ4_0, FQ4_0>(r, stride, n, row0, k, g.bytes, o);
    case kQ4_1: return pack_tiles<kQ4_1, FQ4_1>(r, stride, n, row0, k, g.bytes, o);
    case kQ5_0: return pack_tiles<kQ5_0, FQ5_0>(r, stride, n, row0, k, g.bytes, o);
    case kQ5_1: return pack_tiles<kQ5_1, FQ5_1>(r, stride, n, row0, k, g.bytes, o);
    case kQ4_K: return pack_tiles<kQ4_K, FQ4_K>(r, stride, n, row0, k, g.bytes, o);
    case kQ5_K: return pack_tiles<kQ5_K, FQ5_K>(r, stride, n, row0, k, g.bytes, o);
    case kQ6_K: return pack_tiles<kQ6_K, FQ6_K>(r, stride, n, row0, k, g.bytes, o);
    default: return pack_q8(r, stride, n, row0, total_rows, kb, o);
  }
}

}  // namespace cpu
}  // namespace pagedserve
