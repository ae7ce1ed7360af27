// 16 fp32 lanes in GCC's portable vector type (one AVX-512 register, two AVX2 ones), and
// fp32 / bf16 loads widened into them: what the CPU attention kernels compute in.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace kvrelay_vec16 {

typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
typedef uint32_t vword __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline float widen(float x) { return x; }

// bf16 -> fp32 is the 16 bits moved to the top half: written out so GCC vectorizes the loops.
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

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

}  // namespace kvrelay_vec16
