// The paged KV cache's CPU kernels: writing new keys and values into their slots (at the end),
// and decode attention.
//
// Paged decode attention on the CPU: one query token per sequence, read straight from the
// block-major KV cache [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], fp32 or
// bf16 (the math is fp32 in both: bf16 keys and values are widened as they are read).
//
// The torch reference gathers every sequence's K and V into contiguous copies before SDPA;
// at decode that doubles the memory traffic of a memory-bound operation, and attention became
// the larger half of a 48-sequence step at 400 tokens of context. This kernel reads each key
// and value once, where it lies, with an online softmax (running max and sum), for all the
// query heads that share a KV head (GQA) in one pass. Work is split over sequences (all their
// KV heads in one pass per block), or over (sequence, KV head) when there are fewer sequences
// than threads, with torch's own thread pool.
//
// Per call (kvrelay_kernels/attention_variants.py): a sliding window starts the key loop at
// the window's first key (blocks before it are never read), and a soft cap turns each scaled
// score s into cap * tanh(s / cap) before the softmax (libmvec's vector tanhf: fast-math).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include "kernel_api.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kvrelay_vec16;  // vfloat, kLanes, widen, load, store

constexpr int64_t kGroupTile = 4;  // query heads scored together: each key is loaded once

// Finite stand-in for -inf, so the kernel is safe to build with fast-math flags.
constexpr float kNoScore = -3.0e38f;

struct Shape {
  int64_t num_seqs, num_heads, head_dim, kv_heads, group, block_size, max_blocks;
  int64_t token_stride, kv_stride, block_stride, layer_offset;
};

