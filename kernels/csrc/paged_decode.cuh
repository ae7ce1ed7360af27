// Paged decode attention: one query token per sequence over its block-major paged context.
//
// One CTA serves (sequence, KV head, up to kMaxGroupPerCta query heads of that KV head,
// context partition). The query heads that share a KV head (GQA) are computed together, so
// every K/V byte is read from HBM once per group. Decode is bound by HBM bandwidth, so the
// design is about keeping loads in flight:
//   * K and V tiles (~8 KiB of K each) are staged into shared memory with 16-byte cp.async
//     copies, double-buffered: tile i+1 streams in while tile i is computed. The copy layout
//     (flat 16-byte chunks) is independent of the compute layout, so head sizes whose rows are
//     not a power of two of vectors (80, 96) still load fully coalesced.
//   * QK: 8 lanes per token, each taking every 8th 16-byte vector of the row, so 8 lanes read
//     128 contiguous bytes of shared memory (no bank conflicts); an xor-shuffle sums them.
//   * Softmax is online (running max and sum per query head, base-2 with the scale folded
//     into q), one rescale per tile.
//   * PV: each warp takes every 4th token of the tile; a lane owns (query head, vector) pairs
//     of the output; the four warps' partial outputs are summed once, at the end.
//   * Long contexts are split into partitions (split-K) written to an fp32 workspace and
//     merged by `paged_decode_reduce_kernel`, so a small batch still fills the GPU.
//   * A sliding window moves the first key read (`first_key`): partitions start there, so a
//     windowed layer reads and splits its window only. A soft cap (`soft_cap`) is a template
//     switch (kSoftCap): plain attention compiles to the kernel it was.
#pragma once

#include <cfloat>
#include <cstdint>

#include "device_utils.cuh"
#include "kvrelay_ops.h"

