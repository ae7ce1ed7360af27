// Few-row dense matmuls (a decode step's handful of rows) that stream a row-major `[out, in]`
// weight once, at memory speed: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 sums,
// each output rounded once to x's dtype.
//
// Why: at one row a decode step is a read of every weight, and oneDNN's packed kernels read
// them slowly there: on a 2-core Zen 4 EPYC the default model's 120 bf16 matmuls of one row
// ran at 12 GB/s packed (6-7 GB/s through `linear`), where a plain read of memory runs at
// 29 GB/s. Here four weight rows are read side by side, 64 bytes of each at a time, and each
// chunk meets every input row while it is in registers: bf16 through AVX512-BF16's
// `vdpbf16ps` (two products per fp32 lane), fp32 through AVX-512 FMAs. Four input rows at a
// time; more rows go round again over the same four weight rows, then in L1.
//
// Sums are per 16-lane accumulator, added across lanes at the end: a different order from
// oneDNN's, so results agree to the output dtype's rounding, not bit for bit.
// Builds without AVX512-BF16 (bf16) or AVX-512 (fp32) say so through `supports`, and the
// models keep oneDNN there.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVRELAY_BF16_512 1
#endif
#if defined(__AVX512F__)
#define KVRELAY_FP32_512 1
#endif

namespace {

constexpr int64_t kWeightRows = 4;  // weight rows read side by side
constexpr int64_t kInputRows = 4;   // input rows per pass over them
// Weight rows per task: a few hundred KB per thread, read front to back.
constexpr int64_t kRowsPerTask = 64;

struct Problem {
  int64_t rows, n, k;  // x [rows, k], w [n, k]
  const float* bias;   // fp32 [n] or null
};

template <typename T>
void store_row(T* out, float value) {
  *out = static_cast<T>(value);  // bf16: round to nearest even, as c10 converts
}

#if defined(KVRELAY_BF16_512)
// Input rows [m0, m0 + M) times weight rows [n0, n0 + R), one weight row after the other
// (memory in address order: one stream that the prefetchers follow), 32 values per step, two
// sums per pair (even and odd steps) so that consecutive dot products do not wait on each
// other.
template <int M, int R>
void tile_bf16(const Problem& p, const c10::BFloat16* x, const c10::BFloat16* w, int64_t m0,
               int64_t n0, c10::BFloat16* out) {
  const c10::BFloat16* xr = x + m0 * p.k;
  for (int r = 0; r < R; ++r) {
    const c10::BFloat16* wr = w + (n0 + r) * p.k;
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= p.k; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512(xr + m * p.k + k), w0);
        odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)_mm512_loadu_si512(xr + m * p.k + k + 32), w1);
      }
    }
    if (k < p.k) {  // k is a multiple of 32: one step left
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int m = 0; m < M; ++m)
        even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512(xr + m * p.k + k), w0);
    }
    const float bias = p.bias ? p.bias[n0 + r] : 0.f;
    for (int m = 0; m < M; ++m)
      store_row(out + (m0 + m) * p.n + n0 + r,
                _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + bias);
  }
}
#endif

#if defined(KVRELAY_FP32_512)
template <int M, int R>
void tile_fp32(const Problem& p, const float* x, const float* w, int64_t m0, int64_t n0,
               float* out) {
  const float* xr = x + m0 * p.k;
  for (int r = 0; r < R; ++r) {
    const float* wr = w + (n0 + r) * p.k;
    __m512 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= p.k; k += 32) {
      const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + m * p.k + k), w0, even[m]);
        odd[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + m * p.k + k + 16), w1, odd[m]);
      }
    }
    if (k < p.k) {
      const __m512 w0 = _mm512_loadu_ps(wr + k);
      for (int m = 0; m < M; ++m)
        even[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + m * p.k + k), w0, even[m]);
    }
    const float bias = p.bias ? p.bias[n0 + r] : 0.f;
    for (int m = 0; m < M; ++m)
      out[(m0 + m) * p.n + n0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + bias;
  }
}
#endif

