"""Engine arguments as users pass them (`LLM(**kwargs)`, CLI flags), turned into an Engine.

One table of fields drives both the keyword arguments and the CLI flags with their help, and
one table of checks validates every value when the arguments are made (`LLM(**kwargs)`) or the
flags parsed, before anything loads. What `--model` names is resolved in kvrelay.common.model_ref.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.common.model_ref import ResolvedModel, resolve_model_ref
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


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "auto", "q4_1", "q8_0")  # models/quantized_loading.py's
# kvrelay_kernels' backends (importing them imports torch; tests/test_cli_flags.py compares).
ATTENTION_BACKENDS = ("auto", "cuda", "triton", "cpu", "torch")
ROLES = ("both", "prefill", "decode")
KV_TRANSFER_FAILURES = ("recompute", "fail")
_DEVICE = re.compile(r"^(auto|cpu|meta|cuda(:\d+)?)$")


def _int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """`value` if it is an int (in [low, high], where given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if low is not None and (value < low or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """A number > `low` (and <= `high`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if value <= low or (high is not None and value > high):
        bound = f"> {low:g}" if high is None else f"in ({low:g}, {high:g}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _size(value: int | str) -> int:
    try:
        return parse_bytes(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"kv_cache_memory must be a size such as 536870912, 512MiB or 2GB, got {value!r}"
        ) from None


def _device(value: Any) -> None:
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or meta, got {value!r}")


def _model(value: Any) -> None:
    if value is not None and not isinstance(value, str | Path):
        raise ValueError(f"model must be a folder, an ORG/NAME id or None, got {value!r}")


# One check per EngineArgs field; each raises ValueError naming the field. The block and
# scheduler limits are the config dataclasses' own rules (kvrelay/config.py), not copies.
FIELD_CHECKS: dict[str, Callable[[Any], object]] = {
    "model": _model,
    "block_size": lambda v: CacheConfig(block_size=_int("block_size", v)),
    "num_blocks": lambda v: v is None or CacheConfig(num_blocks=_int("num_blocks", v)),
    "kv_cache_memory": lambda v: v is None or CacheConfig(kv_cache_memory=_size(v)),
    "gpu_memory_utilization": lambda v: _number("gpu_memory_utilization", v, 0, 1),
    "enable_prefix_caching": lambda v: _bool("enable_prefix_caching", v),
    "max_num_batched_tokens": lambda v: SchedulerConfig(
        max_num_batched_tokens=_int("max_num_batched_tokens", v)
    ),
    "max_num_seqs": lambda v: SchedulerConfig(max_num_seqs=_int("max_num_seqs", v)),
    "long_prefill_token_threshold": lambda v: SchedulerConfig(
        long_prefill_token_threshold=_int("long_prefill_token_threshold", v)
    ),
    "max_model_len": lambda v: v is None or _int("max_model_len", v, 1),
    "dtype": lambda v: _choice("dtype", v, DTYPES),
    "quantization": lambda v: _choice("quantization", v, QUANTIZATIONS),
    "int8_activations": lambda v: _bool("int8_activations", v),
    "device": _device,
    "seed": lambda v: _int("seed", v, 0, 2**64 - 1),
    "num_threads": lambda v: v is None or _int("num_threads", v, 1),
    "attention_backend": lambda v: _choice("attention_backend", v, ATTENTION_BACKENDS),
    "enforce_eager": lambda v: _bool("enforce_eager", v),
    "async_scheduling": lambda v: None if v is None else _bool("async_scheduling", v),
    "role": lambda v: _choice("role", v, ROLES),
    "kv_lease_seconds": lambda v: _number("kv_lease_seconds", v, 0),
    "kv_transfer_failure": lambda v: _choice("kv_transfer_failure", v, KV_TRANSFER_FAILURES),
}


def check_combination(args: EngineArgs) -> None:
    """The rules between fields (each field's own are FIELD_CHECKS)."""
    if args.int8_activations and args.quantization == "none":
        raise ValueError(
            "int8_activations multiplies GGUF-quantized weights only: add quantization q4_1, "
            "q8_0 or auto (--quantization; the default model keeps its Q4_1 GGUF), or drop it"
        )
    if args.async_scheduling and args.role == "prefill":
        raise ValueError(
            "async_scheduling cannot run on a prefill engine (it hands each request off at "
            "its first token, read at once): drop --async-scheduling or use --role both"
        )


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
    async_scheduling: bool | None = None  # None: on for CUDA, off on the CPU
    role: str = "both"  # "both" | "prefill" | "decode" (disaggregated serving)
    kv_lease_seconds: float = 30.0  # prefill role: how long a handed-off KV waits for a pull
    kv_transfer_failure: str = "recompute"  # decode role: "recompute" | "fail" an unusable KV

    def __post_init__(self) -> None:
        """Every value checked now, before anything loads.

        Raises:
            ValueError: a value out of its range or choices, naming the field.
        """
        for f in fields(self):
            FIELD_CHECKS[f.name](getattr(self, f.name))
        check_combination(self)

    def resolve_model(self) -> ResolvedModel:
        """The model folder (a local one, or a Hugging Face id's snapshot from the Hub cache,
        downloaded when absent and not offline); no model named means the embedded default
        (pulled once).

        Raises:
            FileNotFoundError: see kvrelay.common.model_ref.resolve_model_ref.
        """
        if self.model is None:
            from kvrelay.models.default_model import pull_default_model

            return ResolvedModel(pull_default_model(progress=True))
        return resolve_model_ref(str(self.model), self.quantization)

    def resolve_model_path(self) -> Path:
        """The model folder, as `resolve_model`."""
        return self.resolve_model().path

    def with_resolved_model(self) -> EngineArgs:
        """These args with the model resolved now (a Hub id fetched into the Hub cache) and
        max_model_len checked against its config.json: what the commands do before Ray, a
        server or a model load starts. A Hub id is pinned to its snapshot's commit, so every
        process these args go to (router, prefill and decode workers) loads the same files.

        Raises:
            FileNotFoundError: the model cannot be had; ValueError: max_model_len too long.
        """
        resolved = self.resolve_model()
        self.check_against_model(resolved.path)
        return replace(self, model=resolved.pinned) if resolved.hub_id else self

    def check_against_model(self, path: Path) -> ModelConfig:
        """The folder's model config, after checking max_model_len against it (reads
        config.json only: the CLI calls it before Ray or a model load)."""
        model_config = ModelConfig.from_pretrained(path)
        max_len = self.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} is longer than the model's "
                f"{model_config.max_position_embeddings} positions"
            )
        return model_config

    def create_engine_config(self, model_path: Path) -> EngineConfig:
        model_config = self.check_against_model(model_path)
        max_len = self.max_model_len or model_config.max_position_embeddings
        from kvrelay.engine.device import resolve_device, resolve_dtype

        device = resolve_device(self.device)
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
            async_scheduling=self.async_scheduling,
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
        """Add one flag per field, with help, to `parser`; each value is checked as it is
        parsed (FIELD_CHECKS), so a bad one is argparse's one-line error naming the flag."""
        group = parser.add_argument_group("engine")
        add = group.add_argument
        add("--model", type=model_flag, default=None, help=_HELP["model"])
        for name, convert, default in _NUMBER_FLAGS:
            add(_flag(name), type=flag_type(name, convert), default=default, help=_HELP[name])
        add(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_false",
            help=_HELP["enable_prefix_caching"],
        )
        add(
            "--kv-cache-memory",
            type=flag_type("kv_cache_memory", str),
            help=_HELP["kv_cache_memory"],
        )
        add("--dtype", choices=DTYPES, default="auto", help=_HELP["dtype"])
        add("--quantization", choices=QUANTIZATIONS, default="none", help=_HELP["quantization"])
        add("--int8-activations", action="store_true", help=_HELP["int8_activations"])
        add("--device", type=flag_type("device", str), default="auto", help=_HELP["device"])
        add(
            "--attention-backend",
            choices=ATTENTION_BACKENDS,
            default="auto",
            help=_HELP["attention_backend"],
        )
        add("--enforce-eager", action="store_true", help=_HELP["enforce_eager"])
        add(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_HELP["async_scheduling"],
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


# The numeric engine flags: field, how the text converts, default.
_NUMBER_FLAGS: tuple[tuple[str, Callable[[str], Any], Any], ...] = (
    ("block_size", int, 16),
    ("num_blocks", int, None),
    ("gpu_memory_utilization", float, 0.9),
    ("max_num_batched_tokens", int, 512),
    ("max_num_seqs", int, 128),
    ("long_prefill_token_threshold", int, 0),
    ("max_model_len", int, None),
    ("seed", int, 0),
    ("num_threads", int, None),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Each EngineArgs field's flag, for errors about a field to name the flag the user typed.
ENGINE_FLAG_NAMES = {
    f.name: "--no-prefix-caching" if f.name == "enable_prefix_caching" else _flag(f.name)
    for f in fields(EngineArgs)
}


def flag_type(name: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type=` for field `name`: the text converted (argparse's own "invalid int
    value" when it does not), then FIELD_CHECKS[name], whose message argparse prints after
    the flag (`argument --block-size: must be a power of two in [1, 128], got 3`)."""

    def parse(text: str) -> Any:
        value = convert(text)
        try:
            FIELD_CHECKS[name](value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None
        return value

    parse.__name__ = getattr(convert, "__name__", name)  # argparse names it in its errors
    return parse


def model_flag(text: str) -> str:
    """`--model`: a folder with a config.json, or the form of a Hub id (fetched later, by
    the command, before anything starts); never the network here."""
    from kvrelay.common.model_ref import check_folder, parse_model_ref

    try:
        ref = parse_model_ref(text)
        if isinstance(ref, Path):
            check_folder(ref)
    except FileNotFoundError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


_HELP = {
    "model": "a model folder in Hugging Face layout (config.json, *.safetensors, tokenizer), "
    "or a Hugging Face id ORG/NAME[@REVISION] taken from the Hugging Face cache (HF_HOME, "
    "HF_HUB_CACHE) or downloaded into it (HF_TOKEN for gated models; HF_HUB_OFFLINE=1: the "
    "cache only); a path that exists wins over an id. Default: the embedded "
    "SmolLM2-135M-Instruct, converted once into ~/.cache/kvrelay",
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
    "async_scheduling": "launch each step before reading the last one's sampled tokens, so "
    "the host's work overlaps the GPU's (vLLM's --async-scheduling; default: on for CUDA, off "
    "on the CPU, where torch computes on the calling thread; not with --role prefill). Steps "
    "of requests with penalties, logprobs, prompt logprobs or a grammar run synchronously",
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
