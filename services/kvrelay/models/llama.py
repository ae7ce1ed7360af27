"""The one decoder of every supported family (Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3) over
kvrelay's paged KV cache; what a family changes is decided in `families.py`.

One forward runs a flattened batch of prefill chunks and decode tokens; attention goes through
the kernel backend's `write_kv` + `paged_attention`. No weight loading here (see `loader.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache, partial
from typing import cast

import torch
from torch import nn

from kvrelay.config import ModelConfig
from kvrelay.models import families
from kvrelay.models.decoder_stack import DecoderStack, build_decoder_stack
from kvrelay.models.families import has_o_proj_bias
from kvrelay.models.inputs import AttentionInputs
from kvrelay.models.layers import (
    Blocked,
    GatedMLP,
    GemmaRMSNorm,
    Linear,
    PackedLinear,
    RMSNorm,
    blocked_of,
    can_prepack,
    head_norm,
    linear,
    run_blocked,
)
from kvrelay.models.rope import RotaryEmbedding, apply_rope
from kvrelay.models.single_row import choose_single_row_paths
from kvrelay_kernels import AttentionBackend
from kvrelay_kernels.cpu_blocked import pack_blocks_together
from kvrelay_kernels.gpu_fused import gpu_fused_ops_for

# Below this many rows the vocab projection reads the GGUF's blocks where the loader gave
# them (`quantized_logits`): on a 2-core AVX2 EPYC, two threads, fp32, 4.0 / 4.0 / 5.8 /
# 10.6 ms at 1 / 2 / 4 / 8 rows against 10.3 / 10.1 / 10.8 / 11.6 for oneDNN's packed
# weight, which wins from 16 rows on (the block loop's multiply-adds, not its bytes, bound it).
QUANTIZED_LOGITS_BELOW_ROWS = 8
ALL_ROWS = sys.maxsize  # int8 activations: their vocab projection wins at every row count


@lru_cache
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as HF rounds Gemma's embedding scale before multiplying
    (in bf16 sqrt(3840) is 62.0); multiplying by it then rounds as HF's product does."""
    return float(torch.tensor(value, device="cpu").to(dtype))


def norm_for(config: ModelConfig, size: int) -> RMSNorm:
    """The family's RMSNorm over `size` features (Gemma's `1 + w` in fp32, else Llama's)."""
    return (GemmaRMSNorm if config.is_gemma else RMSNorm)(size, config.rms_norm_eps)