// One tile's shape picked at run time from the compile-time ones.
template <typename T, int R>
void tile(const Problem& p, const T* x, const T* w, int64_t m0, int64_t n0, T* out) {
  const int64_t m = std::min(kInputRows, p.rows - m0);
#if defined(KVRELAY_BF16_512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (m) {
      case 1: return tile_bf16<1, R>(p, x, w, m0, n0, out);
      case 2: return tile_bf16<2, R>(p, x, w, m0, n0, out);
      case 3: return tile_bf16<3, R>(p, x, w, m0, n0, out);
      default: return tile_bf16<4, R>(p, x, w, m0, n0, out);
    }
  }
#endif
#if defined(KVRELAY_FP32_512)
  if constexpr (std::is_same_v<T, float>) {
    switch (m) {
      case 1: return tile_fp32<1, R>(p, x, w, m0, n0, out);
      case 2: return tile_fp32<2, R>(p, x, w, m0, n0, out);
      case 3: return tile_fp32<3, R>(p, x, w, m0, n0, out);
      default: return tile_fp32<4, R>(p, x, w, m0, n0, out);
    }
  }
#endif
  TORCH_CHECK(false, "dense_gemv: this build has no kernel for this dtype (see supports)");
}

template <typename T>
void run(const Problem& p, const T* x, const T* w, T* out) {
  const int64_t groups = (p.n + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, groups, kRowsPerTask / kWeightRows, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kWeightRows;
      for (int64_t m0 = 0; m0 < p.rows; m0 += kInputRows) {
        if (n0 + kWeightRows <= p.n) {
          tile<T, kWeightRows>(p, x, w, m0, n0, out);
        } else {
          for (int64_t n = n0; n < p.n; ++n) tile<T, 1>(p, x, w, m0, n, out);
        }
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

// Whether this build has the kernel for `dtype` ("float32" or "bfloat16"); the in-features
// must then be a multiple of `k_multiple(dtype)`.
bool supports(const std::string& dtype) {
  if (dtype == "bfloat16") return builds_for(at::kBFloat16);
  if (dtype == "float32") return builds_for(at::kFloat);
  return false;
}

int64_t k_multiple(const std::string& dtype) { return dtype == "bfloat16" ? 32 : 16; }

// x: [rows, k]; w: [n, k] contiguous, x's dtype; bias: [n] or none. Returns [rows, n].
torch::Tensor dense_gemv(const torch::Tensor& x, const torch::Tensor& w,
                         const c10::optional<torch::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(builds_for(dtype), "dense_gemv: no kernel for ", dtype, " in this build");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.dim() == 2 && w.dim() == 2 &&
                  w.scalar_type() == dtype && w.is_contiguous() && x.size(1) == w.size(1),
              "dense_gemv: x [rows, k] and a contiguous w [n, k] on the CPU, one dtype");
  const int64_t multiple = dtype == at::kBFloat16 ? 32 : 16;
  TORCH_CHECK(x.size(1) % multiple == 0, "dense_gemv: in-features must be a multiple of ",
              multiple);
  const torch::Tensor input = x.contiguous();
  torch::Tensor bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == w.size(0), "dense_gemv: bias must be [out_features]");
    bias_values = bias->to(at::kFloat).contiguous();
  }
  const Problem p{x.size(0), w.size(0), x.size(1),
                  bias.has_value() ? bias_values.data_ptr<float>() : nullptr};
  torch::Tensor out = torch::empty({p.rows, p.n}, x.options());
  if (dtype == at::kBFloat16) {
    run(p, input.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
        out.data_ptr<c10::BFloat16>());
  } else {
    run(p, input.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_gemv", &dense_gemv, ReleaseGil(),
        "few-row dense matmul streaming a row-major weight (CPU, fp32 or bf16)");
  m.def("supports", &supports, "whether this build has the kernel for a dtype name");
  m.def("k_multiple", &k_multiple, "the in-features multiple the kernel needs for a dtype");
}
