// Paged prefill attention on the CPU: the causal attention of a step's multi-token chunks
// (a prompt, or a chunk of one after a cached or earlier-computed prefix), read straight from
// the block-major KV cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], fp32 or
// bf16 (the math is fp32: bf16 keys and values are widened as they are read).
//
// The torch reference gathers each chunk's keys and values into contiguous copies and calls
// SDPA: for a 128-token bf16 prompt of a 135M model that was ~13% of the prefill on a 2-core
// EPYC (0.36 ms a layer in SDPA's flash kernel, 9 heads x 64 dims), where the arithmetic is a
// few tens of microseconds. Here a tile of up to 16 query vectors (consecutive rows x the query
// heads of one KV head, GQA) meets 16 keys at a time: the keys are transposed once per chunk
// and KV head into [head_dim][keys] fp32, so each score tile is head_dim fused multiply-adds of
// a broadcast query element and 16 keys' elements (no horizontal sums); the values are read
// where they lie and added into the 16 accumulators with the online softmax's weights.
//
// Work is split over (chunk, KV head, row tile) items with torch's thread pool; a KV head's row
// tiles go in a zigzag order (first, last, second, ...) so that the contiguous ranges each
// thread takes hold equal causal work. Sliding window and soft cap as in the decode kernel.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kvrelay_vec16;  // vfloat, kLanes, widen, load, store

constexpr int64_t kKeys = 16;     // keys per score tile: one vector of scores per query
constexpr int64_t kBlock = 64;    // keys per softmax step (its per-query work shared by 64)
constexpr int64_t kQueries = 16;  // query vectors per tile (rows x heads of one KV head)
constexpr float kNoScore = -3.0e38f;  // finite stand-in for -inf (fast-math builds)
constexpr float kMinExponent = -80.f;  // exp(-80) is a normal float; its weight is nil

struct Shape {
  int64_t num_heads, head_dim, kv_heads, group, block_size, max_blocks;
  int64_t token_stride, kv_stride, block_stride, layer_offset;
  int64_t q_row, out_row;  // element strides between query / output rows
  int64_t rows_per_tile;   // query rows in one tile (their heads of a KV head: <= kQueries)
};

struct Chunk {
  int64_t q_start, q_len, context;  // the chunk's rows are the context's last q_len positions
};

// The keys query row r of a chunk (0-based in the chunk) sees: [first, last].
inline int64_t last_key(const Chunk& c, int64_t r) { return c.context - c.q_len + r; }
inline int64_t first_key(const Chunk& c, int64_t r, int64_t window) {
  const int64_t last = last_key(c, r);
  return window > 0 && last + 1 > window ? last + 1 - window : 0;
}

template <typename T>
const T* key_row(const Shape& s, const T* cache, const int64_t* table, int64_t key, int64_t head) {
  return cache + table[key / s.block_size] * s.block_stride + s.layer_offset +
         (key % s.block_size) * s.token_stride + head * s.head_dim;
}

// One thread's working memory: the transposed keys of the (chunk, KV head) it works on, and
// one query tile's queries, accumulators, running maxima and sums, and a key block's scores
// (then weights).
struct Scratch {
  std::vector<float> keys_t;  // [head_dim][padded keys]
  int64_t padded = 0;
  int64_t chunk = -1, head = -1;  // whose keys keys_t holds
  std::vector<float> qf, acc, probs;
  float m[kQueries], l[kQueries];
  explicit Scratch(const Shape& s)
      : qf(kQueries * s.head_dim), acc(kQueries * s.head_dim), probs(kQueries * kBlock) {}
};

// keys_t[d][j] = key j's element d (widened), for keys [0, context) padded with zeros to
// whole blocks.
template <typename T>
void transpose_keys(const Shape& s, const T* cache, const int64_t* table, int64_t context,
                    int64_t head, Scratch& w) {
  const int64_t padded = (context + kBlock - 1) / kBlock * kBlock, dim = s.head_dim;
  w.padded = padded;
  w.keys_t.assign(dim * padded, 0.f);
  float* kt = w.keys_t.data();
  for (int64_t j = 0; j < context; ++j) {
    const T* k = key_row(s, cache, table, j, head);
    for (int64_t d = 0; d < dim; ++d) kt[d * padded + j] = widen(k[d]);
  }
}

