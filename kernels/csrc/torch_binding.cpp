// The torch face of kvrelay's CUDA kernels: checks tensors, derives strides and the split-K
// plan, and calls the ATen-free launchers of kvrelay_ops.h. Built only on CUDA machines, by
// torch.utils.cpp_extension (kvrelay_kernels/cuda_backend.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "kvrelay_ops.h"

namespace {

kvrelay::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return kvrelay::DType::kFloat32;
    case torch::kHalf:
      return kvrelay::DType::kFloat16;
    case torch::kBFloat16:
      return kvrelay::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "kvrelay CUDA kernels support float32, float16 and bfloat16, not ",
                  t.scalar_type());
  }
}

kvrelay::CacheStrides cache_strides(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 6, "kv_cache must be [blocks, layers, 2, block_size, heads, dim]");
  TORCH_CHECK(kv_cache.stride(5) == 1, "kv_cache's head_dim must be contiguous");
  return {kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
          kv_cache.stride(4)};
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device]) return cached[device];
  int count = 0;
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  if (device < 64) cached[device] = count;
  return count;
}

}  // namespace

// Split-K pays a reduction and an fp32 workspace; it is worth it when the unsplit grid cannot
// keep every SM busy, and always for very long contexts, where one CTA per sequence would
// leave the GPU waiting on the longest sequence.
int64_t decode_num_partitions(int64_t max_seq_len, int64_t num_seqs, int64_t num_kv_heads,
                              int64_t group, int64_t num_sms) {
  const int64_t parts = (max_seq_len + kvrelay::kPartitionSize - 1) / kvrelay::kPartitionSize;
  if (parts <= 1) return 1;
  const int64_t chunks = (group + kvrelay::kMaxGroupPerCta - 1) / kvrelay::kMaxGroupPerCta;
  const int64_t ctas = num_seqs * num_kv_heads * chunks;
  return (ctas < 2 * num_sms || max_seq_len > 8192) ? parts : 1;
}

// out, query: [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] and
// seq_lens [num_seqs] int32; max_seq_len: the longest of seq_lens, known to the host already.
// num_partitions > 0 fixes the split-K count (a CUDA graph's launch shape must not change;
// any count is correct for contexts up to num_partitions * kPartitionSize, and 1 for any
// context); <= 0 lets decode_num_partitions decide. workspace, when given, is the fp32
// split-K scratch (at least num_seqs * num_heads * num_partitions * (head_dim + 2) floats),
// so nothing is allocated per call. sliding_window > 0: each decode sees its last
// sliding_window keys (0: all); soft_cap > 0: scores become soft_cap * tanh(s / soft_cap).
void paged_decode_attention(torch::Tensor& out, const torch::Tensor& query,
                            const torch::Tensor& kv_cache, int64_t layer,
                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                            int64_t max_seq_len, double scale, int64_t num_partitions,
                            const c10::optional<torch::Tensor>& workspace, int64_t sliding_window,
                            double soft_cap) {
  TORCH_CHECK(query.is_cuda() && kv_cache.is_cuda(), "tensors must be on a CUDA device");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [seqs, heads, dim]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must match query");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == kv_cache.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(), "tables: rows contiguous");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  // A cap that rounds to 0 in fp32 would read as "none": refused with the negative ones.
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX && soft_cap <= 3.0e38 &&
                  (soft_cap == 0.0 || static_cast<float>(soft_cap) > 0.f),
              "sliding_window (0: none) and soft_cap (0: none) must be >= 0 and finite");
  // The keys a decode reads: its window when shorter (what split-K has to cover).
  if (sliding_window > 0) max_seq_len = std::min(max_seq_len, sliding_window);
  const c10::cuda::CUDAGuard guard(query.device());
  const int num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int num_kv_heads = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == head_dim && num_heads % num_kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(kvrelay::decode_supports_head_dim(head_dim), "unsupported head_dim ", head_dim);
  // The kernel moves K and V in 16-byte cp.async copies: every row must start 16-byte aligned.
  const int64_t vec = 16 / kv_cache.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0 &&
                  kv_cache.stride(0) % vec == 0 && kv_cache.stride(1) % vec == 0 &&
                  kv_cache.stride(2) % vec == 0 && kv_cache.stride(3) % vec == 0 &&
                  kv_cache.stride(4) % vec == 0,
              "kv_cache rows must be 16-byte aligned");

  kvrelay::PagedDecodeParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.q_seq_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.kv_cache = kv_cache.data_ptr();
  p.cache = cache_strides(kv_cache);
  p.layer = layer;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = kv_cache.size(3);
  p.scale = static_cast<float>(scale);
  p.sliding_window = static_cast<int>(sliding_window);
  p.soft_cap = static_cast<float>(soft_cap);
  p.partition_size = kvrelay::kPartitionSize;
  p.num_partitions = static_cast<int>(
      num_partitions > 0 ? num_partitions
                         : decode_num_partitions(max_seq_len, num_seqs, num_kv_heads,
                                                 num_heads / num_kv_heads,
                                                 sm_count(query.get_device())));
  TORCH_CHECK(p.num_partitions == 1 ||
                  static_cast<int64_t>(p.num_partitions) * kvrelay::kPartitionSize >= max_seq_len,
              "num_partitions ", p.num_partitions, " cannot cover a context of ", max_seq_len);
  torch::Tensor scratch;
  if (p.num_partitions > 1) {
    const int64_t rows = static_cast<int64_t>(num_seqs) * num_heads * p.num_partitions;
    if (workspace.has_value()) {
      scratch = *workspace;
      TORCH_CHECK(scratch.is_cuda() && scratch.scalar_type() == torch::kFloat &&
                      scratch.is_contiguous() && scratch.numel() >= rows * (head_dim + 2),
                  "workspace must be contiguous fp32 of at least ", rows * (head_dim + 2),
                  " elements");
    } else {
      scratch = torch::empty({rows * (head_dim + 2)}, query.options().dtype(torch::kFloat));
    }
    p.partial_out = scratch.data_ptr<float>();
    p.partial_max = p.partial_out + rows * head_dim;
    p.partial_sum = p.partial_max + rows;
  }
  check_cuda(kvrelay::paged_decode_attention(p, dtype_of(kv_cache),
                                             at::cuda::getCurrentCUDAStream()),
             "paged_decode_attention");
}

