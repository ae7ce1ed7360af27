// Paged decode attention on the CPU: one query token per sequence, read straight from the
// block-major KV cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], fp32 or
// bf16 (the math is fp32 in both: bf16 keys and values are widened as they are read).
//
// The torch reference gathers every sequence's K and V into contiguous copies before SDPA;
// at decode that doubles the memory traffic of a memory-bound operation, and attention became
// the larger half of a 48-sequence step at 400 tokens of context. This kernel reads each key
// and value once, where it lies, with an online softmax (running max and sum), for all the
// query heads that share a KV head (GQA) in one pass. Work is split over (sequence, KV head)
// with torch's own thread pool.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(float x) { return x; }

// bf16 -> fp32 is the 16 bits moved to the top half: written out so GCC vectorizes the loops.
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 fp32 lanes in GCC's portable vector type: one AVX-512 register, two AVX2 ones.
typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
typedef uint32_t vword __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kGroupTile = 4;  // query heads scored together: each key is loaded once

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const c10::BFloat16* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vword w = __builtin_convertvector(h, vword) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

typedef float vhalf_float __attribute__((vector_size(32)));
typedef float vquarter_float __attribute__((vector_size(16)));

// The 16 lanes summed as a tree (halves, then quarters): a few dependent adds instead of 16.
inline float hsum(vfloat v) {
  vhalf_float lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const vhalf_float eight = lo + hi;
  vquarter_float a, b;
  std::memcpy(&a, &eight, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&eight) + sizeof a, sizeof b);
  const vquarter_float four = a + b;
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// Finite stand-in for -inf, so the kernel is safe to build with fast-math flags.
constexpr float kNoScore = -3.0e38f;

struct Shape {
  int64_t num_seqs, num_heads, head_dim, kv_heads, group, block_size, max_blocks;
  int64_t token_stride, kv_stride, block_stride, layer_offset;
};

// Scores of one block's `count` keys for every query head of the group, into probs[g][j]:
// the head_dim is walked 16 lanes at a time with one accumulator per query head (up to
// kGroupTile), so a key is loaded once per tile and reduced once per head.
template <typename T>
void score_block(const Shape& s, const float* qf, const T* keys, int64_t count, float scale,
                 float* probs) {
  const int64_t head_dim = s.head_dim, chunks = head_dim / kLanes;
  for (int64_t j = 0; j < count; ++j) {
    const T* kj = keys + j * s.token_stride;
    for (int64_t g0 = 0; g0 < s.group; g0 += kGroupTile) {
      const int64_t tile = std::min(kGroupTile, s.group - g0);
      vfloat acc[kGroupTile] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        const vfloat k = load(kj + c * kLanes);
        for (int64_t g = 0; g < tile; ++g) acc[g] += load(qf + (g0 + g) * head_dim + c * kLanes) * k;
      }
      for (int64_t g = 0; g < tile; ++g) {
        const float* qg = qf + (g0 + g) * head_dim;
        float sum = hsum(acc[g]);
        for (int64_t d = chunks * kLanes; d < head_dim; ++d) sum += qg[d] * widen(kj[d]);
        probs[(g0 + g) * s.block_size + j] = sum * scale;
      }
    }
  }
}

// acc[g] += sum_j probs[g][j] * value_j over one block: 16 lanes of the accumulator stay in a
// register while the block's values stream past.
template <typename T>
void accumulate_values(const Shape& s, const float* probs, const T* values, int64_t count,
                       float* acc) {
  const int64_t head_dim = s.head_dim, chunks = head_dim / kLanes;
  for (int64_t g = 0; g < s.group; ++g) {
    const float* pg = probs + g * s.block_size;
    float* ag = acc + g * head_dim;
    for (int64_t c = 0; c < chunks; ++c) {
      vfloat a = load(ag + c * kLanes);
      for (int64_t j = 0; j < count; ++j) a += pg[j] * load(values + j * s.token_stride + c * kLanes);
      store(ag + c * kLanes, a);
    }
    for (int64_t d = chunks * kLanes; d < head_dim; ++d) {
      float a = ag[d];
      for (int64_t j = 0; j < count; ++j) a += pg[j] * widen(values[j * s.token_stride + d]);
      ag[d] = a;
    }
  }
}