// Keys are scored 16 at a time. Each key's dot product with a query head is first a vector
// of 16 partial sums; 16 such vectors are then summed lane-wise as a tree of shuffles (15
// merges, each two permutes and an add) into one vector holding the 16 scores: about three
// operations per key where a horizontal sum per key cost ten. A key's partials go to slot
// bit_reversed(j) so that the tree's output lanes come out in key order.
constexpr int64_t kTile = 16;
constexpr int kBitReversed[kTile] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// One level of the tree: a and b hold partial sums in segments of `W` lanes; the result
// holds a's and b's segments of W/2 lanes side by side, each the sum of a segment's halves.
template <int W>
inline vfloat merge(vfloat a, vfloat b) {
  vword lo, hi;
  for (int s = 0, i = 0; s < kTile / W; ++s) {
    for (int k = 0; k < W / 2; ++k, ++i) {
      lo[i] = s * W + k;
      hi[i] = s * W + W / 2 + k;
      lo[i + W / 2] = kTile + s * W + k;
      hi[i + W / 2] = kTile + s * W + W / 2 + k;
    }
    i += W / 2;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// The lane-wise sums of 16 vectors (part[i] at slot i): lane i of the result sums part[i].
inline vfloat sum_lanes(const float* part) {
  vfloat l8[8], l4[4], l2[2];
  for (int i = 0; i < 8; ++i) l8[i] = merge<16>(load(part + 2 * i * kTile), load(part + (2 * i + 1) * kTile));
  for (int i = 0; i < 4; ++i) l4[i] = merge<8>(l8[2 * i], l8[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l2[i] = merge<4>(l4[2 * i], l4[2 * i + 1]);
  return merge<2>(l2[0], l2[1]);
}

// Scores of up to 16 keys (`count`) for `TILE` query heads from g0, into scores[g * kTile + j],
// scaled: one accumulator vector per query head, so a key is loaded once for the tile. TILE
// is a compile-time count so that the accumulators stay in registers.
template <typename T, int TILE>
void score_heads(const Shape& s, const float* qf, const T* keys, int64_t count, float scale,
                 int64_t g0, float* part, float* scores) {
  const int64_t head_dim = s.head_dim, chunks = head_dim / kLanes;
  for (int64_t j = 0; j < kTile; ++j) {
    vfloat acc[TILE] = {};
    if (j < count) {
      const T* kj = keys + j * s.token_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        const vfloat k = load(kj + c * kLanes);
        for (int g = 0; g < TILE; ++g) acc[g] += load(qf + (g0 + g) * head_dim + c * kLanes) * k;
      }
      for (int64_t d = chunks * kLanes; d < head_dim; ++d)
        for (int g = 0; g < TILE; ++g) acc[g][0] += qf[(g0 + g) * head_dim + d] * widen(kj[d]);
    }
    for (int g = 0; g < TILE; ++g) store(part + (g * kTile + kBitReversed[j]) * kTile, acc[g]);
  }
  for (int g = 0; g < TILE; ++g)
    store(scores + (g0 + g) * kTile, sum_lanes(part + g * kTile * kTile) * scale);
}

// acc[g] += sum_j probs[g][j] * value_j over `count` keys for `TILE` query heads from g0:
// each value chunk is loaded once and added into every head's accumulator (in registers).
template <typename T, int TILE>
void accumulate_heads(const Shape& s, const float* probs, const T* values, int64_t count,
                      int64_t g0, float* acc) {
  const int64_t head_dim = s.head_dim, chunks = head_dim / kLanes;
  for (int64_t c = 0; c < chunks; ++c) {
    vfloat a[TILE];
    for (int g = 0; g < TILE; ++g) a[g] = load(acc + (g0 + g) * head_dim + c * kLanes);
    for (int64_t j = 0; j < count; ++j) {
      const vfloat v = load(values + j * s.token_stride + c * kLanes);
      for (int g = 0; g < TILE; ++g) a[g] += probs[(g0 + g) * kTile + j] * v;
    }
    for (int g = 0; g < TILE; ++g) store(acc + (g0 + g) * head_dim + c * kLanes, a[g]);
  }
  for (int64_t d = chunks * kLanes; d < head_dim; ++d) {
    for (int64_t g = g0; g < g0 + TILE; ++g) {
      float a = acc[g * head_dim + d];
      for (int64_t j = 0; j < count; ++j) a += probs[g * kTile + j] * widen(values[j * s.token_stride + d]);
      acc[g * head_dim + d] = a;
    }
  }
}

// A tile's scores and its value accumulation for every query head of the group, in head
// tiles of up to kGroupTile (each a compile-time width).
template <typename T>
void score_tile(const Shape& s, const float* qf, const T* keys, int64_t count, float scale,
                float* part, float* scores) {
  for (int64_t g0 = 0; g0 < s.group; g0 += kGroupTile) {
    switch (std::min(kGroupTile, s.group - g0)) {
      case 1: score_heads<T, 1>(s, qf, keys, count, scale, g0, part, scores); break;
      case 2: score_heads<T, 2>(s, qf, keys, count, scale, g0, part, scores); break;
      case 3: score_heads<T, 3>(s, qf, keys, count, scale, g0, part, scores); break;
      default: score_heads<T, 4>(s, qf, keys, count, scale, g0, part, scores); break;
    }
  }
}

template <typename T>
void accumulate_values(const Shape& s, const float* probs, const T* values, int64_t count,
                       float* acc) {
  for (int64_t g0 = 0; g0 < s.group; g0 += kGroupTile) {
    switch (std::min(kGroupTile, s.group - g0)) {
      case 1: accumulate_heads<T, 1>(s, probs, values, count, g0, acc); break;
      case 2: accumulate_heads<T, 2>(s, probs, values, count, g0, acc); break;
      case 3: accumulate_heads<T, 3>(s, probs, values, count, g0, acc); break;
      default: accumulate_heads<T, 4>(s, probs, values, count, g0, acc); break;
    }
  }
}

// A cache line asked for ahead of its use, into L2 (prefetcht2: asked into L1 with prefetcht0,
// the requests waited in the core's few L1 miss slots and a step's attention read 11 GB/s
// instead of 20 on a 2-core EPYC, fp32, 16 sequences of 192 tokens). Spelled out in assembly
// on x86: GCC's vectorizer deletes __builtin_prefetch from the loops it vectorizes, and a loop
// of nothing but prefetches is one (this kernel's prefetch loop compiled to an empty loop: a
// decode step's attention ran at a third of the memory bandwidth, waiting on every block).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// Part `part` of `parts` of a block's keys and values of the heads [h0, h0 + heads), as the
// attention of a block before it goes on. Asked for a part at a time: a whole block's 192
// lines asked at once overflow the core's few outstanding-miss slots and most are dropped
// (measured on a 2-core EPYC, 16 sequences of 200 tokens, bf16, every layer in turn: 169 us a
// layer without prefetching, 137 asking for the whole block at once, 99 in parts; 81 with the
// keys and values in cache).
template <typename T>
void prefetch_part(const Shape& s, const T* block, int64_t h0, int64_t heads, int64_t part,
                   int64_t parts) {
  constexpr int64_t kLine = 64 / sizeof(T);
  if (heads == s.kv_heads) {  // every head: the block's keys then values, one span
    const int64_t span = 2 * s.kv_stride;
    const int64_t begin = part * span / parts, end = (part + 1) * span / parts;
    for (int64_t o = begin - begin % kLine; o < end; o += kLine) prefetch_line(block + o);
    return;
  }
  const int64_t rows = 2 * s.block_size, width = heads * s.head_dim;  // (K or V, token) rows
  for (int64_t r = part * rows / parts; r < (part + 1) * rows / parts; ++r) {
    const T* row = block + (r / s.block_size) * s.kv_stride + (r % s.block_size) * s.token_stride +
                   h0 * s.head_dim;
    for (int64_t d = 0; d < width; d += kLine) prefetch_line(row + d);
  }
}

// Each of the group's `n` scores of a tile becomes cap * tanh(score / cap).
inline void soft_cap_scores(const Shape& s, float* scores, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t g = 0; g < s.group; ++g) {
    float* sg = scores + g * kTile;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sg[j] = cap * std::tanh(sg[j] * inv);
  }
}

// Online softmax over one tile of scores (`n` of them per query head): each head's running max
// and sum take the tile in, its accumulator is rescaled once, and the scores become weights.
inline void softmax_update(const Shape& s, float* probs, int64_t n, float* m, float* l,
                           float* acc) {
  for (int64_t g = 0; g < s.group; ++g) {
    float* pg = probs + g * kTile;
    float tile_max = kNoScore;
    for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, pg[j]);
    const float new_max = std::max(m[g], tile_max);
    const float rescale = std::exp(m[g] - new_max);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      pg[j] = std::exp(pg[j] - new_max);
      sum += pg[j];
    }
    l[g] = l[g] * rescale + sum;
    m[g] = new_max;
    if (rescale != 1.f) {
      float* ag = acc + g * s.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < s.head_dim; ++d) ag[d] *= rescale;
    }
  }
}

