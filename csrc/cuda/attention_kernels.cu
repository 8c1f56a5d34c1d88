// CUDA paged decode attention: one thread block per (head, sequence[, partition]).
//
// Same algorithm as csrc/cpu/attention.cpp: logits = scale * q . k for every
// cached token, a softmax that subtracts the max, then sum_t p_t * v_t, all in
// float32. Both passes give a group of lanes one token, each lane 16-byte chunks
// of its K row (a group dot product) or V row (per-lane accumulators). The
// partitioned (v2) variant splits long contexts over kPartitionSize-token thread
// blocks and a second kernel merges the partial results with their max logits
// and exp sums.
#include "launchers.h"
#include "numerics.cuh"

namespace pagedserve {
namespace cuda_kernels {

namespace {

constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
// The single-pass kernel keeps all logits in shared memory; past this many
// tokens (32 KiB of logits) the partitioned kernel is used.
constexpr int kMaxSinglePassContext = 8192;

constexpr int pow2_ceil(int n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

// How a warp reads K and V rows in 16-byte chunks: kLanesPerRow lanes (a power
// of two) share a row, so a warp reads kRowsPerWarp tokens at once; a lane takes
// chunks rl, rl + kLanesPerRow, ... of its row (lanes past the row's end idle).
template <typename T, int kHeadSize>
struct RowTiling {
  static constexpr int kVec = 16 / sizeof(T);  // elements per chunk
  static_assert(kHeadSize % kVec == 0, "head rows must be whole 16-byte chunks");
  static constexpr int kChunks = kHeadSize / kVec;
  static constexpr int kLanesPerRow = kChunks >= kWarpSize ? kWarpSize : pow2_ceil(kChunks);
  static constexpr int kRowsPerWarp = kWarpSize / kLanesPerRow;
  static constexpr int kChunksPerLane = (kChunks + kLanesPerRow - 1) / kLanesPerRow;
};

// The attended tokens are [begin, context_len): begin = context_len - sliding_window
// under a sliding window (earlier blocks are never read: they may be released), else 0.
__device__ __forceinline__ int attended_begin(int context_len, int sliding_window) {
  return sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
}

// kPartition == 0: the whole attended span, result to out.
// kPartition > 0: tokens [begin + p * kPartition, begin + (p + 1) * kPartition),
// normalized partial result to tmp_out plus its max logit and exp sum.
// K and V rows are read in 16-byte chunks (the caches are 16-byte aligned and
// every supported head row is whole chunks).
template <typename T, int kHeadSize, int kPartition>
__global__ void __launch_bounds__(kNumThreads) paged_attention_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, kHeadSize]
    float* __restrict__ tmp_out,          // [num_seqs, num_heads, max_partitions, kHeadSize]
    float* __restrict__ max_logits,       // [num_seqs, num_heads, max_partitions]
    float* __restrict__ exp_sums,         // [num_seqs, num_heads, max_partitions]
    const T* __restrict__ query,          // [num_seqs, num_heads, kHeadSize] strided rows
    const T* __restrict__ key_cache,      // [num_blocks, num_kv_heads, block_size, kHeadSize]
    const T* __restrict__ value_cache,    // [num_blocks, num_kv_heads, block_size, kHeadSize]
    const int32_t* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int32_t* __restrict__ context_lens,  // [num_seqs]
    int num_kv_heads, int block_size, int max_blocks_per_seq, int max_partitions,
    int64_t q_stride_seq, int64_t q_stride_head, float scale, int sliding_window) {
  using Tiling = RowTiling<T, kHeadSize>;
  constexpr int kVec = Tiling::kVec, kLanesPerRow = Tiling::kLanesPerRow, kRowsPerWarp = Tiling::kRowsPerWarp;
  constexpr int kRowsPerStep = kNumWarps * kRowsPerWarp;  // tokens the block reads at once
  const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int sub = lane / kLanesPerRow, rl = lane % kLanesPerRow;  // row of the warp, lane in the row
  const int context_len = context_lens[seq];
  const int start = attended_begin(context_len, sliding_window) + (kPartition > 0 ? part * kPartition : 0);
  const int end = kPartition > 0 ? min(start + kPartition, context_len) : context_len;
  const int64_t row = static_cast<int64_t>(seq) * num_heads + head;
  if (start >= end) {
    // No tokens here. Single pass: zeros (the empty context). Partitioned: the
    // reduce kernel only reads partitions that hold tokens.
    if (kPartition == 0) {
      for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) out[row * kHeadSize + d] = from_float<T>(0.f);
    }
    return;
  }
  const int n = end - start;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int32_t* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;

