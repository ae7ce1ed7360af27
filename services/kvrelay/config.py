"""Frozen configuration dataclasses shared by every layer of kvrelay.

Plain values only: no torch tensors, no I/O beyond reading a model's config.json.
Invalid values raise ValueError with the field name and the allowed range.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The MLP activations kvrelay implements (HF's names).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# What each family's HF config class assumes where config.json leaves a field out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": {"head_dim": 128},
    "Gemma2ForCausalLM": {
        "head_dim": 256,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma3ForCausalLM": {
        "head_dim": 256,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one kvrelay can run."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from a Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation, one of SUPPORTED_ACTIVATIONS
    # Each layer's sliding window in tokens (a query at p sees keys p - W < j <= p), None for
    # full attention; empty when no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 3: the RoPE base of the sliding-window layers (unscaled); None: one RoPE for all.
    local_rope_theta: float | None = None
    # Gemma: attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # c * tanh(score / c) on the scaled scores
    final_logit_softcapping: float | None = None  # the same on the logits

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; kvrelay runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_attention_heads must be a multiple of num_key_value_heads "
            f"(got {self.num_attention_heads} and {self.num_key_value_heads})",
        )
        _require(
            self.hidden_act in SUPPORTED_ACTIVATIONS,
            f"hidden_act {self.hidden_act!r} is not implemented; kvrelay runs "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}",
        )
        _require(
            len(self.layer_windows) in (0, self.num_hidden_layers),
            f"layer_windows has {len(self.layer_windows)} entries for "
            f"{self.num_hidden_layers} layers",
        )
        _require(
            all(w is None or w >= 1 for w in self.layer_windows),
            f"sliding_window must be >= 1, got {self.layer_windows}",
        )
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be > 0 or null, got {value}")

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the parsed `config.json` of a Hugging Face checkpoint.

        Raises:
            UnsupportedModelError: an architecture kvrelay does not run.
            ValueError: a field asks for something kvrelay does not implement (named).
        """
        archs = hf.get("architectures") or [hf.get("model_type", "unknown")]
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; kvrelay runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hf = {**_FAMILY_DEFAULTS.get(arch, {}), **hf}
        _refuse_unimplemented(hf, arch)
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        layers = int(hf["num_hidden_layers"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        rope_theta, rope_scaling, local_theta = _rope_settings(hf, arch)
        gemma = arch in GEMMA_ARCHITECTURES
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(hf, arch),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=str(hf.get("hidden_activation" if gemma else "hidden_act") or "silu"),
            layer_windows=_layer_windows(hf, arch, layers),
            local_rope_theta=local_theta,
            query_pre_attn_scalar=_gemma_float(hf, arch, "query_pre_attn_scalar"),
            attn_logit_softcapping=_gemma_float(hf, arch, "attn_logit_softcapping"),
            final_logit_softcapping=_gemma_float(hf, arch, "final_logit_softcapping"),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: a model folder needs config.json, *.safetensors and "
                "tokenizer files (run `kvrelay model pull-default` for the default model)"
            )
        return cls.from_hf_config(json.loads(path.read_text()))


def _attention_bias(hf: dict[str, Any], arch: str) -> bool:
    """Qwen2 always has q/k/v bias; Mistral and Phi-3 never (their HF classes have no
    field); Llama, Qwen3 and Gemma when `attention_bias` says so."""
    if arch == "Qwen2ForCausalLM":
        return True
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return False
    return bool(hf.get("attention_bias", False))


def _refuse_unimplemented(hf: dict[str, Any], arch: str) -> None:
    """One clear line for each config.json field that asks for what kvrelay does not run."""
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not implemented (no MLP biases)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "config.json: use_bidirectional_attention=true (an embedding model) is not "
            "implemented; kvrelay runs causal decoders"
        )
    if hf.get("attention_chunk_size"):
        raise ValueError("config.json: attention_chunk_size (chunked attention) is not implemented")
    if arch == "Gemma3ForCausalLM" and hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 keeps the field but never applies it: running it either way
        # would disagree with someone, so such a config is refused.
        raise ValueError(
            "config.json: attn_logit_softcapping is set on a Gemma 3 model, whose reference "
            "implementation (transformers) ignores it; set it to null"
        )
    act_field = "hidden_activation" if arch in GEMMA_ARCHITECTURES else "hidden_act"
    act = hf.get(act_field) or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"config.json: {act_field}={act!r} is not implemented; kvrelay runs "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )


def _rope_settings(
    hf: dict[str, Any], arch: str
) -> tuple[float, dict[str, Any] | None, float | None]:
    """`(rope_theta, rope_scaling, local_rope_theta)` from either config.json layout:
    transformers 4's `rope_theta` / `rope_scaling` (/ Gemma 3's `rope_local_base_freq`), or
    transformers 5's `rope_parameters` (nested by layer type for Gemma 3)."""
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    local = hf.get("rope_local_base_freq") if arch == "Gemma3ForCausalLM" else None
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        local_params = params.get("sliding_attention") or {}
        if local_params.get("rope_type", "default") != "default":
            raise ValueError(
                "config.json: rope_parameters.sliding_attention.rope_type="
                f"{local_params['rope_type']!r} is not implemented (local layers run unscaled)"
            )
        local = local_params.get("rope_theta", local)
        params = params.get("full_attention") or {}
    factors = [d.get("partial_rotary_factor") for d in (hf, params, scaling) if isinstance(d, dict)]
    if any(f is not None and float(f) != 1.0 for f in factors):
        raise ValueError(
            "config.json: partial_rotary_factor != 1 (RoPE on part of each head) is not implemented"
        )
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if not scaling:
        return float(theta if theta is not None else 10000.0), None, _float_or_none(local)
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's older names for it, as transformers reads them
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers' rule: a top-level original_max_position_embeddings (Phi-3) wins, else
        # the scaling's own, else max_position_embeddings.
        if "original_max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        scaling.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
        )
    return float(theta if theta is not None else 10000.0), scaling, _float_or_none(local)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma_float(hf: dict[str, Any], arch: str, name: str) -> float | None:
    """A Gemma-only field; None for the other families, whose HF classes never read it."""
    return _float_or_none(hf.get(name)) if arch in GEMMA_ARCHITECTURES else None