namespace kvrelay {

__host__ __device__ constexpr int floor_pow2(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

__host__ __device__ constexpr int clamp_int(int x, int lo, int hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The first key a decode of `context` tokens reads: its last `window` (0: every key).
__device__ __forceinline__ int first_key(int context, int window) {
  return window > 0 && context > window ? context - window : 0;
}

// cap2 * tanh(s / cap2), tanh by exp2: --use_fast_math turns tanhf into tanh.approx.f32
// (relative error ~2^-11, beyond an fp32 cache's tolerance) where ex2.approx keeps ~2^-22. It
// saturates to +-cap2 through inf and 0, no NaN.
__device__ __forceinline__ float soft_cap(float s, float cap2, float inv_cap2) {
  const float e = exp2f(s * inv_cap2 * (2.f * 1.4426950408889634f));
  return cap2 * (1.f - 2.f / (e + 1.f));
}

template <typename T, int kHeadDim>
struct DecodeConfig {
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kVec = Vec16<T>::kElems;  // elements per 16-byte vector
  static constexpr int kNumVec = kHeadDim / kVec;  // vectors per K or V row
  static constexpr int kRowBytes = kHeadDim * static_cast<int>(sizeof(T));
  // ~8 KiB of K (and of V) per stage: with two stages that is 32 KiB, small enough for
  // several CTAs per SM, large enough to keep each SM's share of HBM bandwidth busy.
  static constexpr int kTile = clamp_int(floor_pow2(8192 / kRowBytes), 8, 64);
  static constexpr int kStages = 2;
  static constexpr int kQkLanes = 8;  // lanes per token in QK (8 x 16 B = one 128 B wavefront)
  static constexpr int kQkVecPerLane = (kNumVec + kQkLanes - 1) / kQkLanes;
  static constexpr int kTokensPerPass = kThreads / kQkLanes;
  static constexpr int kQkPasses = (kTile + kTokensPerPass - 1) / kTokensPerPass;
  static constexpr int kPvItems = (kMaxGroupPerCta * kNumVec + kWarpSize - 1) / kWarpSize;
  static constexpr int kStageBytes = 2 * kTile * kRowBytes;  // K + V of one tile
  static constexpr int kReduceBytes = kWarps * kMaxGroupPerCta * kHeadDim * 4;
  static constexpr int kKvSmemBytes =
      kStages * kStageBytes > kReduceBytes ? kStages * kStageBytes : kReduceBytes;

  static_assert(kHeadDim % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
  static_assert(kTile % (kWarps) == 0, "the tile must split evenly over warps");
  static_assert(kTile <= 2 * kWarpSize, "softmax handles at most 64 tokens per tile");
};

template <typename T, int kHeadDim, bool kSoftCap>
__global__ void __launch_bounds__(128) paged_decode_kernel(const PagedDecodeParams p) {
  using Cfg = DecodeConfig<T, kHeadDim>;
  constexpr int kVec = Cfg::kVec;
  constexpr int kTile = Cfg::kTile;

  __shared__ __align__(16) unsigned char kv_raw[Cfg::kKvSmemBytes];
  __shared__ __align__(16) float q_smem[kMaxGroupPerCta][kHeadDim];
  __shared__ float s_smem[kMaxGroupPerCta][kTile];  // scores, then probabilities
  __shared__ float m_smem[kMaxGroupPerCta];         // running max (log2 domain)
  __shared__ float l_smem[kMaxGroupPerCta];         // running sum of exp2
  __shared__ float alpha_smem[kMaxGroupPerCta];     // this tile's rescale of the output

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + kMaxGroupPerCta - 1) / kMaxGroupPerCta;
  const int kv_head = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks;
  const int head0 = kv_head * group + chunk * kMaxGroupPerCta;
  const int num_q = min(kMaxGroupPerCta, group - chunk * kMaxGroupPerCta);
  const int seq = blockIdx.y;
  const int part = blockIdx.z;

  const int context = p.seq_lens[seq];
  const int start = first_key(context, p.sliding_window) + part * p.partition_size;
  if (start >= context) return;  // this sequence needs fewer partitions than the longest
  // Not start + partition_size: unsplit, that is INT_MAX, and past a window's start it overflows.
  const int end = start + min(p.partition_size, context - start);
  const int num_tiles = (end - start + kTile - 1) / kTile;

  // q, pre-multiplied by scale * log2(e) so the softmax can use exp2.
  const float q_scale = p.scale * 1.4426950408889634f;
  // The cap in the same base-2 domain: log2(e) * c * tanh(s / c) = c2 * tanh(s2 / c2).
  const float cap2 = p.soft_cap * 1.4426950408889634f;
  const float inv_cap2 = kSoftCap ? 1.f / cap2 : 0.f;
  const T* q = static_cast<const T*>(p.query) + seq * p.q_seq_stride;
  for (int i = tid; i < num_q * kHeadDim; i += Cfg::kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    q_smem[g][d] = to_float(q[(head0 + g) * p.q_head_stride + d]) * q_scale;
  }
  if (tid < kMaxGroupPerCta) {
    m_smem[tid] = -INFINITY;
    l_smem[tid] = 0.f;
  }

  const T* cache = static_cast<const T*>(p.kv_cache) + p.layer * p.cache.layer +
                   static_cast<int64_t>(kv_head) * p.cache.head;
  const int32_t* table = p.block_tables + seq * p.table_stride;
  const int log2_block = __ffs(p.block_size) - 1;
  T* k_stage = reinterpret_cast<T*>(kv_raw);  // [kStages][2 (K, V)][kTile][kHeadDim]

  auto load_tile = [&](int tile, int stage) {
    T* k_dst = k_stage + stage * 2 * kTile * kHeadDim;
    T* v_dst = k_dst + kTile * kHeadDim;
    const int tile_start = start + tile * kTile;
#pragma unroll
    for (int c = tid; c < kTile * Cfg::kNumVec; c += Cfg::kThreads) {
      const int t = c / Cfg::kNumVec, v = c % Cfg::kNumVec;
      const int pos = tile_start + t;
      const bool valid = pos < end;
      const int64_t block = valid ? table[pos >> log2_block] : 0;
      const T* src =
          cache + block * p.cache.block + (pos & (p.block_size - 1)) * p.cache.token + v * kVec;
      cp_async_16(k_dst + t * kHeadDim + v * kVec, src, valid);
      cp_async_16(v_dst + t * kHeadDim + v * kVec, src + p.cache.kv, valid);
    }
  };

  // PV ownership: lane item i is (query head, 16-byte vector) number lane + 32 i.
  float acc[Cfg::kPvItems][kVec];
#pragma unroll
  for (int i = 0; i < Cfg::kPvItems; ++i)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[i][e] = 0.f;
  const int pv_items = num_q * Cfg::kNumVec;

  load_tile(0, 0);
  cp_async_commit();
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile % Cfg::kStages;
    if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) % Cfg::kStages);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning tile `tile`
    cp_async_wait<1>();
    __syncthreads();
    const T* k_tile = k_stage + stage * 2 * kTile * kHeadDim;
    const T* v_tile = k_tile + kTile * kHeadDim;
    const int tile_start = start + tile * kTile;

    // Scores: 8 lanes per token; whole warps are active or idle (kTile is a multiple of 4).
#pragma unroll
    for (int pass = 0; pass < Cfg::kQkPasses; ++pass) {
      const int t = pass * Cfg::kTokensPerPass + tid / Cfg::kQkLanes;
      if (t < kTile) {
        const int sub = tid % Cfg::kQkLanes;
        float k[Cfg::kQkVecPerLane][kVec];
#pragma unroll
        for (int j = 0; j < Cfg::kQkVecPerLane; ++j) {
          const int v = sub + j * Cfg::kQkLanes;
          if (v < Cfg::kNumVec) {
            vec_to_float<T>(*reinterpret_cast<const uint4*>(k_tile + t * kHeadDim + v * kVec),
                            k[j]);
          }
        }
        for (int g = 0; g < num_q; ++g) {
          float dot = 0.f;
#pragma unroll
          for (int j = 0; j < Cfg::kQkVecPerLane; ++j) {
            const int v = sub + j * Cfg::kQkLanes;
            if (v < Cfg::kNumVec) {
#pragma unroll
              for (int e = 0; e < kVec; e += 4) {
                const float4 qv = *reinterpret_cast<const float4*>(&q_smem[g][v * kVec + e]);
                dot += qv.x * k[j][e] + qv.y * k[j][e + 1] + qv.z * k[j][e + 2] +
                       qv.w * k[j][e + 3];
              }
            }
          }
          dot = group_sum<Cfg::kQkLanes>(dot);
          if (kSoftCap) dot = soft_cap(dot, cap2, inv_cap2);
          if (sub == 0) s_smem[g][t] = tile_start + t < end ? dot : -INFINITY;
        }
      }
    }
    __syncthreads();

    // Online softmax: one warp per query head.
    for (int g = warp; g < num_q; g += Cfg::kWarps) {
      const float s0 = lane < kTile ? s_smem[g][lane] : -INFINITY;
      const float s1 = lane + kWarpSize < kTile ? s_smem[g][lane + kWarpSize] : -INFINITY;
      const float m_old = m_smem[g];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
      if (lane < kTile) s_smem[g][lane] = p0;
      if (lane + kWarpSize < kTile) s_smem[g][lane + kWarpSize] = p1;
      const float sum = warp_sum(p0 + p1);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        alpha_smem[g] = alpha;
        l_smem[g] = l_smem[g] * alpha + sum;
        m_smem[g] = m_new;
      }
    }
    __syncthreads();