// key, value: [num_tokens, num_kv_heads, head_dim] (cache dtype); slot_mapping int64.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
              int64_t layer, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_cuda() && kv_cache.is_cuda(), "tensors must be on a CUDA device");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype");
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [tokens, kv_heads, dim] with a contiguous last dim");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(1) == kv_cache.size(4) &&
                  key.size(2) == kv_cache.size(5),
              "key / value shapes disagree with the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "one slot per token");
  const c10::cuda::CUDAGuard guard(key.device());
  kvrelay::WriteKVParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.kv_cache = kv_cache.data_ptr();
  p.cache = cache_strides(kv_cache);
  p.layer = layer;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = key.size(0);
  p.num_kv_heads = key.size(1);
  p.head_dim = key.size(2);
  p.block_size = kv_cache.size(3);
  p.num_blocks = kv_cache.size(0);
  check_cuda(kvrelay::write_kv(p, dtype_of(kv_cache), at::cuda::getCurrentCUDAStream()),
             "write_kv");
}

// src, dst: [n] int64 block ids on the cache's device. Needs each block contiguous.
void copy_blocks(torch::Tensor& kv_cache, const torch::Tensor& src, const torch::Tensor& dst) {
  TORCH_CHECK(kv_cache.is_cuda(), "kv_cache must be on a CUDA device");
  TORCH_CHECK(src.scalar_type() == torch::kLong && dst.scalar_type() == torch::kLong &&
                  src.is_contiguous() && dst.is_contiguous() && src.numel() == dst.numel(),
              "src and dst must be contiguous int64 of one length");
  TORCH_CHECK(kv_cache[0].is_contiguous(), "copy_blocks needs each block contiguous");
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t elem = kv_cache.element_size();
  check_cuda(kvrelay::copy_blocks(kv_cache.data_ptr(), kv_cache.stride(0) * elem,
                                  kv_cache[0].numel() * elem, src.data_ptr<int64_t>(),
                                  dst.data_ptr<int64_t>(), static_cast<int>(src.numel()),
                                  at::cuda::getCurrentCUDAStream()),
             "copy_blocks");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvrelay CUDA kernels: paged decode attention, write_kv, copy_blocks";
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("out"), py::arg("query"),
        py::arg("kv_cache"), py::arg("layer"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("max_seq_len"), py::arg("scale"), py::arg("num_partitions"),
        py::arg("workspace"), py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0);
  m.def("write_kv", &write_kv);
  m.def("copy_blocks", &copy_blocks);
  m.def("decode_num_partitions", &decode_num_partitions);
}
