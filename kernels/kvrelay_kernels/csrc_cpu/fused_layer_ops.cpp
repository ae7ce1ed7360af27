// The element-wise steps of a decoder layer on the CPU, each in one call: RMSNorm, the
// residual add fused with the norm after it, RoPE, and the MLP's SiLU-and-multiply. A decode
// step of the default model runs 61 norms and 30 RoPEs of a few thousand numbers each; in torch
// each is four to eight dispatched ops, and the dispatching cost more than the arithmetic.
//
// Every result is rounded where torch's own ops round (bf16 rounds after each op, as HF's
// modules do in bf16), and this file is built without fast-math and without FMA contraction,
// so fp32 RoPE and SiLU-and-multiply are bit-for-bit torch's; norms differ from torch only by
// the order of the sum of squares.

// SiLU's exp must be the one torch's own kernel uses for this CPU (SLEEF's, through ATen's
// Vectorized): name the instruction set torch dispatches to before ATen's vector headers load.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>
#include "kernel_api.h"

#include <cmath>
#include <cstdint>

namespace {

// Round a float to the storage type T (identity for float).
template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

template <typename T>
inline float wide(T x) {
  return static_cast<float>(x);
}

constexpr int64_t kRowsPerTask = 16;  // a decode step's few rows stay on one thread
// SiLU-and-multiply's rows are 6-8x a norm's work (an exp per element over the intermediate
// width): from 8 rows on (16 rows: 12 us in fp32, 23 in bf16 on one thread) both threads.
constexpr int64_t kSiluRowsPerTask = 4;

// 1 / sqrt(mean(x^2) + eps) of one row, in fp32 (four partial sums: any order is as exact).
template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int64_t k = 0; k < 4; ++k) s[k] += wide(x[i + k]) * wide(x[i + k]);
  }
  for (; i < n; ++i) s[0] += wide(x[i]) * wide(x[i]);
  const float mean = ((s[0] + s[1]) + (s[2] + s[3])) / static_cast<float>(n);
  return 1.f / std::sqrt(mean + eps);
}

// One normed row. fp32: x * inv * w (F.rms_norm's order). bf16: HF's LlamaRMSNorm, the
// normalized value rounded to bf16 before the weight multiplies it.
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = wide(round_to<T>(wide(x[i]) * inv));
    out[i] = round_to<T>(wide(w[i]) * normed);
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "fp32 or bf16 only");
}

template <typename T>
void norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out,
               float eps) {
  const int64_t n = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * stride, wp, op + t * n, n, eps);
  });
}

template <typename T>
void add_norm_rows(torch::Tensor& residual, const torch::Tensor& delta,
                   const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t n = residual.size(1), rs = residual.stride(0), ds = delta.stride(0);
  T* hp = residual.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, residual.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* h = hp + t * rs;
      const T* d = dp + t * ds;
      for (int64_t i = 0; i < n; ++i) h[i] = round_to<T>(wide(h[i]) + wide(d[i]));
      norm_row(h, wp, op + t * n, n, eps);
    }
  });
}

using at::vec::Vectorized;

// 16 values of T as fp32 lanes: loaded, rounded to T (and widened back) as a separate torch op
// rounds its result, stored.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using V = Vectorized<float>;
  static V load(const float* p) { return V::loadu(p); }
  static V round(const V& x) { return x; }
  static void store(float* p, const V& x) { x.store(p); }
};

template <>
struct Lanes<c10::BFloat16> {
  using V = Vectorized<float>;
  using B = Vectorized<c10::BFloat16>;
  static V load(const c10::BFloat16* p) {
    return std::get<0>(at::vec::convert_to_float<c10::BFloat16>(B::loadu(p, V::size())));
  }
  static V round(const V& x) {
    return std::get<0>(
        at::vec::convert_to_float<c10::BFloat16>(at::vec::convert_from_float<c10::BFloat16>(x, x)));
  }
  static void store(c10::BFloat16* p, const V& x) {
    at::vec::convert_from_float<c10::BFloat16>(x, x).store(p, V::size());
  }
};

// One head's rotation: o1 = x1 c - x2 s, o2 = x2 c + x1 s, each product and sum rounded as
// torch's separate ops round it; 16 lanes at a time, the rest one by one.
template <typename T>
void rope_head(const T* x1, const T* x2, const T* c, const T* s, T* o1, T* o2, int64_t half) {
  using L = Lanes<T>;
  int64_t i = 0;
  for (; i + L::V::size() <= half; i += L::V::size()) {
    const auto a = L::load(x1 + i), b = L::load(x2 + i);
    const auto cv = L::load(c + i), sv = L::load(s + i);
    L::store(o1 + i, L::round(a * cv) - L::round(b * sv));
    L::store(o2 + i, L::round(b * cv) + L::round(a * sv));
  }
  for (; i < half; ++i) {
    const float a = wide(round_to<T>(wide(x1[i]) * wide(c[i])));
    const float b = wide(round_to<T>(wide(x2[i]) * wide(s[i])));
    const float p = wide(round_to<T>(wide(x2[i]) * wide(c[i])));
    const float q = wide(round_to<T>(wide(x1[i]) * wide(s[i])));
    o1[i] = round_to<T>(a - b);
    o2[i] = round_to<T>(p + q);
  }
}

// HF's rotate-half RoPE of every head of every token.
template <typename T>
void rope_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
               torch::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = xp + t * ts + h * hs;
        T* o1 = op + (t * heads + h) * 2 * half;
        rope_head(x1, x1 + half, cp + t * half, sp + t * half, o1, o1 + half, half);
      }
    }
  });
}

