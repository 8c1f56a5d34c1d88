// CUDA elementwise ops of a Llama block: RMSNorm (plain, and fused with the
// residual add), neox RoPE and SiLU-and-mul, one launch each. float32 math
// inside, rounded to the tensor dtype where the torch reference
// (engine/ops/reference.py, HF's arithmetic) rounds, so kernel and reference differ
// only by summation order and fast-math exp/rsqrt.
#include "launchers.h"
#include "numerics.cuh"

namespace pagedserve {
namespace cuda_kernels {

namespace {

int row_threads(int n) {  // a warp multiple, up to 1024, for one row of n elements
  const int warps = (n + kWarpSize - 1) / kWarpSize;
  return (warps < 32 ? (warps < 1 ? 1 : warps) : 32) * kWarpSize;
}

// o = weight * round(x * inv_rms) over one row, each thread its elements.
template <typename T>
__device__ __forceinline__ void write_normed(T* o, const T* x, const T* weight, int hidden, float inv_rms) {
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(x[i]) * inv_rms));
  }
}

// One thread block per row: out = weight * round(x / rms(x)).
template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out,           // [num_tokens, hidden] rows out_stride apart
                                const T* __restrict__ input,   // [num_tokens, hidden] rows in_stride apart
                                const T* __restrict__ weight,  // [hidden]
                                int hidden, int64_t in_stride, int64_t out_stride, float eps) {
  __shared__ float red[32];
  const T* x = input + blockIdx.x * in_stride;
  T* o = out + blockIdx.x * out_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  write_normed(o, x, weight, hidden, rsqrtf(block_reduce<false>(ss, red) / hidden + eps));
}

// One thread block per row, in place: residual = round(residual + x), then x = rms_norm(residual).
// Each thread reads back only the residual elements it wrote.
template <typename T>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ input,     // [num_tokens, hidden] rows in_stride apart
                                          T* __restrict__ residual,  // [num_tokens, hidden] rows res_stride apart
                                          const T* __restrict__ weight,  // [hidden]
                                          int hidden, int64_t in_stride, int64_t res_stride, float eps) {
  __shared__ float red[32];
  T* x = input + blockIdx.x * in_stride;
  T* r = residual + blockIdx.x * res_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = round_to<T>(to_float(r[i]) + to_float(x[i]));
    r[i] = from_float<T>(v);
    ss += v * v;
  }
  write_normed(x, r, weight, hidden, rsqrtf(block_reduce<false>(ss, red) / hidden + eps));
}

// One thread block per row: out = round(silu(gate)) * up.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out,          // [num_tokens, d] rows out_stride apart
                                    const T* __restrict__ input,  // [num_tokens, 2 * d] rows in_stride apart
                                    int d, int64_t in_stride, int64_t out_stride) {
  const T* x = input + blockIdx.x * in_stride;
  T* o = out + blockIdx.x * out_stride;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float g = to_float(x[i]);
    o[i] = from_float<T>(round_to<T>(g / (1.f + __expf(-g))) * to_float(x[d + i]));
  }
}

