"""Where the engine runs: `--device` names resolved to a torch device, and the dtype that suits it.

Resolution only; nothing here allocates or moves tensors.
"""

from __future__ import annotations

import re

import torch

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


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` -> bfloat16 on CUDA (half the bytes per weight and KV entry, tensor cores), and
    float32 elsewhere (the fast one on CPU: oneDNN prepacks fp32 weights only)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