    // PV: warp w takes tokens w, w + 4, ...; masked tokens have p = 0 and zero-filled V.
#pragma unroll
    for (int i = 0; i < Cfg::kPvItems; ++i) {
      const int item = lane + i * kWarpSize;
      if (item < pv_items) {
        const int g = item / Cfg::kNumVec, v = item % Cfg::kNumVec;
        const float alpha = alpha_smem[g];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[i][e] *= alpha;
        for (int t = warp; t < kTile; t += Cfg::kWarps) {
          const float prob = s_smem[g][t];
          float vf[kVec];
          vec_to_float<T>(*reinterpret_cast<const uint4*>(v_tile + t * kHeadDim + v * kVec), vf);
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[i][e] += prob * vf[e];
        }
      }
    }
    __syncthreads();  // the stage is refilled next iteration; s_smem is rewritten
  }

  // Sum the four warps' partial outputs (the stage buffers are free now).
  float* red = reinterpret_cast<float*>(kv_raw);  // [kWarps][kMaxGroupPerCta][kHeadDim]
#pragma unroll
  for (int i = 0; i < Cfg::kPvItems; ++i) {
    const int item = lane + i * kWarpSize;
    if (item < pv_items) {
      const int g = item / Cfg::kNumVec, v = item % Cfg::kNumVec;
      float* dst = red + (warp * kMaxGroupPerCta + g) * kHeadDim + v * kVec;
#pragma unroll
      for (int e = 0; e < kVec; ++e) dst[e] = acc[i][e];
    }
  }
  __syncthreads();
  const bool split = p.num_partitions > 1;
  for (int i = tid; i < num_q * kHeadDim; i += Cfg::kThreads) {
    const int g = i / kHeadDim, d = i % kHeadDim;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) o += red[(w * kMaxGroupPerCta + g) * kHeadDim + d];
    const float l = l_smem[g];
    o = l > 0.f ? o / l : 0.f;
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head0 + g;
    if (split) {
      p.partial_out[(row * p.num_partitions + part) * kHeadDim + d] = o;
    } else {
      static_cast<T*>(p.out)[row * kHeadDim + d] = from_float<T>(o);
    }
  }
  if (split && tid < num_q) {
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head0 + tid;
    p.partial_max[row * p.num_partitions + part] = m_smem[tid];
    p.partial_sum[row * p.num_partitions + part] = l_smem[tid];
  }
}