// One thread block per token, threads over (head, pair): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
// cos and sin rounded to T and every product and sum rounded, as the reference's torch ops round them.
template <typename T>
__global__ void rotary_embedding_kernel(const int64_t* __restrict__ positions,  // [num_tokens]
                                        T* __restrict__ x,  // [num_tokens, num_heads, head_size] strided
                                        const float* __restrict__ cos_sin_cache,  // [max_position, head_size]
                                        int num_heads, int head_size, int max_position, int64_t stride_token,
                                        int64_t stride_head) {
  const int64_t pos = positions[blockIdx.x];
  if (pos < 0 || pos >= max_position) return;  // never from the engine; the CPU op raises instead
  const int half = head_size / 2;
  const float* cs = cos_sin_cache + pos * head_size;
  for (int idx = threadIdx.x; idx < num_heads * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    T* v = x + blockIdx.x * stride_token + h * stride_head;
    const float c = round_to<T>(cs[i]), s = round_to<T>(cs[half + i]);
    const float x1 = to_float(v[i]), x2 = to_float(v[half + i]);
    v[i] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    v[half + i] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

template <template <typename> class Launch, typename... Args>
cudaError_t by_dtype(DType dtype, Args... args) {
  switch (dtype) {
    case DType::kFloat32: return Launch<float>::run(args...);
    case DType::kFloat16: return Launch<__half>::run(args...);
    case DType::kBFloat16: return Launch<__nv_bfloat16>::run(args...);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
struct RmsNorm {
  static cudaError_t run(void* out, const void* input, const void* weight, int num_tokens, int hidden,
                         int64_t in_stride, int64_t out_stride, float eps, cudaStream_t stream) {
    rms_norm_kernel<T><<<num_tokens, row_threads(hidden), 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(input), static_cast<const T*>(weight), hidden, in_stride,
        out_stride, eps);
    return cudaGetLastError();
  }
};

template <typename T>
struct FusedAddRmsNorm {
  static cudaError_t run(void* input, void* residual, const void* weight, int num_tokens, int hidden,
                         int64_t in_stride, int64_t res_stride, float eps, cudaStream_t stream) {
    fused_add_rms_norm_kernel<T><<<num_tokens, row_threads(hidden), 0, stream>>>(
        static_cast<T*>(input), static_cast<T*>(residual), static_cast<const T*>(weight), hidden, in_stride,
        res_stride, eps);
    return cudaGetLastError();
  }
};

template <typename T>
struct SiluAndMul {
  static cudaError_t run(void* out, const void* input, int num_tokens, int d, int64_t in_stride, int64_t out_stride,
                         cudaStream_t stream) {
    silu_and_mul_kernel<T><<<num_tokens, row_threads(d), 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(input), d, in_stride, out_stride);
    return cudaGetLastError();
  }
};

template <typename T>
struct Rotary {
  static cudaError_t run(const int64_t* positions, void* x, const float* cos_sin_cache, int num_tokens, int num_heads,
                         int head_size, int max_position, int64_t stride_token, int64_t stride_head,
                         cudaStream_t stream) {
    rotary_embedding_kernel<T><<<num_tokens, row_threads(num_heads * head_size / 2), 0, stream>>>(
        positions, static_cast<T*>(x), cos_sin_cache, num_heads, head_size, max_position, stride_token,
        stride_head);
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t rms_norm_launch(DType dtype, void* out, const void* input, const void* weight, int num_tokens,
                            int hidden, int64_t in_stride, int64_t out_stride, float eps, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return by_dtype<RmsNorm>(dtype, out, input, weight, num_tokens, hidden, in_stride, out_stride, eps, stream);
}

cudaError_t fused_add_rms_norm_launch(DType dtype, void* input, void* residual, const void* weight, int num_tokens,
                                      int hidden, int64_t in_stride, int64_t res_stride, float eps,
                                      cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  return by_dtype<FusedAddRmsNorm>(dtype, input, residual, weight, num_tokens, hidden, in_stride, res_stride, eps,
                                   stream);
}

cudaError_t silu_and_mul_launch(DType dtype, void* out, const void* input, int num_tokens, int d, int64_t in_stride,
                                int64_t out_stride, cudaStream_t stream) {
  if (num_tokens == 0 || d == 0) return cudaSuccess;
  return by_dtype<SiluAndMul>(dtype, out, input, num_tokens, d, in_stride, out_stride, stream);
}

cudaError_t rotary_embedding_launch(DType dtype, const int64_t* positions, void* x, const float* cos_sin_cache,
                                    int num_tokens, int num_heads, int head_size, int max_position,
                                    int64_t stride_token, int64_t stride_head, cudaStream_t stream) {
  if (num_tokens == 0 || num_heads == 0) return cudaSuccess;
  return by_dtype<Rotary>(dtype, positions, x, cos_sin_cache, num_tokens, num_heads, head_size, max_position,
                          stride_token, stride_head, stream);
}

}  // namespace cuda_kernels
}  // namespace pagedserve
