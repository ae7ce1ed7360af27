// GGUF Q4_1 and Q8_0 weights times activations quantized to int8 (llama.cpp's scheme):
// integer dot products (AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw`) instead of turning every
// weight into fp32 (block_quant_matmul.cpp), whose conversions and multiply-adds bound that
// loop at one row; from one decode row to a 512-token prefill chunk.
//
// Each call quantizes its input rows once: a block of 32 values gets the scale
// dx = max|x| / 127 and the codes qx = x * (1 / dx) rounded half to even, in -127..127 (the
// same fp32 operations on every build, so every build makes the same codes). A block's product
// with a weight block is then exact in integers and scaled once:
//   Q4_1 (w = dw * qw + m, qw in 0..15):   dw * dx * sum(qw * qx) + m * (dx * sum(qx))
//   Q8_0 (w = dw * qw, qw in -128..127):   dw * dx * sum(qw * qx)
// The activations' rounding to 8 bits is the one error besides the order of the fp32 sums (a
// relative error of up to 1/254 of a block's largest value, like bf16's 1/256 of each value),
// so the path is opt-in (`int8_activations`). AVX-512, AVX2 and scalar builds agree to fp32
// rounding, not bit for bit.
//
// The weights are repacked once, at load, into panels of 16 output rows
// (`kvrelay.models.quantized.int8_panels`): for each block, the 4-byte words of the 16 rows
// side by side, so one 512-bit register holds four
// codes of each of 16 rows and one `vpdpbusd` with a broadcast activation word adds four
// products to each row's sum. A block of 16 rows then takes 8 dot instructions and one scale
// step, and the 16 sums are 16 outputs: no horizontal sums. (Two blocks of one row per
// register, the obvious layout, took 4 instructions per 64 products and ran at a third of
// this speed on a 2-core Zen 4.) Q4_1 needs no shuffle: byte 4g + k of a GGUF block holds
// elements 4g + k (low nibble) and 16 + 4g + k (high), so word g of each row, masked or
// shifted, meets activation words g and g + 4. Q8_0 codes (signed) are made unsigned for
// `vpdpbusd` by adding 128 as they are loaded, and 128 * sum(qx) is taken off by starting each
// block's sum at minus that; AVX2 moves their signs to the activations instead. Scales stay
// fp16 as in the file (a quarter fewer bytes to stream than fp32).

#include <torch/extension.h>
#include "int8_activations.h"  // Activations, quantize; the instruction-set defines
#include "kernel_api.h"

#include <c10/util/Half.h>  // fp16 scales, in the plain C++ path

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kvrelay_int8::Activations;
using kvrelay_int8::kBlock;
using kvrelay_int8::quantize;

constexpr int64_t kQ41CodeBytes = 16;  // a Q4_1 block's codes (two per byte)
constexpr int64_t kLanes = 16;         // output rows per panel

// ---------------------------------------------------------------------------------------
// Weights in panels of 16 rows

// codes: Q4_1 [N / 16, blocks, 4 words, 16 rows, 4 bytes]; Q8_0 [N / 16, blocks, 8 words, 16
// rows, 4 bytes]. d, m: [N / 16, blocks, 16 rows] fp16 bits.
struct Panels {
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;  // Q4_1 only
  int64_t panels, blocks;
};

template <bool kQ41>
constexpr int64_t words_per_block() {
  return kQ41 ? 4 : 8;
}

template <bool kQ41>
constexpr int64_t panel_block_bytes() {
  return words_per_block<kQ41>() * kLanes * 4;
}

// Where sums go: out[row, col] = sum + bias[col], rounded once to the output's dtype.
struct Output {
  float* fp32;          // [M, N], or null
  c10::BFloat16* bf16;  // [M, N], or null
  const float* bias;    // [N], or null
  int64_t n;

  // Row t's outputs n0 .. n0 + 15.
  inline void store(int64_t t, int64_t n0, const float (&sums)[kLanes]) const {
    for (int64_t i = 0; i < kLanes; ++i) {
      const float value = bias != nullptr ? sums[i] + bias[n0 + i] : sums[i];
      if (fp32 != nullptr) {
        fp32[t * n + n0 + i] = value;
      } else {
        bf16[t * n + n0 + i] = c10::BFloat16(value);
      }
    }
  }
};

// Every line of the block 16 blocks on (a panel's blocks, and the next panel's, are one
// stream): without it the loop waited on memory; 4 or 16 blocks ahead differed by 2-4%.
constexpr int64_t kPrefetchBlocks = 16;

