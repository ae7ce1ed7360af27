// The C++ entry points one CPU extension hands another (decoder_stack.cpp calls the matmul,
// norm, RoPE and attention kernels of the other extensions without going through Python).
//
// Each extension is its own shared library with its own compiler flags (fast-math for the
// attention, none for the element-wise ops that must round as torch does), so they are not
// linked together: an extension exports a kernel as a PyCapsule holding its address, named
// as below, and the caller takes the address back. The signatures are written once, here:
// `export_kernel<Fn>(&f, name)` does not compile when `f` no longer matches `Fn`.
// cpu_extension.py adds a hash of this file to every build's flags, so a change here
// rebuilds every extension that includes it.
#pragma once

#include <torch/extension.h>

#include <cstring>

namespace kvrelay_api {

// blocked_matmul.cpp: x [rows, k] @ W.T (+ fp32 bias) over the weight's packed blocks.
using BlockedMatmulFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& blocks,
                                          int64_t n, const c10::optional<torch::Tensor>& bias);
// block_quant_matmul.cpp (GGUF blocks) and int8_dot_matmul.cpp (int8 activations): x @ W.T
// (+ bias) over Q4_1's codes, scales and minimums, or Q8_0's codes and scales.
using Q4_1MatmulFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& codes,
                                       const torch::Tensor& d, const torch::Tensor& m,
                                       const c10::optional<torch::Tensor>& bias);
using Q8_0MatmulFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& codes,
                                       const torch::Tensor& d,
                                       const c10::optional<torch::Tensor>& bias);
// fused_layer_ops.cpp
using RmsNormFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& weight,
                                    double eps);
using AddRmsNormFn = torch::Tensor (*)(torch::Tensor& residual, const torch::Tensor& delta,
                                       const torch::Tensor& weight, double eps);
using RopeFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin);
using SiluAndMulFn = torch::Tensor (*)(const torch::Tensor& gate_up);
// paged_decode_attention.cpp
using DecodeAttentionFn = torch::Tensor (*)(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                            int64_t layer, const torch::Tensor& block_tables,
                                            const torch::Tensor& seq_lens, double scale);
using WriteKvFn = void (*)(const torch::Tensor& key, const torch::Tensor& value,
                           torch::Tensor& kv_cache, int64_t layer,
                           const torch::Tensor& slot_mapping);

// Capsule names, one per kernel (static storage: a capsule keeps the pointer).
constexpr const char kBlockedMatmul[] = "kvrelay.blocked_matmul";
constexpr const char kQ4_1Matmul[] = "kvrelay.q4_1_matmul";
constexpr const char kQ8_0Matmul[] = "kvrelay.q8_0_matmul";
constexpr const char kQ4_1Int8Matmul[] = "kvrelay.q4_1_int8_matmul";
constexpr const char kQ8_0Int8Matmul[] = "kvrelay.q8_0_int8_matmul";
constexpr const char kRmsNorm[] = "kvrelay.rms_norm";
constexpr const char kAddRmsNorm[] = "kvrelay.add_rms_norm";
constexpr const char kRope[] = "kvrelay.rope";
constexpr const char kSiluAndMul[] = "kvrelay.silu_and_mul";
constexpr const char kDecodeAttention[] = "kvrelay.paged_decode_attention";
constexpr const char kWriteKv[] = "kvrelay.write_kv";

// The capsule an extension's module exports in its `entries` dict, under `name`.
template <typename Fn>
pybind11::capsule export_kernel(Fn fn, const char* name) {
  static_assert(sizeof(Fn) == sizeof(void*), "a plain function pointer");
  return pybind11::capsule(reinterpret_cast<void*>(fn), name);
}

// The function an `export_kernel` capsule holds; fails on a capsule of another kernel.
template <typename Fn>
Fn import_kernel(const pybind11::object& entry, const char* name) {
  const auto capsule = entry.cast<pybind11::capsule>();
  TORCH_CHECK(capsule.name() != nullptr && std::strcmp(capsule.name(), name) == 0,
              "expected the capsule ", name);
  return reinterpret_cast<Fn>(capsule.get_pointer());
}

}  // namespace kvrelay_api
