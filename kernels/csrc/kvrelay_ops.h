// Host-side entry points of kvrelay's CUDA kernels: plain pointers, sizes and int64 strides.
//
// No ATen or torch header may appear here or in any .cu file: CI compiles the kernels with
// nvcc alone (`make kernels-check`) on machines whose torch has no CUDA. The torch binding
// (torch_binding.cpp) is the only file that sees both worlds.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kvrelay {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Strides, in elements, of the block-major cache
// [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; head_dim is contiguous.
struct CacheStrides {
  int64_t block;
  int64_t layer;
  int64_t kv;  // from a layer's K to its V
  int64_t token;
  int64_t head;
};

struct PagedDecodeParams {
  void* out;                    // [num_seqs, num_heads, head_dim], contiguous
  const void* query;            // [num_seqs, num_heads, head_dim], strided rows and heads
  int64_t q_seq_stride;
  int64_t q_head_stride;
  const void* kv_cache;         // already offset to nothing: `layer` selects the layer
  CacheStrides cache;
  int64_t layer;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t table_stride;
  const int32_t* seq_lens;      // [num_seqs] context of each decode, its own token included
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;               // a power of two
  float scale;
  // Per-call variants (kvrelay_kernels/attention_variants.py). sliding_window > 0: a decode
  // sees its last sliding_window keys only (the context before them is never read, and the
  // split-K partitions below cover the window, not the context); 0: every key. soft_cap > 0:
  // each scaled score s becomes soft_cap * tanh(s / soft_cap); 0: no cap.
  int sliding_window;
  float soft_cap;
  // Split-K: `num_partitions` > 1 splits each context into `partition_size`-token pieces,
  // written to the fp32 workspace below and merged by a reduction kernel.
  int num_partitions;
  int partition_size;
  float* partial_out;           // [num_seqs, num_heads, num_partitions, head_dim]
  float* partial_max;           // [num_seqs, num_heads, num_partitions] (log2 domain)
  float* partial_sum;           // [num_seqs, num_heads, num_partitions]
};

// Query heads one CTA serves. Larger GQA groups are split over several CTAs (each reads the
// KV head again), which keeps the per-thread state of the decode kernel bounded.
constexpr int kMaxGroupPerCta = 8;
// Tokens per split-K partition; also the context length above which splitting is considered.
constexpr int kPartitionSize = 512;

// Head sizes with compiled kernels.
bool decode_supports_head_dim(int head_dim);

// Launches decode attention (and the reduction when split). Returns the launch error.
cudaError_t paged_decode_attention(const PagedDecodeParams& params, DType dtype,
                                   cudaStream_t stream);

struct WriteKVParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim]
  const void* value;  // [num_tokens, num_kv_heads, head_dim]
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  void* kv_cache;
  CacheStrides cache;
  int64_t layer;
  // [num_tokens]; negative slots (padding, e.g. a CUDA graph's unused rows) write nowhere.
  // Slots are checked against the cache on the host when the step is planned; the kernel
  // also skips any slot past `num_blocks` rather than write outside the cache.
  const int64_t* slot_mapping;
  int num_tokens;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int64_t num_blocks;
};

// Scatters new keys and values (same dtype as the cache) into their slots.
cudaError_t write_kv(const WriteKVParams& params, DType dtype, cudaStream_t stream);

// Copies whole blocks: `block_bytes` contiguous bytes at `kv_cache + id * block_stride_bytes`
// from src[i] to dst[i]. Both byte counts must be multiples of 16.
cudaError_t copy_blocks(void* kv_cache, int64_t block_stride_bytes, int64_t block_bytes,
                        const int64_t* src, const int64_t* dst, int num_pairs,
                        cudaStream_t stream);

}  // namespace kvrelay
