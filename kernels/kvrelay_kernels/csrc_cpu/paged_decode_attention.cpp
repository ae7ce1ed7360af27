// Paged decode attention on the CPU: one query token per sequence, read straight from the
// block-major KV cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] (fp32).
//
// The torch reference gathers every sequence's K and V into contiguous copies before SDPA;
// at decode that doubles the memory traffic of a memory-bound operation, and attention became
// the larger half of a 48-sequence step at 400 tokens of context. This kernel reads each key
// and value once, where it lies, with an online softmax (running max and sum), for all the
// query heads that share a KV head (GQA) in one pass. Work is split over (sequence, KV head)
// with torch's own thread pool.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Finite stand-in for -inf, so the kernel is safe to build with fast-math flags.
constexpr float kNoScore = -3.0e38f;

}  // namespace

// q: [S, Hq, D]; returns [S, Hq, D]. block_tables: [S, max_blocks] int64; seq_lens: [S] int64.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kFloat,
              "paged_decode_attention is fp32 only");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && q.dim() == 3, "q [S, Hq, D], kv_cache 6-D block-major");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "block_tables and seq_lens must be int64");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_layers = kv_cache.size(1), block_size = kv_cache.size(3);
  const int64_t kv_heads = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == head_dim && num_heads % kv_heads == 0, "head shapes disagree");
  TORCH_CHECK(layer >= 0 && layer < num_layers, "layer out of range");
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* cache = kv_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = kv_heads * head_dim;          // between tokens of a block
  const int64_t kv_stride = block_size * token_stride;       // K -> V of one layer
  const int64_t block_stride = num_layers * 2 * kv_stride;   // between blocks
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * head_dim), m(group), l(group), probs(group * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, h = item % kv_heads;
      const int64_t context = lp[seq];
      TORCH_CHECK(context <= max_blocks * block_size, "seq_len beyond its block table");
      const float* qh = qp + (seq * num_heads + h * group) * head_dim;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      // One block at a time: its scores (the keys stream through once), one softmax rescale
      // per block rather than per token, vectorized exps, then each value read once for all
      // the query heads of this KV head.
      for (int64_t start = 0; start < context; start += block_size) {
        const int64_t count = std::min(block_size, context - start);
        const int64_t block = tp[seq * max_blocks + start / block_size];
        const float* keys = cache + block * block_stride + layer * 2 * kv_stride + h * head_dim;
        const float* values = keys + kv_stride;
        for (int64_t g = 0; g < group; ++g) {
          float* pg = probs.data() + g * block_size;
          float block_max = kNoScore;
          for (int64_t j = 0; j < count; ++j) {
            pg[j] = dot(qh + g * head_dim, keys + j * token_stride, head_dim) * fscale;
            block_max = std::max(block_max, pg[j]);
          }
          const float new_max = std::max(m[g], block_max);
          const float rescale = std::exp(m[g] - new_max);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < count; ++j) {
            pg[j] = std::exp(pg[j] - new_max);
            sum += pg[j];
          }
          l[g] = l[g] * rescale + sum;
          m[g] = new_max;
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
        }
        for (int64_t j = 0; j < count; ++j) {
          const float* v = values + j * token_stride;
          for (int64_t g = 0; g < group; ++g) {
            const float p = probs[g * block_size + j];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * v[d];
          }
        }
      }
      float* oh = op + (seq * num_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) oh[g * head_dim + d] = acc[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the block-major paged KV cache (CPU, fp32)");
}