template <bool kQ41>
inline void prefetch_ahead(const uint8_t* block) {
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBlocks * panel_block_bytes<kQ41>();
  for (int64_t line = 0; line < panel_block_bytes<kQ41>(); line += 64) {
    _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// Per instruction set: `Acc` (16 rows' sums of one input row) and `block_step<kQ41, MT>`,
// which adds block `b` of panel `p` times input rows [t0, t0 + MT) to `acc`.
#if defined(KVRELAY_VNNI512)

using Acc = __m512;
inline Acc zero_acc() { return _mm512_setzero_ps(); }
inline void to_floats(const Acc& acc, float (&out)[kLanes]) { _mm512_storeu_ps(out, acc); }

inline __m512 half_scales(const uint16_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

template <bool kQ41, int MT>
inline void block_step(const Panels& w, int64_t p, int64_t b, const Activations& a, int64_t t0,
                       Acc (&acc)[MT]) {
  const int64_t at = p * w.blocks + b;
  const uint8_t* bytes = w.codes + at * panel_block_bytes<kQ41>();
  prefetch_ahead<kQ41>(bytes);
  const __m512 dw = half_scales(w.d + at * kLanes);
  __m512 m = _mm512_setzero_ps();
  __m512i codes[8];
  if (kQ41) {
    m = half_scales(w.m + at * kLanes);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i packed = _mm512_loadu_si512(bytes + g * 64);
      codes[g] = _mm512_and_si512(packed, nibble);
      codes[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
  } else {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));  // qw + 128, unsigned
    for (int j = 0; j < 8; ++j) codes[j] = _mm512_xor_si512(_mm512_loadu_si512(bytes + j * 64), offset);
  }
  for (int t = 0; t < MT; ++t) {
    const int64_t xt = (t0 + t) * a.blocks + b;
    const int32_t* x = a.words(t0 + t, b);
    // Two chains of four dot steps (exact int32 sums), then one scale step per block.
    __m512i low = kQ41 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a.sums[xt]);
    __m512i high = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      low = _mm512_dpbusd_epi32(low, codes[g], _mm512_set1_epi32(x[g]));
      high = _mm512_dpbusd_epi32(high, codes[g + 4], _mm512_set1_epi32(x[g + 4]));
    }
    const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(low, high));
    acc[t] = _mm512_fmadd_ps(dots, _mm512_mul_ps(dw, _mm512_set1_ps(a.d[xt])), acc[t]);
    if (kQ41) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[xt]), acc[t]);
  }
}

#elif defined(KVRELAY_AVX2)

struct Acc {
  __m256 half[2];  // rows 0-7 and 8-15 of the panel
};
inline Acc zero_acc() { return {{_mm256_setzero_ps(), _mm256_setzero_ps()}}; }
inline void to_floats(const Acc& acc, float (&out)[kLanes]) {
  _mm256_storeu_ps(out, acc.half[0]);
  _mm256_storeu_ps(out + 8, acc.half[1]);
}

inline __m256 half_scales(const uint16_t* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

template <bool kQ41, int MT>
inline void block_step(const Panels& w, int64_t p, int64_t b, const Activations& a, int64_t t0,
                       Acc (&acc)[MT]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t at = p * w.blocks + b;
  const uint8_t* bytes = w.codes + at * panel_block_bytes<kQ41>();
  prefetch_ahead<kQ41>(bytes);
  for (int h = 0; h < 2; ++h) {
    const __m256 dw = half_scales(w.d + at * kLanes + 8 * h);
    // [word][rows of this half]: Q4_1 unsigned codes; Q8_0 |codes| and the codes.
    __m256i codes[8], signs[8];
    if (kQ41) {
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      for (int g = 0; g < 4; ++g) {
        const __m256i packed =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + g * 64 + 32 * h));
        codes[g] = _mm256_and_si256(packed, nibble);
        codes[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        signs[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + j * 64 + 32 * h));
        codes[j] = _mm256_sign_epi8(signs[j], signs[j]);  // |qw|: -128 reads 128 unsigned
      }
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t xt = (t0 + t) * a.blocks + b;
      const int32_t* x = a.words(t0 + t, b);
      __m256i dot = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i q = _mm256_set1_epi32(x[j]);
        if (!kQ41) q = _mm256_sign_epi8(q, signs[j]);  // qw's sign moved to qx
        // Pairs of products: at most 2 * 128 * 127 < 2^15, so vpmaddubsw never saturates.
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(codes[j], q), ones));
      }
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                   _mm256_mul_ps(dw, _mm256_set1_ps(a.d[xt])), acc[t].half[h]);
      if (kQ41) {
        sum = _mm256_fmadd_ps(half_scales(w.m + at * kLanes + 8 * h), _mm256_set1_ps(a.s[xt]), sum);
      }
      acc[t].half[h] = sum;
    }
  }
}

