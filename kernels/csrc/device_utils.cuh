// Device helpers shared by kvrelay's kernels: 16-byte vectors of fp32 / fp16 / bf16 converted
// to and from fp32, cp.async copies, warp reductions. CUDA headers only (see kvrelay_ops.h).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kvrelay {

constexpr int kWarpSize = 32;

// One 16-byte vector of T: the unit every global load and cp.async moves.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

// Converts a 16-byte vector (given as uint4) of T to kElems floats.
template <typename T>
__device__ __forceinline__ void vec_to_float(const uint4& raw, float* out);

template <>
__device__ __forceinline__ void vec_to_float<float>(const uint4& raw, float* out) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

template <>
__device__ __forceinline__ void vec_to_float<__half>(const uint4& raw, float* out) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void vec_to_float<__nv_bfloat16>(const uint4& raw, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

// Asynchronous 16-byte global -> shared copy (sm_80+). With `valid` false the destination is
// zero-filled and nothing is read: masked tokens then hold zeros rather than stale data, so
// 0 * garbage can never put a NaN into the output.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  // .cg: cache in L2 only; the KV cache is streamed once, L1 would only evict useful lines.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int mask = kWidth / 2; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) { return group_sum<kWarpSize>(x); }

}  // namespace kvrelay