class Attention(nn.Module):
    """GQA self-attention with q, k and v fused in one matmul (`qkv_proj`).

    `qkv_proj.weight` is `[(num_heads + 2 * num_kv_heads) * head_dim, hidden]`: HF's q rows,
    then k rows, then v rows (and the same order for the bias, when the model has one).
    Per family (`families.py`): q/k norms before RoPE, the attention scale, this layer's
    sliding window and the scores' soft cap.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = families.attention_scale(config)
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, config.hidden_size, bias=has_o_proj_bias(config)
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if families.has_qk_norm(config):
            self.q_norm = norm_for(config, self.head_dim)
            self.k_norm = norm_for(config, self.head_dim)
        self.sliding_window = config.window_of(layer_idx)
        self.soft_cap = config.attn_logit_softcapping
        # The variants are passed only where set, so the families without them call the
        # kernels exactly as before.
        self.paged_attention: Callable[..., torch.Tensor] = backend.paged_attention
        if self.sliding_window is not None or self.soft_cap is not None:
            self.paged_attention = partial(
                backend.paged_attention, sliding_window=self.sliding_window, soft_cap=self.soft_cap
            )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        # x: [T, hidden]; cos, sin: [T, 1, head_dim // 2]
        num_tokens = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [T, (h + 2 * kvh) * d]
        gpu = gpu_fused_ops_for(qkv) if self.q_norm is None else None  # it rotates raw q/k
        if gpu is not None and kv_cache.device == qkv.device and cos.dtype == qkv.dtype:
            # One launch rotates q and k and writes k and v into their slots (same roundings).
            q = gpu.rope_and_write_kv(
                qkv, cos, sin, kv_cache, self.layer_idx, attn.slot_mapping, h, kvh, d
            )  # [T, h, d]
        else:
            q = self._rope_and_write_kv(qkv, cos, sin, kv_cache, attn)
        out = self.paged_attention(
            q,
            kv_cache,
            self.layer_idx,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            plan=attn.plan,
        )  # [T, h, d]
        return self.o_proj.forward(out.reshape(num_tokens, h * d))  # [T, hidden]

    def _rope_and_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """The rotated queries `[T, h, d]`, after the backend wrote the rotated keys and the
        values into the cache."""
        num_tokens = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q and k are rotated together (one set of elementwise ops for both); v is a view.
        qk = qkv[:, : (h + kvh) * d].view(num_tokens, h + kvh, d)
        v = qkv[:, (h + kvh) * d :].view(num_tokens, kvh, d)  # [T, kvh, d]
        if self.q_norm is not None and self.k_norm is not None:  # each head normed, then rotated
            q = apply_rope(head_norm(self.q_norm, qk[:, :h]), cos, sin)  # [T, h, d]
            k = apply_rope(head_norm(self.k_norm, qk[:, h:]), cos, sin)  # [T, kvh, d]
        else:
            qk = apply_rope(qk, cos, sin)  # [T, h + kvh, d], contiguous
            q, k = qk.split((h, kvh), dim=1)  # [T, h, d], [T, kvh, d]
        self.backend.write_kv(k, v, kv_cache, self.layer_idx, attn.slot_mapping, plan=attn.plan)
        return q


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the gated MLP.

    Gemma's "sandwich": the attention and MLP outputs are normed again before their residual
    adds (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input has
    its own norm (`pre_feedforward_layernorm`); elsewhere `post_attention_layernorm` is the
    MLP's input norm.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = norm_for(config, hidden)
        self.self_attn = Attention(config, layer_idx, backend)
        self.post_attention_layernorm = norm_for(config, hidden)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        # Which of the model's RoPE tables this layer rotates with (Gemma 3's local layers).
        self.rope_index = int(families.uses_local_rope(config, layer_idx))
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.is_gemma:
            self.pre_feedforward_layernorm = norm_for(config, hidden)
            self.post_feedforward_layernorm = norm_for(config, hidden)

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """Returns this layer's MLP output, not yet added to `h`: the next norm adds it
        (`add_and_norm`, one fused op), as `pending` here adds the previous layer's.

        h: [T, hidden], the residual stream; it is owned by the model's forward, so the
        residual adds happen in place instead of allocating a new stream twice per layer.
        """
        # `.forward` directly: these modules have no hooks, and nn.Module.__call__ cost about
        # 1 ms of a 29 ms single-stream decode step (eight calls per layer).
        norm = self.input_layernorm
        normed = norm.forward(h) if pending is None else norm.add_and_norm(h, pending)
        attended = self.self_attn.forward(normed, cos, sin, kv_cache, attn)
        pre_ff, post_ff = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre_ff is not None and post_ff is not None:  # Gemma's sandwich
            h.add_(self.post_attention_layernorm.forward(attended))
            return post_ff.forward(self.mlp.forward(pre_ff.forward(h)))
        return self.mlp.forward(self.post_attention_layernorm.add_and_norm(h, attended))


class CausalLM(nn.Module):
    """A causal LM of any supported family over a paged KV cache.

    `forward` returns the final-normed hidden states of every token; the runner picks the rows
    it samples from and calls `compute_logits` on those only (the vocab matmul is the largest
    one of a decode step). Use it under `torch.inference_mode()`.

    Parameter names are HF's without the `model.` prefix, except the fused
    `self_attn.qkv_proj` and `mlp.gate_up_proj`; with tied embeddings there is no `lm_head`.
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int | None = None,
    ) -> None:
        """Args:
        config: the decoder's shape.
        backend: the kernel ops every attention layer calls.
        max_positions: size of the RoPE table (the longest context served);
            `config.max_position_embeddings` when None.
        """
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers)
        )
        self.norm = norm_for(config, config.hidden_size)
        self.embed_scale = families.embedding_scale(config)
        self.final_soft_cap = config.final_logit_softcapping
        self.lm_head: Linear | None = None
        # Set by prepack() for tied embeddings: the vocab projection's packed copy, for
        # kvrelay's blocked kernel or else for oneDNN.
        self.blocked_logits: Blocked | None = None
        self.packed_logits: PackedLinear | None = None
        # Set by the GGUF loader (fp32 or int8 activations, tied embeddings): the
        # embedding's own blocks, for steps of fewer rows than `quantized_logits_below_rows`.
        self.quantized_logits: nn.Module | None = None
        self.quantized_logits_below_rows = QUANTIZED_LOGITS_BELOW_ROWS
        # Set by prepack() where it can serve: all-decode CPU steps' layers in one C++ call.
        self.decoder_stack: DecoderStack | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            positions,
            config.max_position_embeddings,
        )
        # Gemma 3's sliding-window layers rotate with their own base, unscaled.
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.local_rope_theta, None, positions
            )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The block-major cache this model reads and writes (docs/architecture.md section 3)."""
        c = self.config
        return (num_blocks, c.num_hidden_layers, 2, block_size, c.num_key_value_heads, c.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """Run one step's tokens through the decoder, writing their K/V into `kv_cache`.

        Args:
            input_ids: `[T]` int64 token ids, the batch's query chunks back to back.
            positions: `[T]` int64 position of each token in its sequence.
            kv_cache: `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`.
            attn: where the tokens go in the cache and what each attends to.

        Returns:
            `[T, hidden]` hidden states after the final norm.

        Raises:
            ValueError: a position is beyond the RoPE table (raise `max_positions`).
        """
        # Checked on CPU inputs only: on an accelerator `int(positions.max())` would be a host
        # sync in every step. The engine's positions are bounded by max_model_len, which the
        # loader sizes the RoPE table for, so this guards direct callers, not the engine.
        if (
            positions.device.type == "cpu"
            and positions.numel()
            and int(positions.max()) >= self.rotary.max_positions
        ):
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's RoPE table of "
                f"{self.rotary.max_positions} positions; cap max_model_len or load the model "
                "with a larger max_positions"
            )
        h = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor owned by this call
        if self.embed_scale is not None:
            h.mul_(rounded_to(self.embed_scale, h.dtype))
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # shared by every layer
        stack = self.decoder_stack
        if stack is not None and stack.takes(h, kv_cache, attn):
            return self.norm(stack.forward(h, cos, sin, kv_cache, attn))
        tables: list[tuple[torch.Tensor, ...]] = [(cos, sin)]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.cos_sin(positions, h.dtype))
        pending = None  # each layer's MLP output, added to `h` by the next norm
        for layer in cast("list[DecoderLayer]", self.layers):
            cos, sin = tables[layer.rope_index]
            pending = layer.forward(h, pending, cos, sin, kv_cache, attn)
        return self.norm(h) if pending is None else self.norm.add_and_norm(h, pending)

    def prepack(self) -> None:
        """Pack a copy of every matmul weight for the fastest CPU path (`Linear.prepack`; a
        no-op elsewhere): kvrelay's blocked kernel where it builds, all of them packed into
        one huge-page allocation in the order a step reads them; oneDNN's layout else.

        For inference only. Dense weights stay; with tied embeddings the vocab projection
        gets its own packed copy. Where oneDNN's copies serve, single-row steps take whichever
        path is faster on this CPU (`single_row.choose_single_row_paths`). Where every matmul
        takes the blocked kernel, all-decode steps run the layers in C++ (`decoder_stack`).
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        # Tied, and not every row on the embedding's blocks (int8 activations).
        dense_logits = self.lm_head is None and self.quantized_logits_below_rows != ALL_ROWS
        logits_weight = [self.embed_tokens.weight] if dense_logits else []
        all_blocks = pack_blocks_together([m.weight for m in linears] + logits_weight)
        packed: list[tuple[torch.Tensor, torch.Tensor | None, PackedLinear]] = []
        for module, module_blocks in zip(linears, all_blocks[: len(linears)], strict=True):
            module.prepack(module_blocks)
            if module.packed is not None:
                packed.append((module.weight, module.bias, module.packed))
        if dense_logits:
            weight = self.embed_tokens.weight
            self.blocked_logits = blocked_of(weight, None, all_blocks[-1])
            if self.blocked_logits is None and can_prepack(weight):
                self.packed_logits = PackedLinear(weight, None)
                packed.append((weight, None, self.packed_logits))
        choose_single_row_paths(packed)
        self.decoder_stack = build_decoder_stack(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, hidden]` -> `[S, vocab]` fp32 logits, soft-capped where the config says
        (Gemma's `final_logit_softcapping`: `c * tanh(logits / c)`)."""
        logits = self._logits(hidden)
        cap = self.final_soft_cap
        if cap is not None:
            logits = logits.div(cap).tanh_().mul_(cap)
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        quantized = self.quantized_logits
        if quantized is not None and hidden.shape[0] < self.quantized_logits_below_rows:
            return cast(torch.Tensor, quantized(hidden.float()))  # fp32 in, fp32 logits
        blocked = run_blocked(self.blocked_logits, hidden)
        if blocked is not None:
            return blocked.float()
        packed = self.packed_logits
        if packed is not None and (hidden.shape[0] > 1 or packed.single_row):
            return packed.forward(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        weight = self.embed_tokens.weight
        return linear(hidden, weight).float()
