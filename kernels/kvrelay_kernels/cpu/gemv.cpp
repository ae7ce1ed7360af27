// Single-row fp32 matrix-vector product for decode steps on AVX2 CPUs: y = x @ W^T (+ b).
//
// One decode token multiplies a [1, K] activation by every weight matrix of the model, so a
// step is bound by how fast the weights stream from memory. Generic BLAS GEMV reached about
// 20 GB/s on the project's 2-core machine and degraded badly when the cores were shared; this
// kernel reads eight weight rows per pass with independent FMA chains and splits the rows
// over torch's own thread pool (at::parallel_for), so it never fights a second OpenMP runtime.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// y[r] = dot(x, w[r]) for R consecutive rows of w (row stride K).
template <int R>
inline void dot_rows(const float* x, const float* w, int64_t K, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), xv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = horizontal_sum(acc[r]);
    for (int64_t tail = k; tail < K; ++tail) sum += x[tail] * w[r * K + tail];
    y[r] = sum;
  }
}

constexpr int kRowsPerPass = 8;
constexpr int64_t kRowsPerTask = 256;  // enough work per thread to amortize the hand-off

}  // namespace

// x: [1, K] fp32 contiguous; weight: [N, K] fp32 contiguous; bias: [N] or undefined.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight,
                   const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "gemv expects x of shape [1, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "gemv is fp32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "gemv needs contiguous inputs");
  const int64_t K = x.size(1);
  const int64_t N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "gemv: weight is [", N, ", ", weight.size(1), "], x has K=", K);
  auto y = torch::empty({1, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + kRowsPerPass <= end; n += kRowsPerPass) {
      dot_rows<kRowsPerPass>(xp, wp + n * K, K, yp + n);
    }
    for (; n < end; ++n) dot_rows<1>(xp, wp + n * K, K, yp + n);
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ weight.T (+ bias) for one fp32 row (AVX2)");
}
