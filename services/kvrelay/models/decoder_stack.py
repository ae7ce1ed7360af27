"""A model's decoder layers bound to the C++ decoder stack (`kvrelay_kernels.cpu_stack`), which
runs every layer of an all-decode CPU step in one call.

Measured on a 2-core EPYC (AVX512-BF16), one bf16 stream: a third of the engine thread's decode
step was Python and dispatch around ~360 kernel calls, with the other OpenMP thread waiting
meanwhile. The stack calls the same kernels from C++, so its results are bit for bit those of
`DecoderLayer.forward`; it takes a step only when every layer's matmuls run on one of kvrelay's
C++ kernels (the blocked one, or the GGUF Q4_1 / Q8_0 block kernels) and the step is all
decodes (one query token per sequence, in order). Prefill chunks, mixed steps and matmuls on
torch's kernels (oneDNN, torch's int4) run the Python layers, and so do the families whose
layer is not Llama's (`families.runs_in_decoder_stack`: q/k norms, Gemma's norms and gelu,
sliding windows, soft caps, local RoPE tables).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from kvrelay.models.families import runs_in_decoder_stack
from kvrelay.models.inputs import AttentionInputs
from kvrelay.models.layers import NativeMatmul
from kvrelay_kernels.cpu_stack import new_decoder_stack

if TYPE_CHECKING:
    from kvrelay.models.llama import CausalLM, DecoderLayer


class DecoderStack:
    """The native stack of one model's layers, in the model's dtype."""

    def __init__(self, native: Any, dtype: torch.dtype, max_rows: int) -> None:
        self.native = native
        self.dtype = dtype
        self.max_rows = max_rows  # more rows take another path in some layer's matmul

    def takes(self, h: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionInputs) -> bool:
        """Whether this step can run here: CPU tensors of the stack's dtype, no more rows than
        every layer's matmul kernel takes, and only decodes, one row each in sequence order
        (the plan then needs no gather of queries)."""
        plan = attn.plan
        return (
            h.is_cpu
            and h.shape[0] <= self.max_rows
            and h.dtype == self.dtype
            and kv_cache.dtype == self.dtype
            and plan.has_decodes
            and not plan.prefills
            and plan.decode_token_idx is None
            and attn.slot_mapping.dtype == torch.int64
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """Every layer on the residual stream `h` ([T, hidden], updated in place), writing the
        step's K/V into `kv_cache`; what the Python layers return, bit for bit."""
        plan = attn.plan
        out: torch.Tensor = self.native.forward(
            h, cos, sin, kv_cache, attn.slot_mapping, plan.decode_block_tables, plan.decode_lens
        )
        return out


def build_decoder_stack(model: CausalLM) -> DecoderStack | None:
    """The stack of `model`'s layers when it can take them: Llama's layer (no family feature
    the stack lacks), the `cpu` attention backend, every
    matmul on one of kvrelay's C++ kernels (`native_matmul`: the blocked kernel after
    `prepack`, in the model's dtype; the GGUF block kernels), norms in the model's dtype, and
    the C++ extensions built. None otherwise (the Python layers serve)."""
    config, dtype = model.config, model.embed_tokens.weight.dtype
    layers = cast("list[DecoderLayer]", list(model.layers))
    if not runs_in_decoder_stack(config):
        return None
    if model.backend.name != "cpu" or not all(_norms_fit(layer, dtype) for layer in layers):
        return None
    matmuls = [[_native(linear, dtype) for linear in _linears(layer)] for layer in layers]
    found = [m for row in matmuls for m in row if m is not None]
    if len(found) != 4 * len(layers):
        return None
    first = layers[0].self_attn
    modules = list({id(m.module): m.module for m in found}.values())
    native = new_decoder_stack(first.num_heads, first.num_kv_heads, first.head_dim,
                               config.rms_norm_eps, first.scale, modules)  # fmt: skip
    if native is None:
        return None
    for layer, row in zip(layers, matmuls, strict=True):
        specs = [(m.kernel, m.weights, m.out_features, m.bias) for m in row if m is not None]
        native.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            specs,
        )
    return DecoderStack(native, dtype, min(m.max_rows for m in found))


def _linears(layer: DecoderLayer) -> list[Any]:
    """The layer's matmuls in the stack's order: qkv, o, gate_up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _norms_fit(layer: DecoderLayer, dtype: torch.dtype) -> bool:
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return all(norm.dtype == dtype and norm.is_cpu for norm in norms)


def _native(linear: Any, dtype: torch.dtype) -> NativeMatmul | None:
    """`linear`'s C++ matmul, if it has one the stack can call with activations of `dtype`
    (the blocked kernel's packed weight is of one dtype; the GGUF kernels take either)."""
    native = getattr(linear, "native_matmul", None)
    found: NativeMatmul | None = native() if native is not None else None
    if found is None:
        return None
    if found.kernel == "kvrelay.blocked_matmul" and found.weights[0].dtype != dtype:
        return None
    return found
