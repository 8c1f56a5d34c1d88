// Device helpers shared by the CUDA kernels: float32 conversions of the cache
// dtypes, warp and block reductions, and 16-byte vector loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>

#include <cstdint>

namespace pagedserve {
namespace cuda_kernels {

constexpr int kWarpSize = 32;

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

// x rounded to T and back: where torch's code rounds an intermediate to the tensor dtype.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// Sum (or max) over the lanes of aligned groups of kLanes lanes (a power of two
// up to 32); every lane of the warp must take part, and each gets its group's result.
template <int kLanes = kWarpSize>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide sum or max; every thread gets the result. Starts and ends with a
// barrier, so shared-memory writes before it are visible after it.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* red /* [blockDim.x / 32] */) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : (kMax ? -FLT_MAX : 0.f);
  return kMax ? warp_max(v) : warp_sum(v);
}

// kVec = 16 / sizeof(T) elements from 16-byte aligned memory, widened to float32.
template <typename T>
struct Vec16 {
  static constexpr int kVec = 16 / sizeof(T);
  float v[kVec];
  __device__ __forceinline__ void load(const T* p) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = to_float(e[i]);
  }
};

}  // namespace cuda_kernels
}  // namespace pagedserve
