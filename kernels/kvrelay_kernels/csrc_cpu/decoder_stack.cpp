// Every decoder layer of an all-decode step in one call from Python (CPU, fp32 or bf16).
//
// A decode step of the default model runs 30 layers of ~12 kernels each. Driven from Python
// each kernel call costs a few microseconds of interpreter and dispatch around it, and while
// the engine thread pays that, the other OpenMP thread waits: measured on a 2-core EPYC, a
// third of one bf16 stream's decode step was that serial part. Here the same kernels run
// back to back from C++; they are the other extensions' own functions, reached through the
// capsules they export (kernel_api.h), so the results are bit for bit the Python path's.
//
// The layer is models/llama.py's DecoderLayer for an all-decode step whose matmuls each run
// one C++ kernel: kvrelay's blocked kernel, or the GGUF Q4_1 / Q8_0 block kernels (int8
// activations or not). Any other step (prefill chunks, torch's matmuls) runs in Python.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernel_api.h"

namespace {

namespace api = kvrelay_api;

// One matmul of a layer: x @ W.T (+ bias) by the kernel named `kernel` (a capsule name of
// kernel_api.h) over the weight tensors it takes after x: blocked_matmul's packed blocks, or
// a Q4_1 kernel's codes, scales and minimums, or a Q8_0 kernel's codes and scales.
using MatmulSpec =
    std::tuple<std::string, std::vector<torch::Tensor>, int64_t, std::optional<torch::Tensor>>;

class Matmul {
 public:
  Matmul(const pybind11::dict& entries, const MatmulSpec& spec)
      : weights_(std::get<1>(spec)), n_(std::get<2>(spec)), bias_(std::get<3>(spec)) {
    const std::string& kernel = std::get<0>(spec);
    TORCH_CHECK(entries.contains(kernel.c_str()), "decoder stack: no kernel ", kernel, " given");
    const pybind11::object entry = entries[kernel.c_str()];
    const size_t expected = kernel == api::kBlockedMatmul                                ? 1
                            : kernel == api::kQ4_1Matmul || kernel == api::kQ4_1Int8Matmul ? 3
                            : kernel == api::kQ8_0Matmul || kernel == api::kQ8_0Int8Matmul ? 2
                                                                                           : 0;
    TORCH_CHECK(expected > 0, "decoder stack: ", kernel, " is no matmul kernel");
    TORCH_CHECK(weights_.size() == expected, "decoder stack: ", kernel, " takes ", expected,
                " weight tensors, not ", weights_.size());
    if (expected == 1) blocked_ = api::import_kernel<api::BlockedMatmulFn>(entry, kernel.c_str());
    if (expected == 3) q4_1_ = api::import_kernel<api::Q4_1MatmulFn>(entry, kernel.c_str());
    if (expected == 2) q8_0_ = api::import_kernel<api::Q8_0MatmulFn>(entry, kernel.c_str());
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (blocked_ != nullptr) return blocked_(x, weights_[0], n_, bias_);
    if (q4_1_ != nullptr) return q4_1_(x, weights_[0], weights_[1], weights_[2], bias_);
    return q8_0_(x, weights_[0], weights_[1], bias_);
  }

 private:
  std::vector<torch::Tensor> weights_;
  int64_t n_ = 0;
  std::optional<torch::Tensor> bias_;
  api::BlockedMatmulFn blocked_ = nullptr;
  api::Q4_1MatmulFn q4_1_ = nullptr;
  api::Q8_0MatmulFn q8_0_ = nullptr;
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  Matmul qkv, o, gate_up, down;
};

struct Kernels {
  api::RmsNormFn rms_norm;
  api::AddRmsNormFn add_rms_norm;
  api::RopeFn rope;
  api::SiluAndMulFn silu_and_mul;
  api::DecodeAttentionFn attention;
  api::WriteKvFn write_kv;
};

Kernels import_kernels(const pybind11::dict& entries) {
  auto get = [&](const char* name) -> pybind11::object {
    TORCH_CHECK(entries.contains(name), "decoder stack: no kernel ", name, " given");
    return entries[name];
  };
  return Kernels{
      api::import_kernel<api::RmsNormFn>(get(api::kRmsNorm), api::kRmsNorm),
      api::import_kernel<api::AddRmsNormFn>(get(api::kAddRmsNorm), api::kAddRmsNorm),
      api::import_kernel<api::RopeFn>(get(api::kRope), api::kRope),
      api::import_kernel<api::SiluAndMulFn>(get(api::kSiluAndMul), api::kSiluAndMul),
      api::import_kernel<api::DecodeAttentionFn>(get(api::kDecodeAttention),
                                                 api::kDecodeAttention),
      api::import_kernel<api::WriteKvFn>(get(api::kWriteKv), api::kWriteKv),
  };
}

// cpu_backend._heads_contiguous: each token's heads one after another (no copy when so).
torch::Tensor heads_contiguous(const torch::Tensor& x) {
  if (x.stride(2) == 1 && x.stride(1) == x.size(2)) return x;
  return x.contiguous();
}

}  // namespace