#else  // plain C++

struct Acc {
  float lane[kLanes];
};
inline Acc zero_acc() { return Acc{}; }
inline void to_floats(const Acc& acc, float (&out)[kLanes]) {
  std::memcpy(out, acc.lane, sizeof out);
}

template <bool kQ41, int MT>
inline void block_step(const Panels& w, int64_t p, int64_t b, const Activations& a, int64_t t0,
                       Acc (&acc)[MT]) {
  constexpr int64_t kWords = words_per_block<kQ41>();
  const int64_t at = p * w.blocks + b;
  const uint8_t* bytes = w.codes + at * panel_block_bytes<kQ41>();
  for (int t = 0; t < MT; ++t) {
    const int64_t xt = (t0 + t) * a.blocks + b;
    const int8_t* x = a.codes.data() + (t0 + t) * a.k + b * kBlock;
    for (int64_t i = 0; i < kLanes; ++i) {
      int32_t dot = 0;
      for (int64_t j = 0; j < kWords; ++j) {
        for (int k = 0; k < 4; ++k) {
          const uint8_t byte = bytes[(j * kLanes + i) * 4 + k];
          if (kQ41) {
            dot += (byte & 15) * x[4 * j + k] + (byte >> 4) * x[16 + 4 * j + k];
          } else {
            dot += static_cast<int8_t>(byte) * x[4 * j + k];
          }
        }
      }
      const float dw = c10::detail::fp16_ieee_to_fp32_value(w.d[at * kLanes + i]);
      float sum = acc[t].lane[i] + static_cast<float>(dot) * (dw * a.d[xt]);
      if (kQ41) sum += c10::detail::fp16_ieee_to_fp32_value(w.m[at * kLanes + i]) * a.s[xt];
      acc[t].lane[i] = sum;
    }
  }
}

#endif

// Panel p times input rows [t0, t0 + MT), every block.
template <bool kQ41, int MT>
inline void tile(const Panels& w, const Activations& a, int64_t p, int64_t t0, const Output& out) {
  Acc acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = zero_acc();
  for (int64_t b = 0; b < w.blocks; ++b) block_step<kQ41, MT>(w, p, b, a, t0, acc);
  for (int t = 0; t < MT; ++t) {
    float sums[kLanes];
    to_floats(acc[t], sums);
    out.store(t0 + t, p * kLanes, sums);
  }
}

// Panels [begin, end) against every input row, up to four rows at a time. (Two panels at a
// time for one row, four dot chains instead of two, made two streams and ran 10-40% slower.)
template <bool kQ41>
void panels_range(const Panels& w, const Activations& a, int64_t begin, int64_t end,
                  const Output& out) {
  for (int64_t p = begin; p < end; ++p) {
    int64_t t = 0;
    for (; t + 4 <= a.rows; t += 4) tile<kQ41, 4>(w, a, p, t, out);
    for (; t + 2 <= a.rows; t += 2) tile<kQ41, 2>(w, a, p, t, out);
    if (t < a.rows) tile<kQ41, 1>(w, a, p, t, out);
  }
}

// ---------------------------------------------------------------------------------------
// Checks and entry points

void check_panels(const torch::Tensor& codes, const torch::Tensor& d,
                  const c10::optional<torch::Tensor>& m, int64_t block_bytes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) % block_bytes == 0,
              "panel codes must be contiguous uint8 [out_features / 16, blocks * ", block_bytes,
              "] (from the *_panels functions)");
  const int64_t blocks = codes.size(1) / block_bytes;
  auto check = [&](const torch::Tensor& s) {
    TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 2 &&
                    s.size(0) == codes.size(0) && s.size(1) == blocks * kLanes,
                "panel scales must be contiguous float16 [out_features / 16, blocks * 16]");
  };
  check(d);
  if (m.has_value()) check(*m);
}

