"""Fake CUDA: the engine's CUDA code paths run on a CPU-only machine with shapes-only tensors.

torch's fake tensors can claim the `cuda` device without a GPU; with a no-op CUDA device guard
(guard.cpp), a stand-in CUDA runtime (runtime.py), stand-ins for the compiled kernels that
check what the C++ binding checks (kernels.py) and a dispatch mode that keeps host tensors
real (mode.py), whole engine steps take the paths a GPU would: the CUDA backend, mixed steps
split between the decode kernel and Triton, CUDA graphs, pinned staging, events. Every rule of
issue 14's hot loop is enforced there: no device value read on the host, no blocking upload,
no host tensor mixed into a device op, no index built implicitly on the host.

It changes process-wide state (torch.cuda's functions, a registered device guard), so it runs
in its own process: tests/fake_cuda/scenarios.py, driven by tests/engine/test_fake_cuda.py.
"""
