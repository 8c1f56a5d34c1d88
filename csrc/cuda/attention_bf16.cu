// The paged decode kernels (paged_decode.cuh) for __nv_bfloat16 caches.
#include "paged_decode.cuh"

namespace pagedserve {
namespace cuda_kernels {

cudaError_t paged_decode_bf16(const PagedDecodeArgs& args, cudaStream_t stream) {
  return paged_decode::launch_dtype<__nv_bfloat16>(args, stream);
}

}  // namespace cuda_kernels
}  // namespace pagedserve
