// CUDA paged decode attention (flash-decoding): one thread block per (kv head, sequence, partition).
//
// Same arithmetic as csrc/cpu/attention.cpp: logits = scale * q . k for every
// attended token, a softmax that subtracts the max, then sum_t p_t * v_t, all in
// float32. A block serves up to kMaxGroup query heads that share one kv head
// (GQA), so each K/V row is read from memory once for the whole group. Each
// sequence's attended span is cut into kPartitionSize-token partitions: a
// sequence with one partition is finished by its block; the partial results of
// a longer one (normalized, with their max logit and exp sum) are merged by a
// second kernel. A sequence's result depends only on its own context, never on
// the batch or the block table's width, so a CUDA graph captured at a padded
// batch gives the eager launch's bits.
//
// Included by one .cu file per cache dtype (attention_{f32,f16,bf16}.cu), which
// keeps each nvcc run short and lets the build compile them in parallel.
#pragma once

#include "launchers.h"
#include "numerics.cuh"

namespace pagedserve {
namespace cuda_kernels {
namespace paged_decode {

constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
constexpr int kUnroll = 4;  // rows a lane loads before it computes: loads in flight per warp
// A partition's block ids are staged in shared memory for block sizes of at least this many tokens.
constexpr int kMinStagedBlockSize = 8;
constexpr int kMaxStagedBlocks = kPartitionSize / kMinStagedBlockSize + 1;  // + 1: a window's unaligned start

constexpr int pow2_ceil(int n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

// How a warp reads K and V rows in 16-byte chunks: kLanesPerRow lanes (a power of
// two) share a row, so a warp reads kRowsPerWarp tokens at once; a lane takes
// chunks rl, rl + kLanesPerRow, ... of its row (lanes past the row's end idle).
template <typename T, int kHeadSize>
struct RowTiling {
  static constexpr int kVec = 16 / sizeof(T);  // elements per chunk
  static_assert(kHeadSize % kVec == 0, "head rows must be whole 16-byte chunks");
  static constexpr int kChunks = kHeadSize / kVec;
  static constexpr int kLanesPerRow = kChunks >= kWarpSize ? kWarpSize : pow2_ceil(kChunks);
  static constexpr int kRowsPerWarp = kWarpSize / kLanesPerRow;
  static constexpr int kChunksPerLane = (kChunks + kLanesPerRow - 1) / kLanesPerRow;
  static constexpr int kRowsPerStep = kNumWarps * kRowsPerWarp;  // tokens the block reads at once
};

// The attended tokens are [begin, context_len): begin = context_len - sliding_window
// under a sliding window (earlier blocks are never read: they may be released), else 0.
__device__ __forceinline__ int attended_begin(int context_len, int sliding_window) {
  return sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
}

__device__ __forceinline__ int num_parts_of(int attended) { return (attended + kPartitionSize - 1) / kPartitionSize; }

template <typename T>
__device__ __forceinline__ void widen(const uint4& raw, float* v) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) v[i] = to_float(e[i]);
}

// Grid (num_kv_heads * head_tiles, num_seqs, z). Block (x, seq, z) serves query heads
// [kv_head * group + tile * kMaxGroup, + heads_here) over the partitions z, z + gridDim.z, ... of seq, each
// tokens [begin + part * P, + P): the launch sizes z to fill the GPU, never past the longest span's partitions
// (a CUDA graph's block tables are as wide as max_model_len; its short sequences' blocks would mostly idle).
template <typename T, int kHeadSize, int kMaxGroup>
__global__ void __launch_bounds__(kNumThreads) paged_decode_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, kHeadSize]
    float* __restrict__ tmp_out,          // [num_seqs, num_heads, max_partitions, kHeadSize]
    float* __restrict__ max_logits,       // [num_seqs, num_heads, max_partitions]
    float* __restrict__ exp_sums,         // [num_seqs, num_heads, max_partitions]
    const T* __restrict__ query,          // [num_seqs, num_heads, kHeadSize] strided rows
    const T* __restrict__ key_cache,      // [num_blocks, num_kv_heads, block_size, kHeadSize]
    const T* __restrict__ value_cache,    // [num_blocks, num_kv_heads, block_size, kHeadSize]
    const int32_t* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int32_t* __restrict__ context_lens,  // [num_seqs]
    int num_heads, int num_kv_heads, int head_tiles, int block_size, int max_blocks_per_seq, int max_partitions,
    int64_t q_stride_seq, int64_t q_stride_head, float scale, int sliding_window) {
  using Tiling = RowTiling<T, kHeadSize>;
  constexpr int kVec = Tiling::kVec, kLanesPerRow = Tiling::kLanesPerRow, kRowsPerWarp = Tiling::kRowsPerWarp;
  constexpr int kChunksPerLane = Tiling::kChunksPerLane, kRowsPerStep = Tiling::kRowsPerStep;
  const int kv_head = blockIdx.x / head_tiles, tile = blockIdx.x % head_tiles;
  const int seq = blockIdx.y;
  const int group = num_heads / num_kv_heads;
  const int first_head = kv_head * group + tile * kMaxGroup;
  const int heads_here = min(kMaxGroup, group - tile * kMaxGroup);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int sub = lane / kLanesPerRow, rl = lane % kLanesPerRow;  // row of the warp, lane in the row
  const int context_len = context_lens[seq];
  const int begin = attended_begin(context_len, sliding_window);
  const int num_parts = num_parts_of(context_len - begin);
  const int64_t row0 = static_cast<int64_t>(seq) * num_heads + first_head;  // first (seq, head) row served
  if (num_parts == 0) {  // the empty context: zeros
    if (blockIdx.z == 0) {
      for (int i = threadIdx.x; i < heads_here * kHeadSize; i += kNumThreads) {
        out[row0 * kHeadSize + i] = from_float<T>(0.f);
      }
    }
    return;
  }
  const bool whole = num_parts == 1;  // the whole attended span in one partition: the final result
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int64_t head_stride = static_cast<int64_t>(block_size) * kHeadSize;  // one kv head's rows in a block
  const bool staged = block_size >= kMinStagedBlockSize;

  __shared__ float logits[kMaxGroup][kPartitionSize];
  __shared__ float red[kNumWarps][kMaxGroup];
  __shared__ float acc_s[kMaxGroup][kHeadSize];
  __shared__ int64_t blocks_s[kMaxStagedBlocks];  // the partition's physical blocks, in order

  for (int part = blockIdx.z; part < num_parts; part += gridDim.z) {
    const int start = begin + part * kPartitionSize;
    const int n = min(kPartitionSize, context_len - start);  // tokens of this partition
    const int first_block = start / block_size;
    if (staged) {  // one table read per block, not per row: the rows' loads then wait on one latency, not two
      const int count = (start + n - 1) / block_size - first_block + 1;
      for (int b = threadIdx.x; b < count; b += kNumThreads) blocks_s[b] = table[first_block + b];
      __syncthreads();
    }
    // The K/V row of the partition's i-th token for this kv head.
    auto row_offset = [&](int i) -> int64_t {
      const int t = start + i;
      const int64_t block = staged ? blocks_s[t / block_size - first_block] : table[t / block_size];
      return (block * num_kv_heads + kv_head) * head_stride + static_cast<int64_t>(t % block_size) * kHeadSize;
    };

    // This lane's chunks of each served query head, scaled, in registers (read again each partition:
    // kept across them they would double the registers the accumulators need).
    float q[kMaxGroup][kChunksPerLane][kVec];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const T* qrow = query + seq * q_stride_seq + (first_head + min(g, heads_here - 1)) * q_stride_head;
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c) {
        const int chunk = rl + c * kLanesPerRow;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          q[g][c][e] = (chunk < Tiling::kChunks && g < heads_here) ? to_float(qrow[chunk * kVec + e]) * scale : 0.f;
        }
      }
    }

    // Pass 1: a row's lanes each dot their chunks; kUnroll rows' loads are issued before any is used.
    float local_max[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) local_max[g] = -FLT_MAX;
    for (int base = warp * kRowsPerWarp + sub; base < n + sub; base += kRowsPerStep * kUnroll) {
      uint4 raw[kUnroll][kChunksPerLane];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kRowsPerStep;
        if (i < n) {
          const T* k = key_cache + row_offset(i);
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            const int chunk = rl + c * kLanesPerRow;
            if (chunk < Tiling::kChunks) raw[u][c] = __ldg(reinterpret_cast<const uint4*>(k + chunk * kVec));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kRowsPerStep;
        float dot[kMaxGroup];
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.f;
        if (i < n) {
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            if (rl + c * kLanesPerRow < Tiling::kChunks) {
              float kv[kVec];
              widen<T>(raw[u][c], kv);
#pragma unroll
              for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
                for (int e = 0; e < kVec; ++e) dot[g] += q[g][c][e] * kv[e];
              }
            }
          }
        }
        // Every lane of the warp runs the same iterations: the group sums shuffle the whole warp.
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) dot[g] = warp_sum<kLanesPerRow>(dot[g]);
        if (i < n) {
#pragma unroll
          for (int g = 0; g < kMaxGroup; ++g) {
            if (rl == g % kLanesPerRow) logits[g][i] = dot[g];
            local_max[g] = fmaxf(local_max[g], dot[g]);
          }
        }
      }
    }
    // Per head: the max over the warps (one barrier), then the softmax numerators and their sum.
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float m = warp_max(local_max[g]);
      if (lane == 0) red[warp][g] = m;
    }
    __syncthreads();
    float max_logit[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      max_logit[g] = red[0][g];
#pragma unroll
      for (int w = 1; w < kNumWarps; ++w) max_logit[g] = fmaxf(max_logit[g], red[w][g]);
    }
    float local_sum[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) local_sum[g] = 0.f;
    for (int i = threadIdx.x; i < n; i += kNumThreads) {
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < heads_here) {
          const float e = __expf(logits[g][i] - max_logit[g]);  // safe softmax numerator: <= 1
          logits[g][i] = e;
          local_sum[g] += e;
        }
      }
    }
    __syncthreads();  // every max read from red before it is reused for the sums
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float s = warp_sum(local_sum[g]);
      if (lane == 0) red[warp][g] = s;
    }
    __syncthreads();  // the sums, and every numerator in logits
    float exp_sum[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      exp_sum[g] = 0.f;
#pragma unroll
      for (int w = 0; w < kNumWarps; ++w) exp_sum[g] += red[w][g];
    }

    // Pass 2: the same tiling over V rows; each lane accumulates its chunks of its rows for every head.
    float acc[kMaxGroup][kChunksPerLane][kVec];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][c][e] = 0.f;
      }
    }
    for (int base = warp * kRowsPerWarp + sub; base < n + sub; base += kRowsPerStep * kUnroll) {
      uint4 raw[kUnroll][kChunksPerLane];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kRowsPerStep;
        if (i < n) {
          const T* v = value_cache + row_offset(i);
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            const int chunk = rl + c * kLanesPerRow;
            if (chunk < Tiling::kChunks) raw[u][c] = __ldg(reinterpret_cast<const uint4*>(v + chunk * kVec));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kRowsPerStep;
        if (i < n) {
          float p[kMaxGroup];
#pragma unroll
          for (int g = 0; g < kMaxGroup; ++g) p[g] = g < heads_here ? logits[g][i] : 0.f;
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            if (rl + c * kLanesPerRow < Tiling::kChunks) {
              float vv[kVec];
              widen<T>(raw[u][c], vv);
#pragma unroll
              for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc[g][c][e] += p[g] * vv[e];
              }
            }
          }
        }
      }
    }
    // The warp's rows summed into its first row's lanes (a fixed order: the result is deterministic) ...
