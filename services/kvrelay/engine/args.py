"""Engine arguments as users pass them (`LLM(**kwargs)`, CLI flags), turned into an Engine.

One table of fields drives both the keyword arguments and the CLI flags with their help.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

if TYPE_CHECKING:  # torch is imported when an engine is configured, not for the CLI's flags
    from kvrelay.engine.engine import Engine

_CPU_KV_MEMORY = "512MiB"  # the KV budget when no size is given and no GPU sizes it
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_bytes(value: int | str) -> int:
    """`536870912`, `"512MiB"`, `"1.5GB"`, `"2G"` -> bytes (KiB/MiB/GiB are powers of 1024)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"cannot read {value!r} as a size: use e.g. 536870912, 512MiB or 2GB")
    number, unit = float(match.group(1)), (match.group(2) or "").lower().rstrip("b")
    if not unit:
        return int(number)
    power = "kmgt".index(unit[0]) + 1
    base = 1024 if unit.endswith("i") else 1000
    return int(number * base**power)


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names where vLLM has one."""

    model: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    # None: on CUDA, sized by gpu_memory_utilization after a profiling step; elsewhere 512MiB.
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and bf16-native CPUs, else float32
    quantization: str = "none"  # "q4_1" | "q8_0" | "auto": the folder GGUF's weights kept low-bit
    int8_activations: bool = False  # quantized layers: few-row inputs as int8 (not exact)
    device: str = "auto"  # "auto": cuda when torch sees a GPU, else cpu
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    role: str = "both"  # "both" | "prefill" | "decode" (disaggregated serving)
    kv_lease_seconds: float = 30.0  # prefill role: how long a handed-off KV waits for a pull
    kv_transfer_failure: str = "recompute"  # decode role: "recompute" | "fail" an unusable KV

    def resolve_model_path(self) -> Path:
        """The model folder; no model named means the embedded default (pulled once)."""
        if self.model is None:
            from kvrelay.models.default_model import pull_default_model

            return pull_default_model(progress=True)
        path = Path(self.model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {self.model!r} not found: pass a local Hugging Face folder "
                "(config.json, *.safetensors, tokenizer files), or no model for the default "
                "one; kvrelay never downloads from a model hub"
            )
        return path

    def create_engine_config(self, model_path: Path) -> EngineConfig:
        model_config = ModelConfig.from_pretrained(model_path)
        max_len = self.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} is longer than the model's "
                f"{model_config.max_position_embeddings} positions"
            )
        from kvrelay.engine.device import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        return EngineConfig(
            model=str(model_path),
            model_config=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                kv_cache_memory=parse_bytes(self.kv_cache_memory or _CPU_KV_MEMORY),
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            max_model_len=max_len,
            dtype=resolve_dtype(self.dtype, device),
            device=device,
            seed=self.seed,
            num_threads=self.num_threads,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            role=self.role,
            kv_lease_seconds=self.kv_lease_seconds,
            kv_transfer_failure=self.kv_transfer_failure,
        )

    def create_engine(self, *, with_tokenizer: bool = True) -> Engine:
        """Load the model (and, with `with_tokenizer`, its tokenizer) and build the engine.

        A worker builds its engine without a tokenizer: it sends token ids only and the router
        detokenizes. The offline `LLM` detokenizes in the engine. Without tokenizer files in
        the folder the engine runs on token ids alone, as the tests' tiny random models do.
        """
        from kvrelay_kernels import jit_watch

        path = self.resolve_model_path()
        config = self.create_engine_config(path)
        if config.device.startswith("cuda"):
            jit_watch.install()
        # Loading, packing and the memory profile launch kernels too: all before ready.
        with jit_watch.warming_up():
            return self._build_engine(path, config, with_tokenizer)

    def _build_engine(self, path: Path, config: EngineConfig, with_tokenizer: bool) -> Engine:
        import torch

        from kvrelay.engine.engine import Engine
        from kvrelay.models.loader import load_model
        from kvrelay.models.tokenizer import has_tokenizer, load_tokenizer
        from kvrelay_kernels import select_backend
        from kvrelay_kernels.cpu_fused import prepare_fused_ops

        backend = select_backend(config.attention_backend)
        model, _ = load_model(
            path,
            backend,
            dtype=getattr(torch, config.dtype),
            max_positions=config.max_model_len,
            device=config.device,
            quantization=self.quantization,
            int8_activations=self.int8_activations,
        )
        model.prepack()
        prepare_fused_ops(config.device)
        if self.sizes_kv_by_utilization(config.device):
            from kvrelay.engine.memory_profile import size_kv_cache_for_gpu

            config = size_kv_cache_for_gpu(config, model, self.gpu_memory_utilization)
        tokenizer = load_tokenizer(path) if with_tokenizer and has_tokenizer(path) else None
        return Engine(config, model, tokenizer)

    def sizes_kv_by_utilization(self, device: str) -> bool:
        """Whether the KV cache is sized from free GPU memory: on CUDA, when no size is given."""
        return (
            device.startswith("cuda") and self.num_blocks is None and self.kv_cache_memory is None
        )

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(model=model, **kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field, with help, to `parser`."""
        group = parser.add_argument_group("engine")
        add = group.add_argument
        add("--model", default=None, help=_HELP["model"])
        add("--block-size", type=int, default=16, help=_HELP["block_size"])
        add("--num-blocks", type=int, default=None, help=_HELP["num_blocks"])
        add("--kv-cache-memory", default=None, help=_HELP["kv_cache_memory"])
        add(
            "--gpu-memory-utilization",
            type=float,
            default=0.9,
            help=_HELP["gpu_memory_utilization"],
        )
        add(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            help=_HELP["enable_prefix_caching"],
        )
        add("--max-num-batched-tokens", type=int, default=512, help=_HELP["max_num_batched_tokens"])
        add("--max-num-seqs", type=int, default=128, help=_HELP["max_num_seqs"])
        add(
            "--long-prefill-token-threshold",
            type=int,
            default=0,
            help=_HELP["long_prefill_token_threshold"],
        )
        add("--max-model-len", type=int, default=None, help=_HELP["max_model_len"])
        add(
            "--dtype",
            choices=["auto", "float32", "bfloat16", "float16"],
            default="auto",
            help=_HELP["dtype"],
        )
        add(
            "--quantization",
            choices=["none", "auto", "q4_1", "q8_0"],
            default="none",
            help=_HELP["quantization"],
        )
        add("--int8-activations", action="store_true", help=_HELP["int8_activations"])
        add("--device", default="auto", help=_HELP["device"])
        add("--seed", type=int, default=0, help=_HELP["seed"])
        add("--num-threads", type=int, default=None, help=_HELP["num_threads"])
        add("--attention-backend", default="auto", help=_HELP["attention_backend"])
        add("--enforce-eager", action="store_true", help=_HELP["enforce_eager"])

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


