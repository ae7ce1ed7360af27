// Dense matmuls on a weight packed in blocks of 32 outputs: out[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]), fp32 sums, each output rounded once to x's dtype. One kernel for every row
// count, from a decode step's one row to a prefill chunk's hundreds.
//
// Why: a decode step of a few rows is a read of every weight, of 8-32 rows already a matmul
// that the multiply-adds bound. oneDNN's packed kernels read one row's weights at 12-16 GB/s
// on a 2-core Zen 4 EPYC (memory gives ~29) and reach about a third of the core's bf16 peak at
// 16 rows. Here each block is 32 outputs' weights, interleaved so that one 64-byte load holds
// 16 outputs' next weights (bf16: the next two k of 16 outputs, as `vdpbf16ps` pairs them;
// fp32: the next k of 16 outputs). A step over k loads two of them, broadcasts each input
// row's value(s) and multiply-adds into that row's two 16-lane sums: no sums across lanes, no
// input row read twice per block, and the block's bytes in address order (one stream the
// prefetchers follow). Up to 12 input rows share a pass over a block (24 sums, 2 weight
// registers, 1 broadcast of AVX-512's 32); more rows make more passes over the same block,
// then in L1/L2.
//
// Sums run in k order per output, so results agree with oneDNN's to the output dtype's
// rounding, not bit for bit. Builds without AVX512-BF16 (bf16) or AVX-512 (fp32) say so
// through `supports`, and the models keep oneDNN there.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include "kernel_api.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVRELAY_BF16_512 1
#endif
#if defined(__AVX512F__)
#define KVRELAY_FP32_512 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // outputs per block: two 16-lane sums per input row
constexpr int kMaxRows = 12;    // input rows per pass over a block

struct Problem {
  int64_t rows, n, k;  // x [rows, k], w [n, k] packed in blocks
  const float* bias;   // fp32 [n] or null
};

#if defined(KVRELAY_BF16_512)
// bf16 blocks: [blocks][k / 2][32 outputs][2 k]; one step is two k.
struct Bf16 {
  using T = c10::BFloat16;
  static constexpr int64_t kPerStep = 2;
  static __m512 load(const T* w) { return (__m512)_mm512_loadu_si512(w); }
  static __m512 broadcast(const T* x) {  // x[k], x[k + 1] into every 32-bit lane
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512)_mm512_set1_epi32(pair);
  }
  static __m512 multiply_add(__m512 sum, __m512 x, __m512 w) {
    return _mm512_dpbf16_ps(sum, (__m512bh)x, (__m512bh)w);
  }
  static void store(T* out, __m512 sum, int64_t count) {  // round to nearest even
    const __m256i values = (__m256i)_mm512_cvtneps_pbh(sum);
    _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << count) - 1), values);
  }
};
#endif

#if defined(KVRELAY_FP32_512)
// fp32 blocks: [blocks][k][32 outputs]; one step is one k.
struct Fp32 {
  using T = float;
  static constexpr int64_t kPerStep = 1;
  static __m512 load(const T* w) { return _mm512_loadu_ps(w); }
  static __m512 broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static __m512 multiply_add(__m512 sum, __m512 x, __m512 w) {
    return _mm512_fmadd_ps(x, w, sum);
  }
  static void store(T* out, __m512 sum, int64_t count) {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1), sum);
  }
};
#endif

// Input rows [m0, m0 + M) times one block of outputs [n0, n0 + 32). Few rows alternate two
// sets of sums between steps, so that a sum's next multiply-add does not wait on its last
// (`vdpbf16ps` takes ~6 cycles; two sums per row would leave the core waiting at one row).
template <typename K, int M>
void block_pass(const Problem& p, const typename K::T* x, const typename K::T* block, int64_t m0,
                int64_t n0, typename K::T* out) {
  constexpr int kSets = M <= 4 ? 2 : 1;
  constexpr int64_t kStep = K::kPerStep, kStride = kBlock * K::kPerStep;
  __m512 low[kSets][M], high[kSets][M];  // outputs n0..n0+15 and n0+16..n0+31 of each row
  for (int s = 0; s < kSets; ++s)
    for (int m = 0; m < M; ++m) low[s][m] = high[s][m] = _mm512_setzero_ps();
  const typename K::T* row = x + m0 * p.k;
  int64_t k = 0;
  for (; k + kSets * kStep <= p.k; k += kSets * kStep, block += kSets * kStride) {
    for (int s = 0; s < kSets; ++s) {
      const __m512 w_low = K::load(block + s * kStride);
      const __m512 w_high = K::load(block + s * kStride + 16 * kStep);
      for (int m = 0; m < M; ++m) {
        const __m512 xm = K::broadcast(row + m * p.k + k + s * kStep);
        low[s][m] = K::multiply_add(low[s][m], xm, w_low);
        high[s][m] = K::multiply_add(high[s][m], xm, w_high);
      }
    }
  }
  if (k < p.k) {  // an odd step count with two sets: one step left
    const __m512 w_low = K::load(block), w_high = K::load(block + 16 * kStep);
    for (int m = 0; m < M; ++m) {
      const __m512 xm = K::broadcast(row + m * p.k + k);
      low[0][m] = K::multiply_add(low[0][m], xm, w_low);
      high[0][m] = K::multiply_add(high[0][m], xm, w_high);
    }
  }
  if constexpr (kSets == 2) {
    for (int m = 0; m < M; ++m) {
      low[0][m] = _mm512_add_ps(low[0][m], low[1][m]);
      high[0][m] = _mm512_add_ps(high[0][m], high[1][m]);
    }
  }
  const int64_t count = std::min(kBlock, p.n - n0);
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (p.bias) {
    bias_low = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::min<int64_t>(count, 16)) - 1),
                                     p.bias + n0);
    if (count > 16)
      bias_high = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (count - 16)) - 1),
                                        p.bias + n0 + 16);
  }
  for (int m = 0; m < M; ++m) {
    typename K::T* o = out + (m0 + m) * p.n + n0;
    K::store(o, _mm512_add_ps(low[0][m], bias_low), std::min<int64_t>(count, 16));
    if (count > 16) K::store(o + 16, _mm512_add_ps(high[0][m], bias_high), count - 16);
  }
}