#pragma unroll
    for (int offset = kLanesPerRow; offset < kWarpSize; offset <<= 1) {
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][c][e] += __shfl_xor_sync(0xffffffffu, acc[g][c][e], offset);
        }
      }
    }
    // ... then the warps' sums added in warp order.
    for (int w = 0; w < kNumWarps; ++w) {
      if (warp == w && sub == 0) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            const int chunk = rl + c * kLanesPerRow;
            if (chunk < Tiling::kChunks && g < heads_here) {
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                float& slot = acc_s[g][chunk * kVec + e];
                slot = (w == 0 ? 0.f : slot) + acc[g][c][e];
              }
            }
          }
        }
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < heads_here * kHeadSize; i += kNumThreads) {
      const int g = i / kHeadSize, d = i % kHeadSize;
      float inv_sum = 0.f;
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) inv_sum = h == g ? 1.f / exp_sum[h] : inv_sum;
      const float o = acc_s[g][d] * inv_sum;
      if (whole) {
        out[(row0 + g) * kHeadSize + d] = from_float<T>(o);
      } else {
        tmp_out[((row0 + g) * max_partitions + part) * kHeadSize + d] = o;
      }
    }
    if (!whole && threadIdx.x < heads_here) {
      const int g = threadIdx.x;
      float m = 0.f, s = 0.f;
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
        m = h == g ? max_logit[h] : m;
        s = h == g ? exp_sum[h] : s;
      }
      max_logits[(row0 + g) * max_partitions + part] = m;
      exp_sums[(row0 + g) * max_partitions + part] = s;
    }
    __syncthreads();  // the shared buffers are the next partition's
  }
}