_HELP = {
    "model": "model folder in Hugging Face layout (config.json, *.safetensors, tokenizer); "
    "default: the embedded SmolLM2-135M-Instruct, converted once into ~/.cache/kvrelay",
    "block_size": "tokens per KV block (power of two, default 16)",
    "num_blocks": "KV cache size in blocks; overrides --kv-cache-memory",
    "kv_cache_memory": "KV cache budget in bytes, e.g. 512MiB or 2GB (default: on CUDA, what "
    "--gpu-memory-utilization leaves; 512MiB elsewhere)",
    "gpu_memory_utilization": "CUDA: the fraction of the GPU's memory this engine may use, "
    "weights, activations and KV cache together (default 0.9); the KV cache gets what is left "
    "after the weights and a profiled step of --max-num-batched-tokens, unless --num-blocks or "
    "--kv-cache-memory is given",
    "enforce_eager": "CUDA: run every step eagerly, no CUDA graphs (by default decode steps "
    "replay graphs captured at batch sizes 1, 2, 4, 8, ... up to --max-num-seqs)",
    "enable_prefix_caching": "turn prefix caching off",
    "max_num_batched_tokens": "token budget of one engine step, decode tokens and prefill "
    "chunks together (default 512); longer prompts are prefilled in chunks",
    "max_num_seqs": "most sequences running at once (default 128)",
    "long_prefill_token_threshold": "cap on one prompt's chunk per step, 0 for none (default 0)",
    "max_model_len": "longest sequence, prompt plus output (default: the model's)",
    "dtype": "weights and KV cache dtype: auto (default: bfloat16 on CUDA and on CPUs that "
    "compute bf16 natively, AVX512-BF16, AMX or Arm BF16; float32 on other CPUs), float32, "
    "bfloat16 or float16. Prefill and decode pools must agree: pin it where their CPUs differ",
    "quantization": "weights kept quantized (CPU), read from the model folder's GGUF: q4_1 "
    "runs its Q4_1 matmuls as int4 (the default model keeps its Q4_1 source there), q8_0 its "
    "Q8_0 matmuls as two int4 planes (exact, 8 bits a weight); both fastest with --dtype "
    "bfloat16 (the activations' dtype); auto does either when the folder holds a GGUF with "
    "such matmul weights; none (default) loads the safetensors weights",
    "int8_activations": "with --quantization: decode steps (fewer than 32 rows) quantize each "
    "quantized layer's input to int8 per 32 values, as llama.cpp does, and multiply with "
    "integer dot products (AVX512-VNNI, AVX2): 2-4x faster matmuls at one row, NOT exact "
    "(greedy text may differ from the fp32 model's, as with bf16 activations)",
    "device": "where weights, KV cache and step tensors live: auto (default: cuda when torch "
    "sees a GPU, else cpu), cpu, cuda, cuda:N, or meta (tests: shapes only, no data)",
    "seed": "seed of the sampler for requests without their own seed (default 0)",
    "num_threads": "torch CPU threads (default: torch's choice)",
    "attention_backend": (
        "attention kernels: auto (the fastest this machine runs: cuda, triton, then torch on a "
        "GPU; cpu, then torch without one), cuda, triton, cpu or torch"
    ),
}
