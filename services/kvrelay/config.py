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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the parsed `config.json` of a Hugging Face checkpoint."""
        archs = hf.get("architectures") or [hf.get("model_type", "unknown")]
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; kvrelay runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers 5 folds rope settings into `rope_parameters`.
        params = hf.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama only when `attention_bias` says so.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
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
    max_in_flight: int = 256  # requests running at once
    max_queued: int = 512  # requests waiting beyond max_in_flight; more are refused
    max_n: int = DEFAULT_MAX_N  # most samples one request may ask for
    routing_policy: str = "score"  # or "round_robin" (router/policy.py)
    served_model_name: str | None = None  # the model id clients use (default: folder name)
