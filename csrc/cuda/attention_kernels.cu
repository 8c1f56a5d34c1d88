// CUDA paged decode attention: one thread block per (head, sequence[, partition]).
//
// Same algorithm as csrc/cpu/attention.cpp: logits = scale * q . k for every
// cached token, a softmax that subtracts the max, then sum_t p_t * v_t, all in
// float32. Pass 1 gives each warp whole tokens (a warp-level dot product), pass
// 2 gives warps tokens and lanes head dimensions. The partitioned (v2) variant
// splits long contexts over kPartitionSize-token thread blocks and a second
// kernel merges the partial results with their max logits and exp sums.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>

#include "launchers.h"

namespace pagedserve {
namespace cuda_kernels {

namespace {

constexpr int kWarpSize = 32;
constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
// The single-pass kernel keeps all logits in shared memory; past this many
// tokens (32 KiB of logits) the partitioned kernel is used.
constexpr int kMaxSinglePassContext = 8192;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide reduction; every thread gets the result. Starts and ends with a
// barrier, so shared-memory writes before it are visible after it.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* red /* [kNumWarps] */) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < kNumWarps ? red[lane] : (kMax ? -FLT_MAX : 0.f);
  return kMax ? warp_max(v) : warp_sum(v);
}

// The attended tokens are [begin, context_len): begin = context_len - sliding_window
// under a sliding window (earlier blocks are never read: they may be released), else 0.
__device__ __forceinline__ int attended_begin(int context_len, int sliding_window) {
  return sliding_window > 0 ? max(0, context_len - sliding_window) : 0;
}

// kPartition == 0: the whole attended span, result to out.
// kPartition > 0: tokens [begin + p * kPartition, begin + (p + 1) * kPartition),
// normalized partial result to tmp_out plus its max logit and exp sum.
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
  const int head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_heads = gridDim.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
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
  __shared__ float acc_s[kNumWarps][kHeadSize];

  const T* q = query + seq * q_stride_seq + head * q_stride_head;
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) q_s[d] = to_float(q[d]) * scale;
  __syncthreads();

  // Pass 1: one warp per token.
  float local_max = -FLT_MAX;
  for (int i = warp; i < n; i += kNumWarps) {
    const int t = start + i;
    const int64_t block = table[t / block_size];
    const T* k = key_cache + ((block * num_kv_heads + kv_head) * block_size + t % block_size) * kHeadSize;
    float dot = 0.f;
#pragma unroll
    for (int d = lane; d < kHeadSize; d += kWarpSize) dot += q_s[d] * to_float(k[d]);
    dot = warp_sum(dot);  // every lane holds the sum
    if (lane == 0) logits[i] = dot;
    local_max = fmaxf(local_max, dot);
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

  // Pass 2: warps take tokens, lanes take head dimensions (coalesced V rows).
  constexpr int kDimsPerLane = (kHeadSize + kWarpSize - 1) / kWarpSize;
  float acc[kDimsPerLane];
#pragma unroll
  for (int j = 0; j < kDimsPerLane; ++j) acc[j] = 0.f;
  for (int i = warp; i < n; i += kNumWarps) {
    const int t = start + i;
    const int64_t block = table[t / block_size];
    const T* v = value_cache + ((block * num_kv_heads + kv_head) * block_size + t % block_size) * kHeadSize;
    const float p = logits[i];
#pragma unroll
    for (int j = 0; j < kDimsPerLane; ++j) {
      const int d = lane + j * kWarpSize;
      if (d < kHeadSize) acc[j] += p * to_float(v[d]);
    }
  }
#pragma unroll
  for (int j = 0; j < kDimsPerLane; ++j) {
    const int d = lane + j * kWarpSize;
    if (d < kHeadSize) acc_s[warp][d] = acc[j];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kHeadSize; d += kNumThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) o += acc_s[w][d];
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
