"""Where the engine runs: `--device` names resolved to a torch device, and the dtype that suits it.

Resolution only; nothing here allocates or moves tensors.
"""

from __future__ import annotations

import re

import torch

from kvrelay.common.env import CPU_AUTO_DTYPE

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "meta")
_DEVICE = re.compile(r"^(auto|cpu|meta|cuda(:\d+)?)$")


def resolve_device(name: str) -> str:
    """`auto` -> `cuda` when torch sees a GPU, else `cpu`; other valid names unchanged.

    Raises:
        ValueError: an unknown name, or a CUDA device this machine does not have.
    """
    if not _DEVICE.match(name):
        raise ValueError(f"unknown device {name!r}; use one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} asked for, but torch sees no CUDA GPU here "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})"
            )
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)"
            )
    return name


# What `--dtype auto` means on a CPU, when set (float32 or bfloat16): the test suite pins
# float32 so its token-exact checks do not depend on the machine it runs on.
CPU_AUTO_DTYPE_ENV = CPU_AUTO_DTYPE.name
_CPU_AUTO_DTYPES = ("float32", "bfloat16")


def resolve_dtype(dtype: str, device: str, native_cpu_bf16: bool | None = None) -> str:
    """`auto` -> bfloat16 on CUDA (half the bytes per weight and KV entry, tensor cores); on a
    CPU, bfloat16 where it computes bf16 in hardware (AVX512-BF16, AMX, Arm BF16: oneDNN runs
    packed bf16 weights, ~3x fp32's speed on the default model), else float32 (emulated bf16
    is slower than fp32). `KVRELAY_CPU_AUTO_DTYPE` overrides the CPU's choice.

    Args:
        dtype: `auto` or a torch dtype name (returned as it is).
        device: the resolved device (`resolve_device`).
        native_cpu_bf16: whether the CPU computes bf16 natively; None: detect it.

    Raises:
        ValueError: `KVRELAY_CPU_AUTO_DTYPE` names another dtype.
    """
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    if device != "cpu":  # meta: shapes only
        return "float32"
    override = CPU_AUTO_DTYPE.get()
    if override:
        if override not in _CPU_AUTO_DTYPES:
            raise ValueError(
                f"{CPU_AUTO_DTYPE_ENV}={override!r}: use one of {', '.join(_CPU_AUTO_DTYPES)}"
            )
        return override
    if native_cpu_bf16 is None:
        from kvrelay.models.cpu_features import cpu_has_native_bf16

        native_cpu_bf16 = cpu_has_native_bf16()
    return "bfloat16" if native_cpu_bf16 else "float32"