  extern __shared__ float logits[];  // [n]
  __shared__ float q_s[kHeadSize];
  __shared__ float red[kNumWarps];
  __shared__ float acc_s[kRowsPerStep][kHeadSize];

  const T* q = query + seq * q_stride_seq + head * q_stride_head;
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) q_s[d] = to_float(q[d]) * scale;
  __syncthreads();

  // Pass 1: kLanesPerRow lanes per token, a dot product over its 16-byte chunks.
  // Every lane of a warp runs the same iterations (the group sum shuffles the whole warp).
  float local_max = -FLT_MAX;
  for (int base = warp * kRowsPerWarp; base < n; base += kRowsPerStep) {
    const int i = base + sub;
    float dot = 0.f;
    if (i < n) {
      const int t = start + i;
      const int64_t block = table[t / block_size];
      const T* k = key_cache + ((block * num_kv_heads + kv_head) * block_size + t % block_size) * kHeadSize;
#pragma unroll
      for (int c = 0; c < Tiling::kChunksPerLane; ++c) {
        const int chunk = rl + c * kLanesPerRow;
        if (chunk < Tiling::kChunks) {
          Vec16<T> kv;
          kv.load(k + chunk * kVec);
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot += q_s[chunk * kVec + e] * kv.v[e];
        }
      }
    }
    dot = warp_sum<kLanesPerRow>(dot);  // every lane of the row holds its sum
    if (i < n) {
      if (rl == 0) logits[i] = dot;
      local_max = fmaxf(local_max, dot);
    }
  }
  const float max_logit = block_reduce<true>(local_max, red);

  // Safe softmax numerator: exp(l - max) <= 1.
  float local_sum = 0.f;
  for (int i = threadIdx.x; i < n; i += kNumThreads) {
    const float e = __expf(logits[i] - max_logit);
    logits[i] = e;
    local_sum += e;
  }
  const float exp_sum = block_reduce<false>(local_sum, red);
  const float inv_sum = 1.f / exp_sum;

  // Pass 2: the same tiling over V rows; each lane accumulates its chunks of its rows.
  float acc[Tiling::kChunksPerLane][kVec];
#pragma unroll
  for (int c = 0; c < Tiling::kChunksPerLane; ++c) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[c][e] = 0.f;
  }
  for (int i = warp * kRowsPerWarp + sub; i < n; i += kRowsPerStep) {
    const int t = start + i;
    const int64_t block = table[t / block_size];
    const T* v = value_cache + ((block * num_kv_heads + kv_head) * block_size + t % block_size) * kHeadSize;
    const float p = logits[i];
#pragma unroll
    for (int c = 0; c < Tiling::kChunksPerLane; ++c) {
      const int chunk = rl + c * kLanesPerRow;
      if (chunk < Tiling::kChunks) {
        Vec16<T> vv;
        vv.load(v + chunk * kVec);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[c][e] += p * vv.v[e];
      }
    }
  }
#pragma unroll
  for (int c = 0; c < Tiling::kChunksPerLane; ++c) {
    const int chunk = rl + c * kLanesPerRow;
    if (chunk < Tiling::kChunks) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc_s[warp * kRowsPerWarp + sub][chunk * kVec + e] = acc[c][e];
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) {
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) o += acc_s[r][d];
    o *= inv_sum;
    if (kPartition == 0) {
      out[row * kHeadSize + d] = from_float<T>(o);
    } else {
      tmp_out[(row * max_partitions + part) * kHeadSize + d] = o;
    }
  }
  if (kPartition > 0 && threadIdx.x == 0) {
    max_logits[row * max_partitions + part] = max_logit;
    exp_sums[row * max_partitions + part] = exp_sum;
  }
}