// The blocks one thread reads, in the order it reads them (its items one after another), so
// that the block `kAhead` places on is asked for while this one is computed, across the end of
// an item too: asked for within an item only, each item's first block found none of its lines
// in cache (fp32, 16 x 192: ~8% slower a layer). Two ahead measured the same as one (285 vs
// 289 us a layer); two leaves room for a slower memory.
template <typename T>
struct BlockStream {
  struct Entry {
    const T* block;
    int64_t h0;  // the item's first KV head
  };
  static constexpr int64_t kAhead = 2;
  std::vector<Entry> order;
  int64_t position = 0;  // the block being computed

  // The block to ask for while the current one is computed (null past the end); advances.
  const Entry* advance() {
    const int64_t target = position++ + kAhead;
    return target < static_cast<int64_t>(order.size()) ? &order[target] : nullptr;
  }
};

// One thread's working memory, reused over its items.
struct Scratch {
  explicit Scratch(const Shape& s)
      : qf(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), m(s.num_heads),
        l(s.num_heads), probs(s.group * kTile), part(kGroupTile * kTile * kTile) {}
  std::vector<float> qf, acc, m, l;  // per query head of the item's KV heads
  std::vector<float> probs;  // [group][kTile] scores, then softmax weights, of one tile
  std::vector<float> part;   // [kGroupTile][kTile][kTile] partial sums of a tile's scores
};

// The first key a decode of `context` tokens sees: its last `window` keys (0: every key).
inline int64_t first_key(int64_t context, int64_t window) {
  return window > 0 && context > window ? context - window : 0;
}

