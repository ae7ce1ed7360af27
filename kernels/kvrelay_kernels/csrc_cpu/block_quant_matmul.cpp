// GGUF Q4_1 and Q8_0 weight blocks on the CPU: dequantized to a dense weight (for batches of
// many rows, which a dense matmul then takes), and Q8_0's matmul out = x @ W.T (+ bias) for
// batches of few rows.
//
// A block's 32 weights are turned into fp32 in registers: `d * q + m` (Q4_1) or `d * q`
// (Q8_0), exact in fp32 (an fp16 scale times a 4- or 8-bit code fits its mantissa), so the
// matmul differs from `x @ dequantize(W).T` in fp32 only by the order of the sums. There a
// block is used right after it is made and never stored, so a decode step reads 8.5 bits per
// weight instead of bf16's 16. Activations are read as fp32 (bf16 converts exactly); the bias
// is added to the fp32 sum and the output rounded once, to the input's dtype. One allocation
// per call (the output): a decode step makes a hundred of these calls.
//
// The loops are written with GCC vector types of the CPU's own width: 16 fp32 lanes (AVX-512),
// 8 (AVX2) or 4; -march=native picks. (A 16-lane type on an AVX2 CPU is lowered piecewise,
// every scalar splat through the stack: 0.5 G weights/s on a 2-core AVX2 EPYC.) Sums are kept
// in 16 logical lanes whatever the width, element e of a block in lane e % 16, and summed by
// one tree at the end, so every build gives the same bits. A tile of NT output rows x MT input
// rows keeps its sums in registers: each block's weights are dequantized once per tile and
// used MT times.
//
// Q4_1's loop runs where the activations are fp32: torch's int4 kernel is ~20x slower there
// than in bf16. In bf16 the layers keep torch's kernel for few rows (on a 2-core Xeon this
// loop ran Q4_1 at 14 G weights/s at one row against 22 for torch's).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include "kernel_api.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // weights per block in both formats
constexpr int64_t kQ41CodeBytes = 16;  // 32 4-bit codes: byte j holds element j (low), j + 16

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kSumLanes = 16;                   // logical lanes of every sum (see the top)
constexpr int kSumVecs = kSumLanes / kLanes;    // native vectors per sum
constexpr int kBlockVecs = kBlock / kLanes;     // native vectors per block
constexpr int kHalfVecs = kBlockVecs / 2;       // native vectors per 16 weights

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat load_floats(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// kLanes bytes widened to int32 lanes, zero- or sign-extended. GCC lowers
// __builtin_convertvector from bytes one lane at a time, so the widening is spelled out.
template <bool kSigned>
inline vint widen(const void* bytes) {
  vint out;
#if defined(__AVX512F__)
  const __m128i in = _mm_loadu_si128(static_cast<const __m128i*>(bytes));
  const __m512i wide = kSigned ? _mm512_cvtepi8_epi32(in) : _mm512_cvtepu8_epi32(in);
  std::memcpy(&out, &wide, sizeof out);
#elif defined(__AVX2__)
  const __m128i in = _mm_loadl_epi64(static_cast<const __m128i*>(bytes));
  const __m256i wide = kSigned ? _mm256_cvtepi8_epi32(in) : _mm256_cvtepu8_epi32(in);
  std::memcpy(&out, &wide, sizeof out);
#else
  const auto* p = static_cast<const uint8_t*>(bytes);
  for (int i = 0; i < kLanes; ++i) out[i] = kSigned ? static_cast<int8_t>(p[i]) : p[i];
#endif
  return out;
}

// The 16 logical lanes of a sum added as a tree (halves, then quarters, ...).
inline float lane_sum(const vfloat (&sum)[kSumVecs]) {
  float lanes[kSumLanes];
  std::memcpy(lanes, sum, sizeof lanes);
  for (int width = kSumLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// One output row's block `b` as kBlockVecs vectors, in element order.
struct Q41Rows {
  const uint8_t* codes;  // [N, K / 2]
  const float* d;        // [N, K / 32]
  const float* m;        // [N, K / 32]
  int64_t blocks;        // K / 32

  inline void block(int64_t row, int64_t b, vfloat (&w)[kBlockVecs]) const {
    const uint8_t* at = codes + (row * blocks + b) * kQ41CodeBytes;
    const float scale = d[row * blocks + b], offset = m[row * blocks + b];
    for (int v = 0; v < kHalfVecs; ++v) {
      const vint q = widen<false>(at + v * kLanes);
      w[v] = __builtin_convertvector(q & 15, vfloat) * scale + offset;
      w[v + kHalfVecs] = __builtin_convertvector(q >> 4, vfloat) * scale + offset;
    }
  }
};

struct Q80Rows {
  const int8_t* codes;  // [N, K]
  const float* d;       // [N, K / 32]
  int64_t blocks;

  inline void block(int64_t row, int64_t b, vfloat (&w)[kBlockVecs]) const {
    const int8_t* at = codes + (row * blocks + b) * kBlock;
    // Asked ahead: without it the Q4_1 loop of this kind waited on memory (half its speed).
    __builtin_prefetch(at + 1024);
    const float scale = d[row * blocks + b];
    for (int v = 0; v < kBlockVecs; ++v) {
      w[v] = __builtin_convertvector(widen<true>(at + v * kLanes), vfloat) * scale;
    }
  }
};

// Where sums go: out[row, col] = sum + bias[col], rounded once to the output's dtype.
struct Output {
  float* fp32;           // [M, N], or null
  c10::BFloat16* bf16;   // [M, N], or null
  const float* bias;     // [N], or null
  int64_t n;

  inline void store(int64_t row, int64_t col, float sum) const {
    const float value = bias != nullptr ? sum + bias[col] : sum;
    if (fp32 != nullptr) {
      fp32[row * n + col] = value;
    } else {
      bf16[row * n + col] = c10::BFloat16(value);
    }
  }
};

// out[m0 + t, n0 + r] for r < NT, t < MT. x: [M, K] fp32.
template <typename Rows, int NT, int MT>
inline void tile(const Rows& w, const float* x, int64_t k, int64_t n0, int64_t m0,
                 const Output& out) {
  vfloat acc[NT][MT][kSumVecs] = {};
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int r = 0; r < NT; ++r) {
      vfloat weights[kBlockVecs];
      w.block(n0 + r, b, weights);
      for (int t = 0; t < MT; ++t) {
        const float* xb = x + (m0 + t) * k + b * kBlock;
        for (int v = 0; v < kBlockVecs; ++v) {
          // Element e into logical lane e % 16; one fused multiply-add (-ffp-contract=fast).
          acc[r][t][v % kSumVecs] += weights[v] * load_floats(xb + v * kLanes);
        }
      }
    }
  }
  for (int r = 0; r < NT; ++r) {
    for (int t = 0; t < MT; ++t) out.store(m0 + t, n0 + r, lane_sum(acc[r][t]));
  }
}

// Output rows [n0, n1) for every input row: the weights of a tile stay in cache while the
// input rows go by. NT x MT sums of kSumVecs registers each must fit the register file: with
// AVX-512's 32 registers tiles of 4 x 4 (or 1 x 8); with AVX2's 16, 4 x 1 for one input row
// and 1 x 4 for more (1 x 4 dequantizes a block once per four rows, 4 x 1 once per row).
template <typename Rows, int NT>
void output_rows(const Rows& w, const float* x, int64_t rows, int64_t k, int64_t n0, int64_t n1,
                 const Output& out) {
  constexpr bool kWide = kLanes == 16;
  if (!kWide && NT > 1 && rows > 1) {
    output_rows<Rows, 1>(w, x, rows, k, n0, n1, out);
    return;
  }
  constexpr int kInputTile = kWide ? (NT >= 4 ? 4 : 8) : (NT >= 4 ? 1 : 4);
  for (int64_t r = n0; r < n1; r += NT) {
    int64_t m0 = 0;
    for (; m0 + kInputTile <= rows; m0 += kInputTile) {
      tile<Rows, NT, kInputTile>(w, x, k, r, m0, out);
    }
    for (; m0 + 2 <= rows; m0 += 2) tile<Rows, NT, 2>(w, x, k, r, m0, out);
    for (; m0 < rows; ++m0) tile<Rows, NT, 1>(w, x, k, r, m0, out);
  }
}

template <typename Rows>
void matmul(const Rows& w, const float* x, int64_t rows, int64_t k, const Output& out) {
  constexpr int kOutputTile = 4;
  const int64_t tiles = out.n / kOutputTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    output_rows<Rows, kOutputTile>(w, x, rows, k, begin * kOutputTile, end * kOutputTile, out);
  });
  output_rows<Rows, 1>(w, x, rows, k, tiles * kOutputTile, out.n, out);  // the last few rows
}