// `block_pass` for a row count known at run time (1..kMaxRows).
template <typename K, int M = kMaxRows>
void block_pass_of(int rows, const Problem& p, const typename K::T* x, const typename K::T* block,
                   int64_t m0, int64_t n0, typename K::T* out) {
  if constexpr (M > 0) {
    if (rows == M) return block_pass<K, M>(p, x, block, m0, n0, out);
    return block_pass_of<K, M - 1>(rows, p, x, block, m0, n0, out);
  }
}

template <typename K>
void run(const Problem& p, const typename K::T* x, const typename K::T* w, typename K::T* out) {
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  // Equal passes: 16 rows are two passes of 8, not 12 and 4.
  const int64_t passes = (p.rows + kMaxRows - 1) / kMaxRows;
  const int64_t per_pass = (p.rows + passes - 1) / passes;
  const int64_t block_size = kBlock * p.k;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < p.rows; m0 += per_pass) {
        const int rows = static_cast<int>(std::min(per_pass, p.rows - m0));
        block_pass_of<K>(rows, p, x, w + b * block_size, m0, b * kBlock, out);
      }
    }
  });
}

bool builds_for(at::ScalarType dtype) {
#if defined(KVRELAY_BF16_512)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(KVRELAY_FP32_512)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

}  // namespace

// Whether this build has the kernel for `dtype` ("float32" or "bfloat16").
bool supports(const std::string& dtype) {
  if (dtype == "bfloat16") return builds_for(at::kBFloat16);
  if (dtype == "float32") return builds_for(at::kFloat);
  return false;
}

// x: [rows, k]; blocks: the weight as `kvrelay_kernels.cpu_blocked.pack_blocks` lays it out
// (x's dtype, k values per output, `n` outputs padded to blocks of 32); bias: fp32 [n] or
// none. Returns [rows, n] in x's dtype.
torch::Tensor blocked_matmul(const torch::Tensor& x, const torch::Tensor& blocks, int64_t n,
                             const c10::optional<torch::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(builds_for(dtype), "blocked_matmul: no kernel for ", dtype, " in this build");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu() && x.dim() == 2 &&
                  blocks.scalar_type() == dtype && blocks.is_contiguous(),
              "blocked_matmul: x [rows, k] and contiguous blocks on the CPU, one dtype");
  const int64_t k = x.size(1), padded = (n + kBlock - 1) / kBlock * kBlock;
  TORCH_CHECK(n > 0 && blocks.numel() == padded * k, "blocked_matmul: blocks of ", n,
              " outputs of ", k, " values expected");
  TORCH_CHECK(dtype != at::kBFloat16 || k % 2 == 0, "blocked_matmul: bf16 needs an even k");
  const float* bias_values = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "blocked_matmul: bias must be a contiguous fp32 [n]");
    bias_values = bias->data_ptr<float>();
  }
  const torch::Tensor input = x.contiguous();
  const Problem p{x.size(0), n, k, bias_values};
  torch::Tensor out = torch::empty({p.rows, n}, x.options());
  if (p.rows == 0) return out;
#if defined(KVRELAY_BF16_512)
  if (dtype == at::kBFloat16) {
    run<Bf16>(p, input.data_ptr<c10::BFloat16>(), blocks.data_ptr<c10::BFloat16>(),
              out.data_ptr<c10::BFloat16>());
  }
#endif
#if defined(KVRELAY_FP32_512)
  if (dtype == at::kFloat) {
    run<Fp32>(p, input.data_ptr<float>(), blocks.data_ptr<float>(), out.data_ptr<float>());
  }
#endif
  return out;
}

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocked_matmul", &blocked_matmul, ReleaseGil(),
        "dense matmul on a weight packed in blocks of 32 outputs (CPU, fp32 or bf16)");
  m.def("supports", &supports, "whether this build has the kernel for a dtype name");
  namespace api = kvrelay_api;
  pybind11::dict entries;
  entries[api::kBlockedMatmul] =
      api::export_kernel<api::BlockedMatmulFn>(&blocked_matmul, api::kBlockedMatmul);
  m.attr("entries") = entries;
}