// One sequence's KV heads [h0, h0 + heads): the attention of their query heads over the
// sequence's keys from `first` on, block by block (each block's keys and values of those heads
// read in one pass, contiguous when every head is taken), 16 keys at a time with an online
// softmax; `cap` > 0 soft-caps the scores.
template <typename T>
void attend(const Shape& s, int64_t seq, int64_t h0, int64_t heads, const T* q, const T* cache,
            const int64_t* tables, int64_t context, int64_t first, float scale, float cap, T* out,
            Scratch& w, BlockStream<T>& stream) {
  const int64_t group = s.group, head_dim = s.head_dim, block_size = s.block_size;
  const int64_t width = heads * group * head_dim;  // the item's query heads, one after another
  const T* qh = q + (seq * s.num_heads + h0 * group) * head_dim;
  for (int64_t i = 0; i < width; ++i) w.qf[i] = widen(qh[i]);
  std::fill(w.acc.begin(), w.acc.begin() + width, 0.f);
  std::fill(w.m.begin(), w.m.begin() + heads * group, kNoScore);
  std::fill(w.l.begin(), w.l.begin() + heads * group, 0.f);
  for (int64_t start = first - first % block_size; start < context; start += block_size) {
    const int64_t count = std::min(block_size, context - start);
    const int64_t lo = std::max<int64_t>(first - start, 0);  // the window's edge, 1st block
    const T* block = cache + tables[seq * s.max_blocks + start / block_size] * s.block_stride +
                     s.layer_offset;
    // Blocks lie anywhere in the cache, so the hardware prefetcher loses the thread at every
    // block: a later one's keys and values are asked for in parts while this one is computed.
    const typename BlockStream<T>::Entry* ahead = stream.advance();
    const T* next = ahead ? ahead->block : nullptr;
    const int64_t next_h0 = ahead ? ahead->h0 : 0;
    // Three parts per tile: with two, an fp32 block's parts were 64 lines and lost a tenth.
    const int64_t parts = heads * ((count - lo + kTile - 1) / kTile) * 3;
    int64_t part = 0;
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t off = i * group;  // the first query head of KV head h0 + i, in the item
      for (int64_t j0 = lo; j0 < count; j0 += kTile) {
        const int64_t n = std::min(kTile, count - j0);
        const T* keys = block + j0 * s.token_stride + (h0 + i) * head_dim;
        float* acc = w.acc.data() + off * head_dim;
        if (next) prefetch_part(s, next, next_h0, heads, part++, parts);
        score_tile(s, w.qf.data() + off * head_dim, keys, n, scale, w.part.data(), w.probs.data());
        if (cap > 0.f) soft_cap_scores(s, w.probs.data(), n, cap);
        if (next) prefetch_part(s, next, next_h0, heads, part++, parts);
        softmax_update(s, w.probs.data(), n, w.m.data() + off, w.l.data() + off, acc);
        if (next) prefetch_part(s, next, next_h0, heads, part++, parts);
        accumulate_values(s, w.probs.data(), keys + s.kv_stride, n, acc);
      }
    }
  }
  T* oh = out + (seq * s.num_heads + h0 * group) * head_dim;
  for (int64_t g = 0; g < heads * group; ++g) {
    const float inv = w.l[g] > 0.f ? 1.f / w.l[g] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d)
      oh[g * head_dim + d] = static_cast<T>(w.acc[g * head_dim + d] * inv);
  }
}

template <typename T>
void run(const Shape& s, const torch::Tensor& q, const torch::Tensor& kv_cache,
         const torch::Tensor& tables, const torch::Tensor& lens, float scale, int64_t window,
         float cap, torch::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // A sequence's KV heads are read together (one pass over each block) unless there are too
  // few sequences to keep every thread busy; then each KV head is an item of its own.
  const int64_t heads = s.num_seqs >= at::get_num_threads() ? s.kv_heads : 1;
  const int64_t per_seq = s.kv_heads / heads;
  at::parallel_for(0, s.num_seqs * per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s);
    BlockStream<T> stream;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / per_seq, h0 = (item % per_seq) * heads;
      TORCH_CHECK(lp[seq] <= s.max_blocks * s.block_size, "seq_len beyond its block table");
      const int64_t first = first_key(lp[seq], window);
      for (int64_t start = first - first % s.block_size; start < lp[seq]; start += s.block_size)
        stream.order.push_back(
            {cache + tp[seq * s.max_blocks + start / s.block_size] * s.block_stride +
                 s.layer_offset,
             h0});
    }
    // The first blocks: nothing computes before them to hide their asking.
    for (int64_t i = 0; i < BlockStream<T>::kAhead && i < (int64_t)stream.order.size(); ++i)
      for (int64_t part = 0; part < 3; ++part)
        prefetch_part(s, stream.order[i].block, stream.order[i].h0, heads, part, 3);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / per_seq, h0 = (item % per_seq) * heads;
      attend(s, seq, h0, heads, qp, cache, tp, lp[seq], first_key(lp[seq], window), scale, cap,
             op, scratch, stream);
    }
  });
}

}  // namespace