// Merges the split-K partitions of one (sequence, head): weights 2^(m_p - M) * l_p.
// Dynamic shared memory: num_partitions floats.
template <typename T>
__global__ void __launch_bounds__(128) paged_decode_reduce_kernel(const PagedDecodeParams p) {
  extern __shared__ float weights[];
  __shared__ float warp_vals[4];
  const int head = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int keys = p.seq_lens[seq] - first_key(p.seq_lens[seq], p.sliding_window);
  const int parts = (keys + p.partition_size - 1) / p.partition_size;
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* pmax = p.partial_max + row * p.num_partitions;
  const float* psum = p.partial_sum + row * p.num_partitions;

  float m = -INFINITY;
  for (int i = tid; i < parts; i += blockDim.x) m = fmaxf(m, pmax[i]);
  m = warp_max(m);
  if (lane == 0) warp_vals[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(warp_vals[0], warp_vals[1]), fmaxf(warp_vals[2], warp_vals[3]));
  __syncthreads();
  float total = 0.f;
  for (int i = tid; i < parts; i += blockDim.x) {
    const float w = psum[i] * exp2f(pmax[i] - m);
    weights[i] = w;
    total += w;
  }
  total = warp_sum(total);
  if (lane == 0) warp_vals[warp] = total;
  __syncthreads();
  total = warp_vals[0] + warp_vals[1] + warp_vals[2] + warp_vals[3];
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const float* po = p.partial_out + row * p.num_partitions * p.head_dim;
  T* out = static_cast<T*>(p.out) + row * p.head_dim;
  for (int d = tid; d < p.head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < parts; ++i) o += weights[i] * po[i * p.head_dim + d];
    out[d] = from_float<T>(o * inv);
  }
}

template <typename T, int kHeadDim>
cudaError_t launch_paged_decode(const PagedDecodeParams& params, cudaStream_t stream) {
  using Cfg = DecodeConfig<T, kHeadDim>;
  PagedDecodeParams p = params;
  if (p.num_partitions <= 1) {
    p.num_partitions = 1;
    p.partition_size = 0x7fffffff;  // one partition covers any context
  }
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = (group + kMaxGroupPerCta - 1) / kMaxGroupPerCta;
  const dim3 grid(p.num_kv_heads * chunks, p.num_seqs, p.num_partitions);
  if (p.soft_cap > 0.f) {
    paged_decode_kernel<T, kHeadDim, true><<<grid, Cfg::kThreads, 0, stream>>>(p);
  } else {
    paged_decode_kernel<T, kHeadDim, false><<<grid, Cfg::kThreads, 0, stream>>>(p);
  }
  if (p.num_partitions > 1) {
    const size_t smem = static_cast<size_t>(p.num_partitions) * sizeof(float);
    paged_decode_reduce_kernel<T>
        <<<dim3(p.num_heads, p.num_seqs), 128, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

// One dtype's launcher: dispatches on head_dim (defined in paged_decode_<dtype>.cu).
template <typename T>
cudaError_t launch_paged_decode_dtype(const PagedDecodeParams& params, cudaStream_t stream) {
  switch (params.head_dim) {
    case 64:
      return launch_paged_decode<T, 64>(params, stream);
    case 80:
      return launch_paged_decode<T, 80>(params, stream);
    case 96:
      return launch_paged_decode<T, 96>(params, stream);
    case 128:
      return launch_paged_decode<T, 128>(params, stream);
    case 256:
      return launch_paged_decode<T, 256>(params, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvrelay
