// Decode attention instantiated for one dtype; one file per dtype so nvcc builds them in parallel.
#include "paged_decode.cuh"

namespace kvrelay {

cudaError_t paged_decode_f32(const PagedDecodeParams& params, cudaStream_t stream) {
  return launch_paged_decode_dtype<float>(params, stream);
}

}  // namespace kvrelay