// q: [S, Hq, D]; returns [S, Hq, D] in q's dtype. block_tables: [S, max_blocks] int64;
// seq_lens: [S] int64. sliding_window > 0: each decode sees its last sliding_window keys
// (0: all); soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) (0: no cap).
torch::Tensor paged_decode_attention_variant(const torch::Tensor& q,
                                             const torch::Tensor& kv_cache, int64_t layer,
                                             const torch::Tensor& block_tables,
                                             const torch::Tensor& seq_lens, double scale,
                                             int64_t sliding_window, double soft_cap) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  kv_cache.scalar_type() == dtype,
              "paged_decode_attention takes fp32 or bf16, the query's and the cache's alike");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && q.dim() == 3, "q [S, Hq, D], kv_cache 6-D block-major");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong,
              "block_tables and seq_lens must be int64");
  // Not std::isfinite: fast-math lets GCC fold it to true (Python checks the domain first).
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0.0 && soft_cap <= 3.0e38,
              "sliding_window (0: none) and soft_cap (0: none) must be >= 0");
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
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  if (dtype == torch::kFloat) {
    run<float>(s, q, kv_cache, tables, lens, fscale, sliding_window, cap, out);
  } else {
    run<c10::BFloat16>(s, q, kv_cache, tables, lens, fscale, sliding_window, cap, out);
  }
  return out;
}

// Full attention, no cap: the signature kernel_api.h's DecodeAttentionFn names (the decoder
// stack's layers have neither variant).
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     int64_t layer, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  return paged_decode_attention_variant(q, kv_cache, layer, block_tables, seq_lens, scale, 0, 0.0);
}

// key, value: [T, kv_heads, head_dim], each token's heads contiguous; slot_mapping: [T] int64,
// negative for a padding token that owns no slot. Writes token t's key and value into its
// slot of `layer` (one copy of kv_heads * head_dim elements each), in the cache's dtype.
// torch's indexed assignment does the same in about ten dispatched ops per layer.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
              int64_t layer, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache 6-D block-major");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: key, value and cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t tokens = key.size(0), block_size = kv_cache.size(3);
  const int64_t width = kv_cache.size(4) * kv_cache.size(5);  // kv_heads * head_dim
  TORCH_CHECK(key.numel() == tokens * width && value.numel() == tokens * width &&
                  slot_mapping.numel() == tokens,
              "write_kv: key/value [T, kv_heads, head_dim] and slot_mapping [T] disagree");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "write_kv: each token's heads must be contiguous");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  const int64_t slots = kv_cache.size(0) * block_size;
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] < slots, "write_kv: slot out of range");
  const int64_t elem = kv_cache.element_size();
  const int64_t kv_stride = block_size * width;  // K -> V of one layer
  const int64_t block_stride = kv_cache.size(1) * 2 * kv_stride;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_row = key.stride(0) * elem, v_row = value.stride(0) * elem;
  for (int64_t t = 0; t < tokens; ++t) {
    if (sp[t] < 0) continue;
    const int64_t block = sp[t] / block_size, offset = sp[t] % block_size;
    char* dst = cache + (block * block_stride + layer * 2 * kv_stride + offset * width) * elem;
    std::memcpy(dst, kp + t * k_row, width * elem);
    std::memcpy(dst + kv_stride * elem, vp + t * v_row, width * elem);
  }
}

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention_variant, ReleaseGil(),
        "decode attention over the block-major paged KV cache (CPU, fp32 or bf16)",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("layer"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("sliding_window") = 0, pybind11::arg("soft_cap") = 0.0);
  m.def("write_kv", &write_kv, ReleaseGil(),
        "new keys and values into their slots of one layer (CPU)");
  namespace api = kvrelay_api;
  pybind11::dict entries;
  entries[api::kDecodeAttention] =
      api::export_kernel<api::DecodeAttentionFn>(&paged_decode_attention, api::kDecodeAttention);
  entries[api::kWriteKv] = api::export_kernel<api::WriteKvFn>(&write_kv, api::kWriteKv);
  m.attr("entries") = entries;
}