// out = silu(gate) * up for one row, as `h = F.silu(gate); h.mul_(up)` computes it: x / (1 +
// exp(-x)) in fp32, then (bf16) rounded, widened and multiplied. torch's element-wise loops take
// two vectors at a time with its vectorized exp and leave the rest of a row to a scalar loop
// with std::exp; the same split here keeps every value bit for bit torch's.
inline Vectorized<float> silu(const Vectorized<float>& x) {
  return x / (Vectorized<float>(1.f) + x.neg().exp());
}

inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  using V = Vectorized<float>;
  int64_t i = 0;
  for (; i + 2 * V::size() <= n; i += 2 * V::size()) {
    for (int64_t k = i; k < i + 2 * V::size(); k += V::size()) {
      (silu(V::loadu(gate + k)) * V::loadu(up + k)).store(out + k);
    }
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

inline void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                         int64_t n) {
  using V = Vectorized<c10::BFloat16>;
  using at::vec::convert_from_float;
  using at::vec::convert_to_float;
  int64_t i = 0;
  for (; i + 2 * V::size() <= n; i += 2 * V::size()) {
    for (int64_t k = i; k < i + 2 * V::size(); k += V::size()) {
      auto [x0, x1] = convert_to_float<c10::BFloat16>(V::loadu(gate + k));
      const V rounded = convert_from_float<c10::BFloat16>(silu(x0), silu(x1));
      auto [s0, s1] = convert_to_float<c10::BFloat16>(rounded);
      auto [u0, u1] = convert_to_float<c10::BFloat16>(V::loadu(up + k));
      convert_from_float<c10::BFloat16>(s0 * u0, s1 * u1).store(out + k);
    }
  }
  for (; i < n; ++i) {
    const float x = wide(gate[i]);
    const float rounded = wide(round_to<c10::BFloat16>(x / (1.f + std::exp(-x))));
    out[i] = round_to<c10::BFloat16>(rounded * wide(up[i]));
  }
}

template <typename T>
void silu_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t n = out.size(1), stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, out.size(0), kSiluRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * stride, gp + t * stride + n,
                                                       op + t * n, n);
  });
}

}  // namespace

// x: [rows, hidden] (rows may be strided); returns a new contiguous tensor.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    norm_rows<float>(x, weight, out, static_cast<float>(eps));
  } else {
    norm_rows<c10::BFloat16>(x, weight, out, static_cast<float>(eps));
  }
  return out;
}

// residual += delta (in place, rounded to its dtype), then returns rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta,
                           const torch::Tensor& weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.stride(1) == 1 &&
                  delta.scalar_type() == residual.scalar_type(),
              "delta must be shaped and typed like the residual");
  auto out = torch::empty({residual.size(0), residual.size(1)}, residual.options());
  if (residual.scalar_type() == torch::kFloat) {
    add_norm_rows<float>(residual, delta, weight, out, static_cast<float>(eps));
  } else {
    add_norm_rows<c10::BFloat16>(residual, delta, weight, out, static_cast<float>(eps));
  }
  return out;
}

// x: [T, heads, head_dim] (head_dim contiguous); cos, sin: [T, 1, head_dim / 2] contiguous.
// Returns a new contiguous [T, heads, head_dim].
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be [T, heads, head_dim] with head_dim contiguous and even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() &&
                  cos.numel() == x.size(0) * x.size(2) / 2,
              "cos and sin must be contiguous [T, 1, head_dim / 2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos, sin and x must share a dtype");
  auto out = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    rope_rows<float>(x, cos, sin, out);
  } else if (x.scalar_type() == torch::kBFloat16) {
    rope_rows<c10::BFloat16>(x, cos, sin, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
  return out;
}

// gate_up: [rows, 2 * n], each row the gate's n values then the up projection's (rows may be
// strided). Returns a new contiguous [rows, n]: silu(gate) * up.
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * n] with rows contiguous");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat) {
    silu_mul_rows<float>(gate_up, out);
  } else if (gate_up.scalar_type() == torch::kBFloat16) {
    silu_mul_rows<c10::BFloat16>(gate_up, out);
  } else {
    TORCH_CHECK(false, "fp32 or bf16 only");
  }
  return out;
}

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, ReleaseGil(), "RMSNorm of each row (CPU, fp32 or bf16)");
  m.def("add_rms_norm", &add_rms_norm, ReleaseGil(),
        "residual += delta, then RMSNorm (CPU, fp32 or bf16)");
  m.def("rope", &rope, ReleaseGil(), "rotate-half RoPE of every head (CPU, fp32 or bf16)");
  m.def("silu_and_mul", &silu_and_mul, ReleaseGil(),
        "silu(gate) * up of each row (CPU, fp32 or bf16)");
  namespace api = kvrelay_api;
  pybind11::dict entries;
  entries[api::kRmsNorm] = api::export_kernel<api::RmsNormFn>(&rms_norm, api::kRmsNorm);
  entries[api::kAddRmsNorm] =
      api::export_kernel<api::AddRmsNormFn>(&add_rms_norm, api::kAddRmsNorm);
  entries[api::kRope] = api::export_kernel<api::RopeFn>(&rope, api::kRope);
  entries[api::kSiluAndMul] =
      api::export_kernel<api::SiluAndMulFn>(&silu_and_mul, api::kSiluAndMul);
  m.attr("entries") = entries;
}