// Scores of keys [j0, j0 + 16) for the tile's 16 query vectors (unused ones are zeros), into
// probs[q][at..at+16): head_dim broadcast multiply-adds each, the 16 keys in the lanes.
inline void score_keys(const Shape& s, Scratch& w, int64_t j0, int64_t at) {
  const int64_t dim = s.head_dim;
  const float* kt = w.keys_t.data() + j0;
  const float* qf = w.qf.data();
  vfloat acc[kQueries] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const vfloat k = load(kt + d * w.padded);
    for (int q = 0; q < kQueries; ++q) acc[q] += qf[q * dim + d] * k;
  }
  for (int q = 0; q < kQueries; ++q) store(w.probs.data() + q * kBlock + at, acc[q]);
}

// acc[q] += sum_j probs[q][j] * value_j for keys [j0, j0 + count) of KV head `head`: each
// value chunk is loaded once for the tile's 16 accumulators.
template <typename T>
void accumulate_block(const Shape& s, const T* cache, const int64_t* table, int64_t head,
                      int64_t j0, int64_t count, Scratch& w) {
  const int64_t dim = s.head_dim, chunks = dim / kLanes;
  const T* values[kBlock];
  for (int64_t j = 0; j < count; ++j)
    values[j] = key_row(s, cache, table, j0 + j, head) + s.kv_stride;
  float* acc = w.acc.data();
  const float* probs = w.probs.data();
  for (int64_t c = 0; c < chunks; ++c) {
    vfloat a[kQueries];
    for (int q = 0; q < kQueries; ++q) a[q] = load(acc + q * dim + c * kLanes);
    for (int64_t j = 0; j < count; ++j) {
      const vfloat v = load(values[j] + c * kLanes);
      for (int q = 0; q < kQueries; ++q) a[q] += probs[q * kBlock + j] * v;
    }
    for (int q = 0; q < kQueries; ++q) store(acc + q * dim + c * kLanes, a[q]);
  }
  for (int64_t d = chunks * kLanes; d < dim; ++d)  // a head_dim that is not whole vectors
    for (int q = 0; q < kQueries; ++q) {
      float a = acc[q * dim + d];
      for (int64_t j = 0; j < count; ++j) a += probs[q * kBlock + j] * widen(values[j][d]);
      acc[q * dim + d] = a;
    }
}

// The online softmax over one key block [j0, j0 + kBlock): query q's scores of keys it cannot
// see (outside [first[q], last[q]]; `masked` false: every query sees every key) are dropped,
// its running max and sum take the rest in, its accumulator is rescaled, and its scores
// become weights (0 for a dropped key).
inline void softmax_block(const Shape& s, int64_t j0, const int64_t* first, const int64_t* last,
                          bool masked, float cap, Scratch& w) {
  for (int q = 0; q < kQueries; ++q) {
    float* p = w.probs.data() + q * kBlock;
    if (cap > 0.f) {
      const float inv = 1.f / cap;
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) p[j] = cap * std::tanh(p[j] * inv);
    }
    if (masked) {
      const int64_t lo = first[q] - j0, hi = last[q] - j0;
#pragma omp simd
      for (int j = 0; j < kBlock; ++j) p[j] = j >= lo && j <= hi ? p[j] : kNoScore;
    }
    float block_max = kNoScore;
#pragma omp simd reduction(max : block_max)
    for (int j = 0; j < kBlock; ++j) block_max = std::max(block_max, p[j]);
    if (block_max == kNoScore) {  // sees none of these keys (past its row, before its window)
      std::fill(p, p + kBlock, 0.f);
      continue;
    }
    const float new_max = std::max(w.m[q], block_max);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < kBlock; ++j) {
      // Clamped: an argument that underflows sends libmvec's vector exp to its slow scalar
      // path (a third of the kernel's time when masked scores went in unclamped).
      const float e = std::exp(std::max(p[j] - new_max, kMinExponent));
      p[j] = p[j] == kNoScore ? 0.f : e;
      sum += p[j];
    }
    const float rescale =
        w.m[q] == kNoScore ? 0.f : std::exp(std::max(w.m[q] - new_max, kMinExponent));
    w.l[q] = w.l[q] * rescale + sum;
    w.m[q] = new_max;
    if (rescale != 1.f) {
      float* a = w.acc.data() + q * s.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < s.head_dim; ++d) a[d] *= rescale;
    }
  }
}

