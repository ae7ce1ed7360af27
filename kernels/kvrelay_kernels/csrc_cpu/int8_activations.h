// The activations of int8_dot_matmul.cpp: each call's input rows quantized once to int8 per
// block of 32 values (scale dx = max|x| / 127, codes x / dx rounded half to even, in
// -127..127), read from fp32 or bf16; the scalar and the AVX-512 paths make the same codes,
// bit for bit. Included by int8_dot_matmul.cpp alone (one extension, one source);
// cpu_extension.py adds a hash of the headers to every build's flags, so an edit here rebuilds
// the extension.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// The instruction set a build targets (int8_dot_matmul.cpp's kernels choose by it too).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVRELAY_VNNI512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVRELAY_AVX2 1
#endif

namespace kvrelay_int8 {

constexpr int64_t kBlock = 32;         // values per block, weights and activations alike
constexpr int kMaxCode = 127;

// One call's input rows as int8 blocks, in element order.
struct Activations {
  int64_t rows = 0, k = 0, blocks = 0;
  std::vector<int8_t> codes;   // [rows, k]
  std::vector<float> d;        // [rows, blocks] scales
  std::vector<float> s;        // [rows, blocks] d * sum(codes of the block)
  std::vector<int32_t> sums;   // [rows, blocks] sum(codes of the block)

  const int32_t* words(int64_t t, int64_t b) const {
    return reinterpret_cast<const int32_t*>(codes.data() + t * k + b * kBlock);
  }
};

// Quantizes one block of 32 fp32 values. Non-finite input gives a NaN scale (and zero codes),
// so the outputs it touches are NaN, as a float matmul's would be.
inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& sum) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < kBlock; ++i) {
    const float a = std::fabs(x[i]);
    finite &= a <= FLT_MAX;
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    d = std::numeric_limits<float>::quiet_NaN();
    sum = 0;
    std::memset(q, 0, kBlock);
    return;
  }
  d = amax / static_cast<float>(kMaxCode);
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t total = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    // nearbyint: round half to even, as the vector instructions round.
    int32_t code = static_cast<int32_t>(std::nearbyint(x[i] * inverse));
    code = std::min(kMaxCode, std::max(-kMaxCode, code));
    q[i] = static_cast<int8_t>(code);
    total += code;
  }
  sum = total;
}

// 32 values as fp32 (bf16 widens exactly), for the scalar path.
inline const float* block_floats(const float* x, float (&)[kBlock]) { return x; }
inline const float* block_floats(const c10::BFloat16* x, float (&buffer)[kBlock]) {
  for (int64_t i = 0; i < kBlock; ++i) buffer[i] = static_cast<float>(x[i]);
  return buffer;
}

#if defined(KVRELAY_VNNI512)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bf16 bits are fp32's top half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The same as quantize_block, 16 lanes at a time (the same codes, bit for bit), read from fp32
// or bf16 (no converted copy of the input).
template <typename T>
inline void quantize_block_simd(const T* x, int8_t* q, float& d, int32_t& sum) {
  const __m512 a = load16(x), b = load16(x + 16);
  const __m512 abs_a = _mm512_abs_ps(a), abs_b = _mm512_abs_ps(b);
  const __m512 big = _mm512_set1_ps(FLT_MAX);
  if (_mm512_cmp_ps_mask(abs_a, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(abs_b, big, _CMP_NLE_UQ)) {
    float buffer[kBlock];
    quantize_block(block_floats(x, buffer), q, d, sum);  // NaN or infinity: as the scalar path
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
  d = amax / static_cast<float>(kMaxCode);
  const __m512 inverse = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i top = _mm512_set1_epi32(kMaxCode), bottom = _mm512_set1_epi32(-kMaxCode);
  __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // half to even (MXCSR)
  __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
  qa = _mm512_max_epi32(bottom, _mm512_min_epi32(top, qa));
  qb = _mm512_max_epi32(bottom, _mm512_min_epi32(top, qb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#else
template <typename T>
inline void quantize_block_simd(const T* x, int8_t* q, float& d, int32_t& sum) {
  float buffer[kBlock];
  quantize_block(block_floats(x, buffer), q, d, sum);
}
#endif

// x: [rows, k] fp32 or bf16 (k a multiple of 32).
template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k) {
  Activations a;
  a.rows = rows;
  a.k = k;
  a.blocks = k / kBlock;
  a.codes.resize(rows * k);
  a.d.resize(rows * a.blocks);
  a.s.resize(rows * a.blocks);
  a.sums.resize(rows * a.blocks);
  // Rows apart from 16 on (a prefill chunk's 512 rows of 1,536 values is a few hundred us).
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int64_t at = t * a.blocks + b;
        quantize_block_simd(x + t * k + b * kBlock, a.codes.data() + t * k + b * kBlock, a.d[at],
                            a.sums[at]);
        a.s[at] = a.d[at] * static_cast<float>(a.sums[at]);
      }
    }
  });
  return a;
}

}  // namespace kvrelay_int8