// Merges the partitions of one (head, sequence) that has more than one: each partial output is
// weighted by its exp sum rescaled to the global max logit.
template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kNumThreads) paged_decode_reduce_kernel(
    T* __restrict__ out,                     // [num_seqs, num_heads, kHeadSize]
    const float* __restrict__ tmp_out,       // [num_seqs, num_heads, max_partitions, kHeadSize]
    const float* __restrict__ max_logits,    // [num_seqs, num_heads, max_partitions]
    const float* __restrict__ exp_sums,      // [num_seqs, num_heads, max_partitions]
    const int32_t* __restrict__ context_lens,  // [num_seqs]
    int max_partitions, int sliding_window) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int context_len = context_lens[seq];
  const int num_parts = num_parts_of(context_len - attended_begin(context_len, sliding_window));
  if (num_parts <= 1) return;  // written by its one partition
  const int64_t row = static_cast<int64_t>(seq) * gridDim.x + head;
  const float* ml = max_logits + row * max_partitions;
  const float* es = exp_sums + row * max_partitions;
  __shared__ float weight[kMaxReducePartitions];
  float global_max = -FLT_MAX;
  for (int p = 0; p < num_parts; ++p) global_max = fmaxf(global_max, ml[p]);
  float total = 0.f;
  for (int p = 0; p < num_parts; ++p) total += es[p] * __expf(ml[p] - global_max);
  const float inv_total = 1.f / total;
  for (int p = threadIdx.x; p < num_parts && p < kMaxReducePartitions; p += kNumThreads) {
    weight[p] = es[p] * __expf(ml[p] - global_max) * inv_total;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) {
    float o = 0.f;
    for (int p = 0; p < num_parts; ++p) {
      const float w = p < kMaxReducePartitions ? weight[p] : es[p] * __expf(ml[p] - global_max) * inv_total;
      o += tmp_out[(row * max_partitions + p) * kHeadSize + d] * w;
    }
    out[row * kHeadSize + d] = from_float<T>(o);
  }
}