void check_input(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k,
              "x must be a [rows, in_features] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(k % kBlock == 0, "in_features must be a multiple of 32");
}

void check_scales(const torch::Tensor& scales, int64_t n, int64_t k) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / kBlock,
              "scales must be contiguous float32 [out_features, in_features / 32]");
}

// `t` (fp32 or bf16, contiguous) as fp32: its own data, or a copy in `buffer`. A plain copy,
// not a torch op: a decode step calls this a hundred times with a few hundred values each.
const float* as_floats(const torch::Tensor& t, std::vector<float>& buffer) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  const c10::BFloat16* in = t.data_ptr<c10::BFloat16>();
  buffer.resize(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) buffer[i] = static_cast<float>(in[i]);
  return buffer.data();
}

// Every weight of `w` in `dtype` (fp32 or bf16), [N, K]: for batches with many rows, where a
// dense matmul (oneDNN, AMX on CPUs that have it) of the dequantized weight beats the loop
// above, which is bound by its multiply-adds there.
template <typename Rows>
torch::Tensor dequantize(const Rows& w, int64_t n, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  torch::Tensor out = torch::empty({n, k}, torch::dtype(dtype));
  float* fp32 = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* bf16 = dtype == at::kBFloat16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < w.blocks; ++b) {
        vfloat weights[kBlockVecs];
        w.block(row, b, weights);
        float values[kBlock];
        std::memcpy(values, weights, sizeof values);
        const int64_t at = row * k + b * kBlock;
        if (fp32 != nullptr) {
          std::memcpy(fp32 + at, values, sizeof values);
        } else {
          for (int64_t i = 0; i < kBlock; ++i) bf16[at + i] = c10::BFloat16(values[i]);
        }
      }
    }
  });
  return out;
}