torch::Tensor as_float(const torch::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// x (fp32 or bf16, [rows, k]) quantized, read in place where it is contiguous.
Activations quantize_input(const torch::Tensor& x) {
  const torch::Tensor input = x.contiguous();
  if (input.scalar_type() == at::kBFloat16) {
    return quantize(input.data_ptr<c10::BFloat16>(), input.size(0), input.size(1));
  }
  return quantize(input.data_ptr<float>(), input.size(0), input.size(1));
}

template <bool kQ41>
torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                           const torch::Tensor& d, const c10::optional<torch::Tensor>& m,
                           const c10::optional<torch::Tensor>& bias) {
  check_panels(codes, d, m, panel_block_bytes<kQ41>());
  const Panels w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 m.has_value() ? reinterpret_cast<const uint16_t*>(m->data_ptr()) : nullptr,
                 codes.size(0), codes.size(1) / panel_block_bytes<kQ41>()};
  const int64_t n = w.panels * kLanes, k = w.blocks * kBlock;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k,
              "x must be a [rows, in_features] CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  torch::Tensor bias_values;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && (bias->scalar_type() == at::kFloat ||
                                       bias->scalar_type() == at::kBFloat16),
                "bias must be float32 or bfloat16 [out_features]");
    bias_values = as_float(*bias);
  }
  const Activations a = quantize_input(x);
  torch::Tensor out = torch::empty({x.size(0), n}, x.options());
  const bool fp32 = x.scalar_type() == at::kFloat;
  const Output sink{fp32 ? out.data_ptr<float>() : nullptr,
                    fp32 ? nullptr : out.data_ptr<c10::BFloat16>(),
                    bias.has_value() ? bias_values.data_ptr<float>() : nullptr, n};
  at::parallel_for(0, w.panels, 1, [&](int64_t begin, int64_t end) {
    panels_range<kQ41>(w, a, begin, end, sink);
  });
  return out;
}

}  // namespace

torch::Tensor q4_1_int8_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                               const torch::Tensor& d, const torch::Tensor& m,
                               const c10::optional<torch::Tensor>& bias) {
  return panel_matmul<true>(x, codes, d, m, bias);
}

torch::Tensor q8_0_int8_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                               const torch::Tensor& d, const c10::optional<torch::Tensor>& bias) {
  return panel_matmul<false>(x, codes, d, c10::nullopt, bias);
}

// The activations' codes in element order, their scales and their sums per block, as the
// matmuls make them (for tests).
std::vector<torch::Tensor> int8_quantize(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % kBlock == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [rows, in_features] CPU tensor, in_features a "
              "multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const Activations a = quantize_input(x);
  torch::Tensor codes = torch::empty({rows, k}, torch::dtype(at::kChar));
  torch::Tensor scales = torch::empty({rows, blocks}, torch::dtype(at::kFloat));
  torch::Tensor sums = torch::empty({rows, blocks}, torch::dtype(at::kInt));
  std::memcpy(codes.data_ptr<int8_t>(), a.codes.data(), rows * k);
  std::memcpy(scales.data_ptr<float>(), a.d.data(), rows * blocks * sizeof(float));
  std::memcpy(sums.data_ptr<int32_t>(), a.sums.data(), rows * blocks * sizeof(int32_t));
  return {codes, scales, sums};
}

// Every kernel runs without the GIL, as torch's own ops do: a worker's other Python threads
// (Ray's output reporting, the actor's event loop) then run during a step's kernels, not in the
// gaps between them where the engine thread would wait for the GIL.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("q4_1_int8_matmul", &q4_1_int8_matmul, ReleaseGil(),
             "x @ W.T over Q4_1 panels, x quantized to int8 per 32 values (+ bias)");
  module.def("q8_0_int8_matmul", &q8_0_int8_matmul, ReleaseGil(),
             "x @ W.T over Q8_0 panels, x quantized to int8 per 32 values (+ bias)");
  module.def("int8_quantize", &int8_quantize, ReleaseGil(),
             "x's int8 codes, fp32 scales and int32 code sums per block of 32");
  namespace api = kvrelay_api;
  pybind11::dict entries;
  entries[api::kQ4_1Int8Matmul] =
      api::export_kernel<api::Q4_1MatmulFn>(&q4_1_int8_matmul, api::kQ4_1Int8Matmul);
  entries[api::kQ8_0Int8Matmul] =
      api::export_kernel<api::Q8_0MatmulFn>(&q8_0_int8_matmul, api::kQ8_0Int8Matmul);
  module.attr("entries") = entries;
}