// Merges the partitions of one (head, sequence): each partial output is
// weighted by its exp sum rescaled to the global max logit.
template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kNumThreads) paged_attention_reduce_kernel(
    T* __restrict__ out,                     // [num_seqs, num_heads, kHeadSize]
    const float* __restrict__ tmp_out,       // [num_seqs, num_heads, max_partitions, kHeadSize]
    const float* __restrict__ max_logits,    // [num_seqs, num_heads, max_partitions]
    const float* __restrict__ exp_sums,      // [num_seqs, num_heads, max_partitions]
    const int32_t* __restrict__ context_lens,  // [num_seqs]
    int max_partitions, int sliding_window) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int64_t row = static_cast<int64_t>(seq) * gridDim.x + head;
  const int attended = context_lens[seq] - attended_begin(context_lens[seq], sliding_window);
  const int num_parts = (attended + kPartitionSize - 1) / kPartitionSize;
  const float* ml = max_logits + row * max_partitions;
  const float* es = exp_sums + row * max_partitions;
  float global_max = -FLT_MAX;
  for (int p = 0; p < num_parts; ++p) global_max = fmaxf(global_max, ml[p]);
  float total = 0.f;
  for (int p = 0; p < num_parts; ++p) total += es[p] * __expf(ml[p] - global_max);
  const float inv_total = num_parts > 0 ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) {
    float o = 0.f;
    for (int p = 0; p < num_parts; ++p) {
      o += tmp_out[(row * max_partitions + p) * kHeadSize + d] * es[p] * __expf(ml[p] - global_max);
    }
    out[row * kHeadSize + d] = from_float<T>(o * inv_total);  // empty context: zeros
  }
}

int num_partitions(int max_context_len) { return (max_context_len + kPartitionSize - 1) / kPartitionSize; }

bool use_partitions(int num_seqs, int num_heads, int max_context_len) {
  const int parts = num_partitions(max_context_len);
  if (parts <= 1) return false;
  // Single pass when the grid already fills the GPU and the logits fit.
  return max_context_len > kMaxSinglePassContext || num_seqs * num_heads <= 512;
}