// Prefetch the `count` keys and values of one KV head in a block (a cache line at a time).
template <typename T>
void prefetch_block(const Shape& s, const T* keys, int64_t count) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t j = 0; j < count; ++j) {
    for (int64_t d = 0; d < s.head_dim; d += kLine) {
      __builtin_prefetch(keys + j * s.token_stride + d);
      __builtin_prefetch(keys + s.kv_stride + j * s.token_stride + d);
    }
  }
}

// One (sequence, KV head): the attention of its `group` query heads over the sequence's keys,
// one block at a time with an online softmax (one rescale per block, not per token).
template <typename T>
void attend(const Shape& s, int64_t seq, int64_t h, const T* q, const T* cache,
            const int64_t* tables, int64_t context, float scale, T* out, std::vector<float>& qf,
            std::vector<float>& acc, std::vector<float>& m, std::vector<float>& l,
            std::vector<float>& probs) {
  const int64_t group = s.group, head_dim = s.head_dim, block_size = s.block_size;
  const T* qh = q + (seq * s.num_heads + h * group) * head_dim;
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = widen(qh[i]);
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(m.begin(), m.end(), kNoScore);
  std::fill(l.begin(), l.end(), 0.f);
  for (int64_t start = 0; start < context; start += block_size) {
    const int64_t count = std::min(block_size, context - start);
    const int64_t block = tables[seq * s.max_blocks + start / block_size];
    const T* keys = cache + block * s.block_stride + s.layer_offset + h * head_dim;
    if (start + block_size < context) {
      // Blocks lie anywhere in the cache, so the hardware prefetcher loses the thread at every
      // block: ask for the next one's keys and values while this one is computed.
      const int64_t next = tables[seq * s.max_blocks + start / block_size + 1];
      prefetch_block(s, cache + next * s.block_stride + s.layer_offset + h * head_dim,
                     std::min(block_size, context - start - block_size));
    }
    score_block(s, qf.data(), keys, count, scale, probs.data());
    for (int64_t g = 0; g < group; ++g) {
      float* pg = probs.data() + g * block_size;
      float block_max = kNoScore;
      for (int64_t j = 0; j < count; ++j) block_max = std::max(block_max, pg[j]);
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
    accumulate_values(s, probs.data(), keys + s.kv_stride, count, acc.data());
  }
  T* oh = out + (seq * s.num_heads + h * group) * head_dim;
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d)
      oh[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d] * inv);
  }
}

template <typename T>
void run(const Shape& s, const torch::Tensor& q, const torch::Tensor& kv_cache,
         const torch::Tensor& tables, const torch::Tensor& lens, float scale, torch::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, s.num_seqs * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = s.group * s.head_dim;
    std::vector<float> qf(width), acc(width), m(s.group), l(s.group);
    std::vector<float> probs(s.group * s.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t context = lp[seq];
      TORCH_CHECK(context <= s.max_blocks * s.block_size, "seq_len beyond its block table");
      attend(s, seq, h, qp, cache, tp, context, scale, op, qf, acc, m, l, probs);
    }
  });
}

}  // namespace

// q: [S, Hq, D]; returns [S, Hq, D] in q's dtype. block_tables: [S, max_blocks] int64;
// seq_lens: [S] int64.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  kv_cache.scalar_type() == dtype,
              "paged_decode_attention takes fp32 or bf16, the query's and the cache's alike");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && q.dim() == 3, "q [S, Hq, D], kv_cache 6-D block-major");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "block_tables and seq_lens must be int64");
  Shape s{};
  s.num_seqs = q.size(0);
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  const int64_t num_layers = kv_cache.size(1);
  s.block_size = kv_cache.size(3);
  s.kv_heads = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == s.head_dim && s.num_heads % s.kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(layer >= 0 && layer < num_layers, "layer out of range");
  s.group = s.num_heads / s.kv_heads;
  s.max_blocks = block_tables.size(1);
  s.token_stride = s.kv_heads * s.head_dim;          // between tokens of a block
  s.kv_stride = s.block_size * s.token_stride;       // K -> V of one layer
  s.block_stride = num_layers * 2 * s.kv_stride;     // between blocks
  s.layer_offset = layer * 2 * s.kv_stride;
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  if (dtype == torch::kFloat) {
    run<float>(s, q, kv_cache, tables, lens, fscale, out);
  } else {
    run<c10::BFloat16>(s, q, kv_cache, tables, lens, fscale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the block-major paged KV cache (CPU, fp32 or bf16)");
}
