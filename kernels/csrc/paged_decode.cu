// Decode attention's dtype dispatch and the split-K decision's inputs (kvrelay_ops.h).
#include "kvrelay_ops.h"

namespace kvrelay {

// Defined in paged_decode_{f32,f16,bf16}.cu.
cudaError_t paged_decode_f32(const PagedDecodeParams& params, cudaStream_t stream);
cudaError_t paged_decode_f16(const PagedDecodeParams& params, cudaStream_t stream);
cudaError_t paged_decode_bf16(const PagedDecodeParams& params, cudaStream_t stream);

bool decode_supports_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 ||
         head_dim == 256;
}

cudaError_t paged_decode_attention(const PagedDecodeParams& params, DType dtype,
                                   cudaStream_t stream) {
  const int bs = params.block_size;
  if (!decode_supports_head_dim(params.head_dim) || bs <= 0 || (bs & (bs - 1)) != 0 ||
      params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0 ||
      params.sliding_window < 0 || !(params.soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  if (params.num_seqs == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return paged_decode_f32(params, stream);
    case DType::kFloat16:
      return paged_decode_f16(params, stream);
    case DType::kBFloat16:
      return paged_decode_bf16(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvrelay
