// A do-nothing device guard for CUDA, for CPU-only builds of torch (tests/fake_cuda): with it
// registered, torch's device guards accept CUDA tensors, so fake (shapes-only) CUDA tensors can
// be created and copied to on a machine without a GPU or a CUDA build. Never load this into a
// process that has real CUDA: it would replace the real guard.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "registers a no-op CUDA device guard (fake CUDA tensors on CPU-only torch)";
}
