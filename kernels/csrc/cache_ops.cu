// KV cache maintenance: `write_kv` scatters new tokens' K and V into their slots, and
// `copy_blocks` copies whole blocks (copy-on-write). Both are pure data movement, so they
// move 16-byte vectors whenever the addresses allow it.
#include <cstdint>

#include "device_utils.cuh"
#include "kvrelay_ops.h"

namespace kvrelay {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// One CTA per token; threads stride over (head, vector) pairs of K and of V.
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(128) write_kv_kernel(const WriteKVParams p) {
  const int token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // a padding token owns no slot
  const int64_t block = slot / p.block_size;
  if (block >= p.num_blocks) return;  // never write outside the cache (checked on the host too)
  const int64_t offset = slot % p.block_size;
  T* k_dst = static_cast<T*>(p.kv_cache) + block * p.cache.block + p.layer * p.cache.layer +
             offset * p.cache.token;
  T* v_dst = k_dst + p.cache.kv;
  const T* k_src = static_cast<const T*>(p.key) + token * p.key_token_stride;
  const T* v_src = static_cast<const T*>(p.value) + token * p.value_token_stride;
  constexpr int kStep = kVectorized ? Vec16<T>::kElems : 1;
  const int per_head = p.head_dim / kStep;
  for (int i = threadIdx.x; i < p.num_kv_heads * per_head; i += blockDim.x) {
    const int h = i / per_head, d = (i % per_head) * kStep;
    T* kd = k_dst + h * p.cache.head + d;
    T* vd = v_dst + h * p.cache.head + d;
    const T* ks = k_src + h * p.key_head_stride + d;
    const T* vs = v_src + h * p.value_head_stride + d;
    if constexpr (kVectorized) {
      *reinterpret_cast<uint4*>(kd) = *reinterpret_cast<const uint4*>(ks);
      *reinterpret_cast<uint4*>(vd) = *reinterpret_cast<const uint4*>(vs);
    } else {
      *kd = *ks;
      *vd = *vs;
    }
  }
}

template <typename T>
cudaError_t launch_write_kv(const WriteKVParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  constexpr int kVec = Vec16<T>::kElems;
  const bool vectorized = p.head_dim % kVec == 0 && p.key_token_stride % kVec == 0 &&
                          p.key_head_stride % kVec == 0 && p.value_token_stride % kVec == 0 &&
                          p.value_head_stride % kVec == 0 && p.cache.block % kVec == 0 &&
                          p.cache.layer % kVec == 0 && p.cache.kv % kVec == 0 &&
                          p.cache.token % kVec == 0 && p.cache.head % kVec == 0 &&
                          aligned16(p.key) && aligned16(p.value) && aligned16(p.kv_cache);
  if (vectorized) {
    write_kv_kernel<T, true><<<p.num_tokens, 128, 0, stream>>>(p);
  } else {
    write_kv_kernel<T, false><<<p.num_tokens, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// grid.x: block pairs; grid.y and the threads stride over the block's 16-byte vectors.
__global__ void __launch_bounds__(256)
    copy_blocks_kernel(unsigned char* cache, int64_t block_stride_bytes, int64_t block_vecs,
                       const int64_t* src, const int64_t* dst) {
  const uint4* from = reinterpret_cast<const uint4*>(cache + src[blockIdx.x] * block_stride_bytes);
  uint4* to = reinterpret_cast<uint4*>(cache + dst[blockIdx.x] * block_stride_bytes);
  for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < block_vecs;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    to[i] = from[i];
  }
}

}  // namespace

cudaError_t write_kv(const WriteKVParams& params, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_write_kv<float>(params, stream);
    case DType::kFloat16:
      return launch_write_kv<__half>(params, stream);
    case DType::kBFloat16:
      return launch_write_kv<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t copy_blocks(void* kv_cache, int64_t block_stride_bytes, int64_t block_bytes,
                        const int64_t* src, const int64_t* dst, int num_pairs,
                        cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  if (block_bytes % 16 != 0 || block_stride_bytes % 16 != 0 || !aligned16(kv_cache)) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = block_bytes / 16;
  // Enough CTAs per block that a handful of copies still spreads over the SMs.
  const int64_t per_block = (vecs + 255) / 256;
  const dim3 grid(num_pairs, static_cast<unsigned>(per_block < 8 ? per_block : 8));
  copy_blocks_kernel<<<grid, 256, 0, stream>>>(static_cast<unsigned char*>(kv_cache),
                                               block_stride_bytes, vecs, src, dst);
  return cudaGetLastError();
}

}  // namespace kvrelay