template <typename T, int kHeadSize>
cudaError_t launch_typed(void* out, const void* query, const void* key_cache, const void* value_cache,
                         const int32_t* block_tables, const int32_t* context_lens, float* workspace, int num_seqs,
                         int num_heads, int num_kv_heads, int block_size, int max_blocks_per_seq,
                         int max_context_len, int64_t q_stride_seq, int64_t q_stride_head, float scale,
                         int sliding_window, cudaStream_t stream) {
  T* o = static_cast<T*>(out);
  const T* q = static_cast<const T*>(query);
  const T* k = static_cast<const T*>(key_cache);
  const T* v = static_cast<const T*>(value_cache);
  if (!use_partitions(num_seqs, num_heads, max_context_len)) {
    const dim3 grid(num_heads, num_seqs, 1);
    const size_t shared = static_cast<size_t>(max_context_len > 0 ? max_context_len : 1) * sizeof(float);
    paged_attention_kernel<T, kHeadSize, 0><<<grid, kNumThreads, shared, stream>>>(
        o, nullptr, nullptr, nullptr, q, k, v, block_tables, context_lens, num_kv_heads, block_size,
        max_blocks_per_seq, 1, q_stride_seq, q_stride_head, scale, sliding_window);
    return cudaGetLastError();
  }
  const int parts = num_partitions(max_context_len);
  const size_t rows = static_cast<size_t>(num_seqs) * num_heads * parts;
  float* tmp_out = workspace;
  float* max_logits = tmp_out + rows * kHeadSize;
  float* exp_sums = max_logits + rows;
  const dim3 grid(num_heads, num_seqs, parts);
  paged_attention_kernel<T, kHeadSize, kPartitionSize><<<grid, kNumThreads, kPartitionSize * sizeof(float), stream>>>(
      o, tmp_out, max_logits, exp_sums, q, k, v, block_tables, context_lens, num_kv_heads, block_size,
      max_blocks_per_seq, parts, q_stride_seq, q_stride_head, scale, sliding_window);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  paged_attention_reduce_kernel<T, kHeadSize><<<dim3(num_heads, num_seqs), kNumThreads, 0, stream>>>(
      o, tmp_out, max_logits, exp_sums, context_lens, parts, sliding_window);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_head_size(int head_size, void* out, const void* query, const void* key_cache,
                             const void* value_cache, const int32_t* block_tables, const int32_t* context_lens,
                             float* workspace, int num_seqs, int num_heads, int num_kv_heads, int block_size,
                             int max_blocks_per_seq, int max_context_len, int64_t q_stride_seq,
                             int64_t q_stride_head, float scale, int sliding_window, cudaStream_t stream) {
#define PAGEDSERVE_HEAD_CASE(H)                                                                               \
  case H:                                                                                                     \
    return launch_typed<T, H>(out, query, key_cache, value_cache, block_tables, context_lens, workspace,      \
                              num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq,              \
                              max_context_len, q_stride_seq, q_stride_head, scale, sliding_window, stream);
  switch (head_size) {
    PAGEDSERVE_HEAD_CASE(64)
    PAGEDSERVE_HEAD_CASE(80)
    PAGEDSERVE_HEAD_CASE(96)
    PAGEDSERVE_HEAD_CASE(128)
    PAGEDSERVE_HEAD_CASE(256)
    default:
      return cudaErrorInvalidValue;  // unsupported head size
  }
#undef PAGEDSERVE_HEAD_CASE
}

}  // namespace

size_t paged_attention_workspace_bytes(int num_seqs, int num_heads, int head_size, int max_context_len,
                                       int sliding_window) {
  if (sliding_window > 0 && sliding_window < max_context_len) max_context_len = sliding_window;
  if (!use_partitions(num_seqs, num_heads, max_context_len)) return 0;
  const size_t rows = static_cast<size_t>(num_seqs) * num_heads * num_partitions(max_context_len);
  return rows * (head_size + 2) * sizeof(float);
}

cudaError_t paged_attention_launch(DType dtype, void* out, const void* query, const void* key_cache,
                                   const void* value_cache, const int32_t* block_tables,
                                   const int32_t* context_lens, float* workspace, int num_seqs, int num_heads,
                                   int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
                                   int max_context_len, int64_t q_stride_seq, int64_t q_stride_head, float scale,
                                   int sliding_window, cudaStream_t stream) {
  if (num_seqs == 0) return cudaSuccess;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || sliding_window < 0) return cudaErrorInvalidValue;
  // A query attends to at most sliding_window tokens: that bounds the partitions and the shared logits.
  if (sliding_window > 0 && sliding_window < max_context_len) max_context_len = sliding_window;
  switch (dtype) {
    case DType::kFloat32:
      return launch_head_size<float>(head_size, out, query, key_cache, value_cache, block_tables, context_lens,
                                     workspace, num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq,
                                     max_context_len, q_stride_seq, q_stride_head, scale, sliding_window, stream);
    case DType::kFloat16:
      return launch_head_size<__half>(head_size, out, query, key_cache, value_cache, block_tables, context_lens,
                                      workspace, num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq,
                                      max_context_len, q_stride_seq, q_stride_head, scale, sliding_window, stream);
    case DType::kBFloat16:
      return launch_head_size<__nv_bfloat16>(head_size, out, query, key_cache, value_cache, block_tables,
                                             context_lens, workspace, num_seqs, num_heads, num_kv_heads, block_size,
                                             max_blocks_per_seq, max_context_len, q_stride_seq, q_stride_head,
                                             scale, sliding_window, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda_kernels
}  // namespace pagedserve