struct Tile {
  int64_t chunk, head, r0, rows, g0, heads;  // rows [r0, r0+rows) x query heads [g0, g0+heads)
};

// One tile: its queries (scaled) in, its keys a 64-key block at a time (scored 16 at a time)
// from the first any of them sees to the last, its outputs written.
template <typename T>
void attend(const Shape& s, const Tile& t, const Chunk& c, const T* q, const T* cache,
            const int64_t* table, float scale, int64_t window, float cap, T* out, Scratch& w) {
  const int64_t dim = s.head_dim, n = t.rows * t.heads;
  int64_t first[kQueries], last[kQueries];
  std::fill(w.qf.begin(), w.qf.end(), 0.f);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t i = 0; i < kQueries; ++i) {
    w.m[i] = kNoScore;
    w.l[i] = 0.f;
    first[i] = 1;  // an unused query sees nothing (first > last)
    last[i] = 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = t.r0 + i / t.heads, h = t.head * s.group + t.g0 + i % t.heads;
    const T* qr = q + (c.q_start + r) * s.q_row + h * dim;
    for (int64_t d = 0; d < dim; ++d) w.qf[i * dim + d] = widen(qr[d]) * scale;
    first[i] = first_key(c, r, window);
    last[i] = last_key(c, r);
  }
  const int64_t lo = first_key(c, t.r0, window), hi = last_key(c, t.r0 + t.rows - 1);
  // Every query of the tile sees keys [see_lo, see_hi]; blocks within need no mask.
  int64_t see_lo = 0, see_hi = hi;
  for (int64_t i = 0; i < n; ++i) {
    see_lo = std::max(see_lo, first[i]);
    see_hi = std::min(see_hi, last[i]);
  }
  for (int64_t j0 = lo - lo % kBlock; j0 <= hi; j0 += kBlock) {
    const int64_t end = std::min(hi + 1, j0 + kBlock);
    for (int64_t k0 = j0; k0 < end; k0 += kKeys) score_keys(s, w, k0, k0 - j0);
    const bool masked = j0 < see_lo || j0 + kBlock - 1 > see_hi;
    softmax_block(s, j0, first, last, masked, cap, w);
    accumulate_block(s, cache, table, t.head, j0, end - j0, w);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = t.r0 + i / t.heads, h = t.head * s.group + t.g0 + i % t.heads;
    T* o = out + (c.q_start + r) * s.out_row + h * dim;
    const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(w.acc[i * dim + d] * inv);
  }
}

// Every tile of every chunk, a KV head's row tiles in zigzag order (see the top).
std::vector<Tile> tiles(const Shape& s, const std::vector<Chunk>& chunks) {
  std::vector<Tile> all;
  const int64_t heads = std::min(s.group, kQueries);
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    const int64_t row_tiles = (chunks[ci].q_len + s.rows_per_tile - 1) / s.rows_per_tile;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t k = 0; k < row_tiles; ++k) {
        const int64_t rt = k % 2 == 0 ? k / 2 : row_tiles - 1 - k / 2;
        const int64_t r0 = rt * s.rows_per_tile;
        const int64_t rows = std::min(s.rows_per_tile, chunks[ci].q_len - r0);
        for (int64_t g0 = 0; g0 < s.group; g0 += heads)
          all.push_back({ci, h, r0, rows, g0, std::min(heads, s.group - g0)});
      }
  }
  return all;
}

