"""A model's decoder layers bound to the C++ decoder stack (`kvrelay_kernels.cpu_stack`), which
runs every layer of an all-decode CPU step in one call.

Measured on a 2-core EPYC (AVX512-BF16), one bf16 stream: a third of the engine thread's decode
step was Python and dispatch around ~360 kernel calls, with the other OpenMP thread waiting
meanwhile. The stack calls the same kernels from C++, so its results are bit for bit those of
`DecoderLayer.forward`; it takes a step only when every layer's matmuls run on kvrelay's
blocked kernel and the step is all decodes (one query token per sequence, in order).
Prefill chunks, mixed steps and other weight formats run the Python layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from kvrelay.models.inputs import AttentionInputs
from kvrelay.models.layers import Blocked, Linear
from kvrelay_kernels.cpu_stack import new_decoder_stack

if TYPE_CHECKING:
    from kvrelay.models.llama import CausalLM, DecoderLayer


class DecoderStack:
    """The native stack of one model's layers, in the model's dtype."""

    def __init__(self, native: Any, dtype: torch.dtype) -> None:
        self.native = native
        self.dtype = dtype

    def takes(self, h: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionInputs) -> bool:
        """Whether this step can run here: CPU tensors of the stack's dtype, and only decodes,
        one row each in sequence order (the plan then needs no gather of queries)."""
        plan = attn.plan
        return (
            h.is_cpu
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
    """The stack of `model`'s layers when it can take them: the `cpu` attention backend, every
    matmul on the blocked kernel (after `prepack`) in the model's dtype, norms in that dtype,
    and the C++ extensions built. None otherwise (the Python layers serve)."""
    config, dtype = model.config, model.embed_tokens.weight.dtype
    layers = cast("list[DecoderLayer]", list(model.layers))
    if model.backend.name != "cpu" or not all(_fits(layer, dtype) for layer in layers):
        return None
    first = layers[0].self_attn
    native = new_decoder_stack(
        first.num_heads, first.num_kv_heads, first.head_dim, config.rms_norm_eps, first.scale
    )
    if native is None:
        return None
    for layer in layers:
        native.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            [_bound(linear) for linear in _linears(layer)],
        )
    return DecoderStack(native, dtype)


def _linears(layer: DecoderLayer) -> list[Any]:
    """The layer's matmuls in the stack's order: qkv, o, gate_up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _fits(layer: DecoderLayer, dtype: torch.dtype) -> bool:
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(norm.dtype != dtype or not norm.is_cpu for norm in norms):
        return False
    for linear in _linears(layer):
        blocked = linear.blocked if isinstance(linear, Linear) else None
        if blocked is None or blocked[1].dtype != dtype:
            return False
    return True


def _bound(linear: Linear) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """A blocked matmul's packed weight, out-features and fp32 bias, as the stack takes them."""
    blocked: Blocked | None = linear.blocked
    assert blocked is not None
    _, blocks, out_features, bias = blocked
    return blocks, out_features, bias
