"""Building blocks of the Llama-family decoder: a decode-friendly Linear, RMSNorm, the gated MLP.

Weights come from a checkpoint: `loader.py` builds the model on the meta device and assigns them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.cpu_features import cpu_has_native_bf16
from kvrelay.models.many_rows import NEVER, onednn_from_rows
from kvrelay_kernels.cpu_blocked import blocked_ops_for, load_blocked_ops, pack_blocks
from kvrelay_kernels.cpu_fused import fused_ops_for
from kvrelay_kernels.gpu_fused import gpu_fused_ops_for

# kvrelay's blocked kernel bound to one weight: the kernel, the weight packed in its blocks,
# the out-features and the fp32 bias, bound once (reading a parameter through
# `nn.Module.__getattr__` costs about a microsecond).
Blocked = tuple[Callable[..., torch.Tensor], torch.Tensor, int, torch.Tensor | None]


class NativeMatmul(NamedTuple):
    """A layer's matmul as the C++ decoder stack calls it (`models/decoder_stack.py`)."""

    kernel: str  # the kernel's capsule name (kvrelay_kernels/csrc_cpu/kernel_api.h)
    weights: list[torch.Tensor]  # what the kernel takes after x, before the bias
    out_features: int
    bias: torch.Tensor | None
    module: ModuleType  # the extension exporting the kernel
    max_rows: int  # the most rows the layer sends to this kernel (more take another path)