constexpr int kBlocksPerSM = 4;

// The current device's multiprocessors, read once per device.
inline int num_sms() {
  static int cached[64] = {0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int sms = 0;
    cached[device] = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && sms > 0
                         ? sms : 132;
  }
  return cached[device];
}

template <typename T, int kHeadSize, int kMaxGroup>
cudaError_t launch_group(const PagedDecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.num_kv_heads;
  const int head_tiles = (group + kMaxGroup - 1) / kMaxGroup;
  const int parts = paged_decode_partitions(a.max_context_len);
  const size_t rows = static_cast<size_t>(a.num_seqs) * a.num_heads * parts;
  float* tmp_out = parts > 1 ? a.workspace : nullptr;
  float* max_logits = parts > 1 ? tmp_out + rows * kHeadSize : nullptr;
  float* exp_sums = parts > 1 ? max_logits + rows : nullptr;
  // Enough blocks to fill the GPU twice over (a partition's block holds a few per multiprocessor), and no
  // more than the partitions of the longest span.
  const int per_z = a.num_kv_heads * head_tiles * a.num_seqs;
  const int z = max(1, min(parts, (2 * kBlocksPerSM * num_sms() + per_z - 1) / per_z));
  const dim3 grid(a.num_kv_heads * head_tiles, a.num_seqs, z);
  paged_decode_kernel<T, kHeadSize, kMaxGroup><<<grid, kNumThreads, 0, stream>>>(
      static_cast<T*>(a.out), tmp_out, max_logits, exp_sums, static_cast<const T*>(a.query),
      static_cast<const T*>(a.key_cache), static_cast<const T*>(a.value_cache), a.block_tables, a.context_lens,
      a.num_heads, a.num_kv_heads, head_tiles, a.block_size, a.max_blocks_per_seq, parts, a.q_stride_seq,
      a.q_stride_head, a.scale, a.sliding_window);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || parts <= 1) return err;
  paged_decode_reduce_kernel<T, kHeadSize><<<dim3(a.num_heads, a.num_seqs), kNumThreads, 0, stream>>>(
      static_cast<T*>(a.out), tmp_out, max_logits, exp_sums, a.context_lens, parts, a.sliding_window);
  return cudaGetLastError();
}

template <typename T, int kHeadSize>
cudaError_t launch_head(const PagedDecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.num_kv_heads;
  if (group == 1) return launch_group<T, kHeadSize, 1>(a, stream);
  if (group == 2) return launch_group<T, kHeadSize, 2>(a, stream);
  if (group <= 4) return launch_group<T, kHeadSize, 4>(a, stream);
  return launch_group<T, kHeadSize, 8>(a, stream);  // larger groups: tiles of 8 heads
}

// The launch for one cache dtype over every supported head size.
template <typename T>
cudaError_t launch_dtype(const PagedDecodeArgs& a, cudaStream_t stream) {
  switch (a.head_size) {
    case 64:
      return launch_head<T, 64>(a, stream);
    case 80:
      return launch_head<T, 80>(a, stream);
    case 96:
      return launch_head<T, 96>(a, stream);
    case 128:
      return launch_head<T, 128>(a, stream);
    case 256:
      return launch_head<T, 256>(a, stream);
    default:
      return cudaErrorInvalidValue;  // unsupported head size
  }
}

}  // namespace paged_decode
}  // namespace cuda_kernels
}  // namespace pagedserve