class DecoderStack {
 public:
  // entries: every kernel's capsule (the extensions' `entries` dicts merged); eps: the
  // norms'; scale: attention's softmax scale.
  DecoderStack(const pybind11::dict& entries, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale)
      : entries_(entries),
        k_(import_kernels(entries)),
        heads_(num_heads),
        kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(scale) {}

  // Layers in order; linears: qkv, o, gate_up, down (the qkv rows are q's, k's, then v's).
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                 const std::vector<MatmulSpec>& linears) {
    TORCH_CHECK(linears.size() == 4, "decoder stack: qkv, o, gate_up and down expected");
    layers_.push_back(Layer{input_norm, post_norm, Matmul(entries_, linears[0]),
                            Matmul(entries_, linears[1]), Matmul(entries_, linears[2]),
                            Matmul(entries_, linears[3])});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h: [T, hidden], the residual stream, updated in place and returned; cos, sin:
  // [T, 1, head_dim / 2] in h's dtype; block_tables, seq_lens: the plan's decode tables.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
                        torch::Tensor kv_cache, const torch::Tensor& slot_mapping,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens) const {
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& layer = layers_[i];
      const torch::Tensor attended = attention(layer, i, k_.rms_norm(h, layer.input_norm, eps_),
                                               cos, sin, kv_cache, slot_mapping, block_tables,
                                               seq_lens);
      const torch::Tensor normed = k_.add_rms_norm(h, attended, layer.post_norm, eps_);
      h.add_(layer.down(k_.silu_and_mul(layer.gate_up(normed))));
    }
    return h;
  }

 private:
  // llama.py's Attention.forward, decode rows only.
  torch::Tensor attention(const Layer& layer, int64_t index, const torch::Tensor& x,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                          const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens) const {
    const int64_t tokens = x.size(0), qk_width = (heads_ + kv_heads_) * head_dim_;
    const torch::Tensor qkv = layer.qkv(x);
    const torch::Tensor qk = k_.rope(
        qkv.slice(1, 0, qk_width).view({tokens, heads_ + kv_heads_, head_dim_}), cos, sin);
    const torch::Tensor v = qkv.slice(1, qk_width).view({tokens, kv_heads_, head_dim_});
    k_.write_kv(heads_contiguous(qk.narrow(1, heads_, kv_heads_)), heads_contiguous(v),
                kv_cache, index, slot_mapping);
    const torch::Tensor out = k_.attention(qk.narrow(1, 0, heads_).contiguous(), kv_cache, index,
                                           block_tables, seq_lens, scale_);
    return layer.o(out.reshape({tokens, heads_ * head_dim_}));
  }

  pybind11::dict entries_;  // every kernel given, for the matmuls of layers added later
  Kernels k_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

// Kernels run without the GIL, as torch's ops do (why: int8_dot_matmul.cpp's module).
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<const pybind11::dict&, int64_t, int64_t, int64_t, double, double>(),
           pybind11::arg("entries"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"))
      .def("add_layer", &DecoderStack::add_layer, pybind11::arg("input_norm"),
           pybind11::arg("post_norm"), pybind11::arg("linears"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, ReleaseGil(),
           "run every layer of an all-decode step on h (in place)");
}