# Below this many rows `linear` computes `W @ x.T`; measured crossover with `F.linear`.
SMALL_BATCH_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` that stays near memory bandwidth for the few rows of a decode step.

    Measured on this repo's 2-core AVX2 machine (torch 2.13, MKL): `x @ W.T` with 1-8 rows
    streams the weights at about a third of memory bandwidth, while `W @ x.T` with at least
    two columns runs near it: the default model's decode step takes half the time at batch 1,
    two thirds at batch 8. A single row is doubled (one row's copy is free next to the
    weights). From `SMALL_BATCH_ROWS` rows on (prefill), `F.linear` is faster.

    Args:
        x: `[M, in]`. weight: `[out, in]`. bias: `[out]` or None.

    Returns:
        `[M, out]`, contiguous.
    """
    rows = x.shape[0]
    # On a GPU cuBLAS picks its own kernel for a few rows; the transposes and the doubled row
    # would only add launches there.
    if rows >= SMALL_BATCH_ROWS or x.dim() != 2 or not x.is_cpu:
        return F.linear(x, weight, bias)
    cols = x.t() if rows > 1 else torch.cat((x, x)).t()  # [in, max(M, 2)]
    out = (weight @ cols)[:, :rows].t().contiguous()  # [M, out]
    if bias is not None:
        out += bias
    return out


def can_prepack(weight: torch.Tensor) -> bool:
    """True when oneDNN can hold `weight` in its blocked layout: fp32 on a CPU with oneDNN,
    bf16 on a CPU that computes bf16 in hardware (emulated bf16 is slower than fp32)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu_has_native_bf16()


class PackedLinear(nn.Module):
    """A linear layer whose weight lives in oneDNN's blocked layout (CPU, fp32 or bf16).

    Measured on this repo's 2-core AVX2 machine: oneDNN's packed matmul runs 1.2-2x faster
    than `F.linear` at every row count, from one decode token to a 512-token prefill chunk
    (it keeps the weight in the tile order its kernels stream), and 1.5-3x faster than
    `linear` above from two rows on; for a single fp32 row `linear` is faster there.

    bf16 (on AVX512-BF16 / AMX CPUs) is oneDNN's bf16 kernel: on a 2-core Xeon with AMX it is
    1.1-2x faster than bf16 `linear` at 1, 4 and 16 rows and 2-3x faster than packed fp32
    (`benchmarks/quantized_decode.py --layers`), so bf16 takes this path at every row count.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # `[out, in]` in oneDNN's opaque layout; only `_linear_pointwise` reads it.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        # A single row: bf16 is faster through oneDNN; fp32 through `linear` on some CPUs and
        # through oneDNN on others (models/single_row.py measures it once the model is packed).
        self.single_row = weight.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] -> [M, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def blocked_of(
    weight: torch.Tensor, bias: torch.Tensor | None, blocks: torch.Tensor | None = None
) -> Blocked | None:
    """kvrelay's blocked kernel (`kvrelay_kernels.cpu_blocked`) bound to `weight` and `bias`
    where it builds for them; None elsewhere.

    Args:
        weight: `[out, in]`. bias: `[out]` or None.
        blocks: `weight` already packed (`pack_blocks`), as `CausalLM.prepack` packs a model's
            weights into one allocation; packed here when None.
    """
    module = blocked_ops_for(weight)
    if module is None:
        return None
    packed = pack_blocks(weight) if blocks is None else blocks
    fp32_bias = None if bias is None else bias.detach().float().contiguous()
    return module.blocked_matmul, packed, weight.shape[0], fp32_bias


def run_blocked(blocked: Blocked | None, x: torch.Tensor) -> torch.Tensor | None:
    """`x @ W.T + b` through the bound blocked kernel when it takes `x` (2-D, of the weight's
    dtype); None when it does not."""
    if blocked is None or x.dim() != 2:
        return None
    kernel, blocks, out_features, bias = blocked
    if x.dtype != blocks.dtype:
        return None
    out: torch.Tensor = kernel(x, blocks, out_features, bias)
    return out


class Linear(nn.Linear):
    """`nn.Linear` whose forward is `linear` above (same parameters, same state dict).

    After loading, `prepack()` binds kvrelay's blocked kernel to a packed copy of the weight
    where it builds (AVX-512; bf16 with AVX512-BF16), else adds oneDNN's packed copy. A bf16
    layer on the blocked kernel sends steps of `onednn_from_rows` rows or more to oneDNN on
    its dense weight instead (`models/many_rows.py`: AMX tiles where the CPU has them).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: PackedLinear | None = None
        self.blocked: Blocked | None = None
        self.onednn_from_rows = NEVER  # set by `prepack` from the measured crossover

    def prepack(self, blocks: torch.Tensor | None = None) -> None:
        """Pack a copy of the weight for the fastest CPU path: kvrelay's blocked kernel where
        it builds for the weight (a decode step's one row at memory speed; on an AVX-512 EPYC
        16 rows at 1.4-1.6x oneDNN's speed, a prefill chunk at oneDNN's), oneDNN's packed
        layout elsewhere (`can_prepack`). A bf16 weight on the blocked kernel also gets the
        row count from which oneDNN on the dense weight is faster (`many_rows.onednn_from_rows`:
        measured, or pinned by KVRELAY_CPU_MANY_ROWS; no copy is made for it).

        For inference only. The dense weight stays (the state dict, other dtypes): weights
        take twice the memory, a fair price on CPU for the fastest path.

        Args:
            blocks: the weight already packed (`pack_blocks`); see `blocked_of`.
        """
        self.blocked = blocked_of(self.weight, self.bias, blocks)
        self.onednn_from_rows = NEVER
        if self.blocked is not None:
            blocked = self.blocked
            self.onednn_from_rows = onednn_from_rows(
                self.weight, lambda x: run_blocked(blocked, x), self.onednn
            )
        elif can_prepack(self.weight):
            self.packed = PackedLinear(self.weight, self.bias)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T + b` through torch's linear on the dense weight: oneDNN for bf16 on the
        CPU, on AMX tiles where the CPU has them."""
        return F.linear(x, self.weight, self.bias)

    def native_matmul(self) -> NativeMatmul | None:
        """This layer's matmul for the decoder stack: the blocked kernel, below the row count
        where oneDNN takes over, once `prepack` bound it; None otherwise."""
        if self.blocked is None:
            return None
        module = load_blocked_ops()  # built already: `prepack` bound its kernel
        if module is None:
            return None
        _, blocks, out_features, bias = self.blocked
        max_rows = sys.maxsize if self.onednn_from_rows == NEVER else self.onednn_from_rows - 1
        return NativeMatmul("kvrelay.blocked_matmul", [blocks], out_features, bias, module,
                            max_rows)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= self.onednn_from_rows:
            return self.onednn(x)  # many rows, where oneDNN measured faster
        out = run_blocked(self.blocked, x)
        if out is not None:
            return out
        packed = self.packed
        if packed is not None and (x.shape[0] > 1 or packed.single_row):
            return packed.forward(x)
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 like HF's `LlamaRMSNorm`, cast back afterwards."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]. On the CPU one C++ call (kvrelay_kernels.cpu_fused); elsewhere
        # torch's fused kernel in fp32; other dtypes normalize in fp32, cast back, then
        # scale, as HF does (two roundings, like HF's).
        fused = fused_ops_for(x)
        if fused is not None and x.dtype == self.weight.dtype:
            out: torch.Tensor = fused.rms_norm(x, self.weight, self.eps)
            return out
        gpu = gpu_fused_ops_for(x)
        if gpu is not None and x.dtype == self.weight.dtype:
            return gpu.rms_norm(x, self.weight, self.eps)  # one launch, the same roundings
        return self.forward_with_torch_ops(x)

    def forward_with_torch_ops(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` in torch ops (any device and dtype)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`residual += delta` in place, then the norm of the sum (one call on the CPU)."""
        fused = fused_ops_for(residual)
        if fused is not None and residual.dtype == delta.dtype == self.weight.dtype:
            out: torch.Tensor = fused.add_rms_norm(residual, delta, self.weight, self.eps)
            return out
        gpu = gpu_fused_ops_for(residual)
        if gpu is not None and residual.dtype == delta.dtype == self.weight.dtype:
            return gpu.add_rms_norm(residual, delta, self.weight, self.eps)
        residual.add_(delta)
        return self.forward(residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm (HF's `Gemma2RMSNorm` / `Gemma3RMSNorm`): normalized and scaled by
    `1 + weight` all in fp32, cast back once; the checkpoint stores the offset from one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        residual.add_(delta)
        return self.forward(residual)


def head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm` over each head of `x: [T, heads, head_dim]` (Qwen3's and Gemma 3's q/k norms);
    returns a new contiguous `[T, heads, head_dim]`."""
    t, heads, d = x.shape
    return norm.forward(x.reshape(t * heads, d)).view(t, heads, d)


class GatedMLP(nn.Module):
    """Gated feed-forward: `down(act(gate(x)) * up(x))` with gate and up fused in one matmul;
    `act` is silu (SwiGLU) or, for Gemma, gelu's tanh approximation.

    `gate_up_proj.weight` is `[2 * intermediate, hidden]`: HF's gate rows, then up rows.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(
                f"hidden_act {activation!r} is not implemented (silu, gelu_pytorch_tanh)"
            )
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [T, 2 * intermediate]
        if self.activation != "silu":  # the fused ops are silu's; gelu runs in torch ops
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj.forward(F.gelu(gate, approximate="tanh").mul_(up))
        fused = fused_ops_for(gate_up)
        if fused is not None:  # one C++ call on the CPU, bit for bit the torch code below
            return self.down_proj.forward(fused.silu_and_mul(gate_up))
        gpu = gpu_fused_ops_for(gate_up)
        if gpu is not None:  # one Triton launch on a GPU, the same roundings
            return self.down_proj.forward(gpu.silu_and_mul(gate_up))
        return self.down_proj.forward(self.silu_and_mul_with_torch_ops(gate_up))

    def silu_and_mul_with_torch_ops(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `[T, 2 * intermediate]` in torch ops (any device and dtype)."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = F.silu(gate)  # the one new buffer; the product is done in place
        return h.mul_(up)