template <typename T>
void run(const Shape& s, const std::vector<Chunk>& chunks, const torch::Tensor& q,
         const torch::Tensor& kv_cache, const torch::Tensor& tables, float scale, int64_t window,
         float cap, torch::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const std::vector<Tile> work = tiles(s, chunks);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t i = begin; i < end; ++i) {
      const Tile& t = work[i];
      const Chunk& c = chunks[t.chunk];
      const int64_t* table = tp + t.chunk * s.max_blocks;
      if (w.chunk != t.chunk || w.head != t.head) {
        transpose_keys(s, cache, table, c.context, t.head, w);
        w.chunk = t.chunk;
        w.head = t.head;
      }
      attend(s, t, c, qp, cache, table, scale, window, cap, op, w);
    }
  });
}

}  // namespace

// q, out: [T, Hq, D] (rows may be strided; each row's heads contiguous); chunks: [C, 3] int64
// (first query row, query rows, context length) of each multi-token sequence, its rows the
// context's last positions; block_tables: [C, max_blocks] int64. Writes the chunks' rows of
// `out` (others untouched). sliding_window > 0: each query sees its last sliding_window keys;
// soft_cap > 0: scores become soft_cap * tanh(score / soft_cap).
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                             int64_t layer, const torch::Tensor& chunks,
                             const torch::Tensor& block_tables, double scale,
                             int64_t sliding_window, double soft_cap, torch::Tensor& out) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  kv_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_prefill_attention takes fp32 or bf16, the query's, cache's and out's alike");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache 6-D block-major");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out [T, Hq, D] alike");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "each row's heads must be contiguous");
  TORCH_CHECK(chunks.scalar_type() == torch::kLong && chunks.dim() == 2 && chunks.size(1) == 3 &&
                  block_tables.scalar_type() == torch::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == chunks.size(0),
              "chunks [C, 3] and block_tables [C, max_blocks] int64");
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0.0 && soft_cap <= 3.0e38,
              "sliding_window (0: none) and soft_cap (0: none) must be >= 0");
  Shape s{};
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.block_size = kv_cache.size(3);
  s.kv_heads = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(5) == s.head_dim && s.num_heads % s.kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  s.group = s.num_heads / s.kv_heads;
  s.max_blocks = block_tables.size(1);
  s.token_stride = s.kv_heads * s.head_dim;
  s.kv_stride = s.block_size * s.token_stride;
  s.block_stride = kv_cache.size(1) * 2 * s.kv_stride;
  s.layer_offset = layer * 2 * s.kv_stride;
  s.q_row = q.stride(0);
  s.out_row = out.stride(0);
  s.rows_per_tile = std::max<int64_t>(1, kQueries / s.group);
  auto table = block_tables.contiguous();
  auto spec = chunks.contiguous();
  const int64_t* cp = spec.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t num_blocks = kv_cache.size(0);
  std::vector<Chunk> list;
  for (int64_t i = 0; i < spec.size(0); ++i) {
    const Chunk c{cp[3 * i], cp[3 * i + 1], cp[3 * i + 2]};
    TORCH_CHECK(c.q_start >= 0 && c.q_len >= 1 && c.q_start + c.q_len <= q.size(0) &&
                    c.q_len <= c.context && c.context <= s.max_blocks * s.block_size,
                "chunk ", i, " does not fit its query rows or block table");
    for (int64_t b = 0; b < (c.context + s.block_size - 1) / s.block_size; ++b)
      TORCH_CHECK(tp[i * s.max_blocks + b] >= 0 && tp[i * s.max_blocks + b] < num_blocks,
                  "chunk ", i, " names a block outside the cache");
    list.push_back(c);
  }
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  if (dtype == torch::kFloat) {
    run<float>(s, list, q, kv_cache, table, fscale, sliding_window, cap, out);
  } else {
    run<c10::BFloat16>(s, list, q, kv_cache, table, fscale, sliding_window, cap, out);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill_attention", &paged_prefill_attention,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "causal attention of multi-token chunks over the block-major paged KV cache, into out "
        "(CPU, fp32 or bf16)",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("layer"),
        pybind11::arg("chunks"), pybind11::arg("block_tables"), pybind11::arg("scale"),
        pybind11::arg("sliding_window"), pybind11::arg("soft_cap"), pybind11::arg("out"));
}
