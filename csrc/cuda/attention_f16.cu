// The paged decode kernels (paged_decode.cuh) for __half caches.
#include "paged_decode.cuh"

namespace pagedserve {
namespace cuda_kernels {

cudaError_t paged_decode_f16(const PagedDecodeArgs& args, cudaStream_t stream) {
  return paged_decode::launch_dtype<__half>(args, stream);
}

}  // namespace cuda_kernels
}  // namespace pagedserve
