// Decode attention instantiated for one dtype; one file per dtype so nvcc builds them in parallel.
#include "paged_decode.cuh"

namespace kvrelay {

cudaError_t paged_decode_bf16(const PagedDecodeParams& params, cudaStream_t stream) {
  return launch_paged_decode_dtype<__nv_bfloat16>(params, stream);
}

}  // namespace kvrelay