def _layer_windows(hf: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers assigns them:
    `layer_types` when config.json lists them, else each family's rule."""
    window = hf.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window"):
        window = None  # Qwen's configs carry a window that only use_sliding_window turns on
    if arch == "LlamaForCausalLM":
        window = None  # not a Llama field: transformers' Llama never reads it
    types = hf.get("layer_types") or _default_layer_types(hf, arch, layers, window)
    if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"config.json: layer_types must list full_attention or sliding_attention for each "
            f"of the {layers} layers (kvrelay implements no other attention), got {types}"
        )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _default_layer_types(
    hf: dict[str, Any], arch: str, layers: int, window: int | None
) -> list[str]:
    """transformers' per-family default when config.json has no `layer_types`."""
    if window is None:
        return ["full_attention"] * layers
    if arch == "Gemma2ForCausalLM":
        sliding = [(i + 1) % 2 != 0 for i in range(layers)]
    elif arch == "Gemma3ForCausalLM":
        pattern = int(hf.get("sliding_window_pattern", 6))
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(hf.get("max_window_layers", 28))
        sliding = [i >= first for i in range(layers)]
    else:  # Mistral, Phi-3: every layer
        sliding = [True] * layers
    return ["sliding_attention" if s else "full_attention" for s in sliding]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and budget (in blocks, or in bytes)."""

    block_size: int = 16
    # Exactly one budget applies: num_blocks if set, else kv_cache_memory bytes.
    num_blocks: int | None = None
    kv_cache_memory: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two in [1, 128], got {self.block_size}",
        )
        if self.num_blocks is not None:
            _require(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        _require(
            self.kv_cache_memory > 0, f"kv_cache_memory must be > 0, got {self.kv_cache_memory}"
        )

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """The number of blocks the budget buys for blocks of `bytes_per_block` bytes."""
        if self.num_blocks is not None:
            return self.num_blocks
        blocks = self.kv_cache_memory // bytes_per_block
        _require(
            blocks >= 1,
            f"kv_cache_memory={self.kv_cache_memory} bytes is less than one KV block "
            f"({bytes_per_block} bytes)",
        )
        return int(blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Longest prefill chunk per request per step; 0 means up to the token budget.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; built by `EngineArgs` or the CLI."""

    model: str
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str = "auto"
    # CUDA: run every step eagerly (no CUDA graphs for decode steps).
    enforce_eager: bool = False
    # Launch step n+1 before reading step n's tokens (engine/async_step.py); None: on CUDA.
    async_scheduling: bool | None = None
    # Disaggregation: "both" runs whole requests; "prefill" stops after the first token and
    # holds the prompt's blocks under a lease for a decode engine; "decode" also accepts
    # requests whose prompt KV it pulls from a prefill engine.
    role: str = "both"
    kv_lease_seconds: float = 30.0
    # Decode role, when a prompt's KV cannot be used (failed pull, mismatched handle, no free
    # blocks): "recompute" the prompt here, or "fail" the request so the caller can retry.
    kv_transfer_failure: str = "recompute"
    engine_id: str | None = None  # a fresh id per engine when None
    # Where weights, KV cache and step tensors live: "cpu", "cuda", "cuda:N" or "meta"
    # (tests); already resolved (EngineArgs turns "auto" into one of these).
    device: str = "cpu"

    def __post_init__(self) -> None:
        _require(
            re.match(r"^(cpu|meta|cuda(:\d+)?)$", self.device) is not None,
            f"device must be cpu, cuda, cuda:N or meta, got {self.device!r}",
        )
        _require(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        _require(
            self.role in ("both", "prefill", "decode"),
            f"role must be one of both, prefill, decode, got {self.role!r}",
        )
        _require(
            self.kv_lease_seconds > 0, f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds}"
        )
        _require(
            self.kv_transfer_failure in ("recompute", "fail"),
            f"kv_transfer_failure must be one of recompute, fail, got {self.kv_transfer_failure!r}",
        )
        _require(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}",
        )


# OpenAI's own bound on n; each sample is a request of its own at the workers.
DEFAULT_MAX_N = 128


@dataclass(frozen=True)
class RouterConfig:
    """The router's options: one object from the command line (`kvrelay serve` / `router`,
    cli_serve.py) through the platform (api/platform.py) and the router (router/router.py)
    to the relay (router/relay.py), each option under the same name at every hop.
    """

    # Prompts with at most this many tokens not cached at the decode worker run whole there,
    # without a prefill worker (router/decision.py).
    max_local_prefill_tokens: int = 64
    kv_transfer_failure: str = "recompute"  # or "fail", as the workers' engines
    max_attempts: int = 3  # runs of one sample on workers that die, before it fails
    # How long a sample whose worker died waits for a decode-capable worker to resume at
    # (a pool of one: until its replacement is up). The flag is --migration-timeout.
    migration_wait_s: float = 60.0
    max_in_flight: int = 256  # sequences running at once (a request counts as its n)
    max_queued: int = 512  # sequences waiting beyond max_in_flight; more are refused
    max_n: int = DEFAULT_MAX_N  # most samples one request may ask for
    routing_policy: str = "score"  # or "round_robin" (router/policy.py)
    served_model_name: str | None = None  # the model id clients use (default: folder name)