Q41Rows q4_1_rows(const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor& m) {
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "codes must be contiguous uint8 [out_features, in_features / 2]");
  check_scales(d, n, k);
  check_scales(m, n, k);
  return Q41Rows{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(),
                 k / kBlock};
}

Q80Rows q8_0_rows(const torch::Tensor& codes, const torch::Tensor& d) {
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 2,
              "codes must be contiguous int8 [out_features, in_features]");
  check_scales(d, n, k);
  return Q80Rows{codes.data_ptr<int8_t>(), d.data_ptr<float>(), k / kBlock};
}

template <typename Rows>
torch::Tensor block_matmul(const Rows& w, const torch::Tensor& x, int64_t n,
                           const c10::optional<torch::Tensor>& bias) {
  const int64_t k = w.blocks * kBlock;
  check_input(x, k);
  const torch::Tensor input = x.contiguous();
  std::vector<float> x_buffer, bias_buffer;
  const float* bias_values = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16),
                "bias must be contiguous float32 or bfloat16 [out_features]");
    bias_values = as_floats(*bias, bias_buffer);
  }
  torch::Tensor out = torch::empty({x.size(0), n}, x.options());
  const bool fp32 = x.scalar_type() == at::kFloat;
  const Output sink{fp32 ? out.data_ptr<float>() : nullptr,
                    fp32 ? nullptr : out.data_ptr<c10::BFloat16>(), bias_values, n};
  matmul(w, as_floats(input, x_buffer), x.size(0), k, sink);
  return out;
}

}  // namespace

torch::Tensor q8_0_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& d, const c10::optional<torch::Tensor>& bias) {
  return block_matmul(q8_0_rows(codes, d), x, codes.size(0), bias);
}

torch::Tensor q4_1_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                          const torch::Tensor& d, const torch::Tensor& m,
                          const c10::optional<torch::Tensor>& bias) {
  return block_matmul(q4_1_rows(codes, d, m), x, codes.size(0), bias);
}

torch::Tensor q4_1_dequantize(const torch::Tensor& codes, const torch::Tensor& d,
                              const torch::Tensor& m, at::ScalarType dtype) {
  return dequantize(q4_1_rows(codes, d, m), codes.size(0), codes.size(1) * 2, dtype);
}

torch::Tensor q8_0_dequantize(const torch::Tensor& codes, const torch::Tensor& d,
                              at::ScalarType dtype) {
  return dequantize(q8_0_rows(codes, d), codes.size(0), codes.size(1), dtype);
}

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q8_0_matmul", &q8_0_matmul, ReleaseGil(), "x @ W.T over GGUF Q8_0 blocks (+ bias)");
  module.def("q4_1_matmul", &q4_1_matmul, ReleaseGil(), "x @ W.T over GGUF Q4_1 blocks (+ bias)");
  module.def("q4_1_dequantize", &q4_1_dequantize, ReleaseGil(),
        "GGUF Q4_1 blocks as a dense [out, in] weight");
  module.def("q8_0_dequantize", &q8_0_dequantize, ReleaseGil(),
        "GGUF Q8_0 blocks as a dense [out, in] weight");
  namespace api = kvrelay_api;
  pybind11::dict entries;
  entries[api::kQ4_1Matmul] = api::export_kernel<api::Q4_1MatmulFn>(&q4_1_matmul, api::kQ4_1Matmul);
  entries[api::kQ8_0Matmul] = api::export_kernel<api::Q8_0MatmulFn>(&q8_0_matmul, api::kQ8_0Matmul);
  module.attr("entries") = entries;
}
