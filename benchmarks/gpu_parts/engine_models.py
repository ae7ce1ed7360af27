"""Random-weight models for the engine checks, built on the spot from a LlamaConfig (no cached
weights needed), their transformers reference, kvrelay engines over them, and the kernel
counters read defensively (they are newer than this script may be).

The weights are drawn with a std of INIT_GAIN / sqrt(hidden_size), not transformers' default
0.02: at 0.02 the 135M shape's greedy output collapses to one or two repeated tokens, and at
0.1 the network is so chaotic that fp32 rounding moves the logits by ~2e-4 (their top-two gap
being ~0.45), so exact greedy comparisons would part at rounding ties. At 0.04 (the 135M
shape) the output is varied and, over 1,200 positions, the smallest top-two logit gap was 29x
the fp32-vs-fp64 logit error (median gap 0.16, error 1e-5): argmax is decided by the model,
not by rounding. A gain, so the 1B shape (hidden 2048) gets the same per-layer scale."""

from __future__ import annotations

import gc
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gpu_parts.report import Context

# The embedded default, SmolLM2-135M-Instruct (docs/architecture.md section 4), and a ~1B Llama
# with head_dim 128 (16 query / 8 KV heads of 128, GQA 2). Tiny stand-ins for the CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-1b-hd128": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
SMALL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=512,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "llama-1b-hd128": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
}


INIT_GAIN = 0.96  # weight std x sqrt(hidden_size): 0.04 at the 135M shape (docstring)


def init_std(hidden_size: int) -> float:
    return INIT_GAIN / hidden_size**0.5


def dtype_of(ctx: Context) -> torch.dtype:
    return torch.bfloat16 if ctx.cuda else torch.float32


def model_key(ctx: Context, name: str, dtype: torch.dtype | None, layers: int | None) -> str:
    """ctx.shared's key of a built model: `model:NAME` for the default dtype and depth (what
    part 4 reuses), suffixed otherwise."""
    default = (dtype is None or dtype == dtype_of(ctx)) and layers is None
    return f"model:{name}" if default else f"model:{name}:{dtype}:{layers}"


def build_model(
    ctx: Context, name: str, *, dtype: torch.dtype | None = None, layers: int | None = None
) -> tuple[Path, Any]:
    """A random-weight Llama of shape `name` (`layers` deep if given; in `dtype`, the run's
    default if not) saved as safetensors under ctx.work_dir, and the transformers model
    holding the very same weights, on the device, in eval mode. Reused when asked again
    (ctx.shared)."""
    key = model_key(ctx, name, dtype, layers)
    if key in ctx.shared:
        return ctx.shared[key]
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict((SMALL_SHAPES if ctx.small else SHAPES)[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(
        **shape,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=init_std(shape["hidden_size"]),
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(ctx.device):  # random init on the GPU: seconds, not a minute on the CPU
        model: Any = LlamaForCausalLM(config)  # Any: transformers' typing of `.to` is off
    model.to(dtype or dtype_of(ctx)).eval().requires_grad_(False)
    folder = ctx.work_dir / key.removeprefix("model:").replace(":", "-").replace(".", "_")
    model.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    ctx.log(
        f"{folder.name}: {params:.0f} M parameters, {shape['num_hidden_layers']} layers, "
        f"built in {time.perf_counter() - start:.1f} s"
    )
    ctx.shared[key] = (folder, model)
    return folder, model


def eos_ids(model: Any) -> set[int]:
    """The EOS ids transformers' generate stops at (the generation config's, else the model
    config's): the ones kvrelay reads from the same folder."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = model.config.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ([ids] if isinstance(ids, int) else ids)}


def engine_args_fields() -> set[str]:
    from kvrelay.engine.args import EngineArgs

    return {f.name for f in fields(EngineArgs)}


def make_engine(
    ctx: Context,
    folder: Path,
    *,
    eager: bool,
    max_num_seqs: int,
    kv_cache_memory: str,
    role: str = "both",
    max_model_len: int = 1024,
    dtype: torch.dtype | None = None,
) -> Any:
    """A kvrelay engine over `folder` on the device (in `dtype`, the run's default if not
    given). `eager` asks for --enforce-eager (CUDA graphs off), raising NotImplementedError
    where the engine has no such option."""
    from kvrelay.engine.args import EngineArgs

    kwargs: dict[str, Any] = dict(
        model=str(folder),
        device=ctx.device,
        dtype=str(dtype or dtype_of(ctx)).removeprefix("torch."),
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=max_num_seqs,
        role=role,
        max_num_batched_tokens=2048 if ctx.cuda else 256,
        max_model_len=min(max_model_len, 512 if ctx.small else max_model_len),
    )
    if "enforce_eager" in engine_args_fields():
        kwargs["enforce_eager"] = eager
    elif eager:
        raise NotImplementedError("this engine has no enforce_eager option")
    return EngineArgs(**kwargs).create_engine(with_tokenizer=False)


def free_device_memory() -> None:
    """Give the device memory of dropped engines / models back (`del` them first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def greedy(max_tokens: int, *, ignore_eos: bool = True) -> Any:
    from kvrelay.common.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def engine_generate(
    engine: Any, prompts: list[list[int]], max_tokens: int, *, ignore_eos: bool = True
) -> list[list[int]]:
    """Greedy outputs of `prompts`, all added at once (continuous batching); with
    `ignore_eos` off a sequence ends at (and includes) an EOS. Stepped as a server steps
    (`step_delta`: a finished request's whole output is among its `outputs`)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(max_tokens, ignore_eos=ignore_eos))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step_delta().outputs:
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def hf_generate(
    model: Any, prompts: list[list[int]], max_tokens: int, *, min_new_tokens: bool = True
) -> list[list[int]]:
    """transformers' greedy `generate`; equal-length prompts go as one static batch. With
    `min_new_tokens` every sequence is `max_tokens` long (EOS masked until then: the
    throughput peer); without, a sequence stops at an EOS (then padded in a batch)."""
    lengths = {len(p) for p in prompts}
    batches = [prompts] if len(lengths) == 1 else [[p] for p in prompts]
    outputs: list[list[int]] = []
    device = next(model.parameters()).device
    for batch in batches:
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens if min_new_tokens else None,
                do_sample=False,
                pad_token_id=0,
            )
        outputs += out[:, ids.shape[1] :].tolist()
    return outputs


def logit_gap(model: Any, prefix: list[int], token_a: int, token_b: int) -> float:
    """transformers' next-token logit of `token_a` minus that of `token_b` after `prefix`."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prefix], device=device)).logits[0, -1].float()
    return float(logits[token_a] - logits[token_b])


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


COUNTER_NAMES = (
    "cuda_decode_calls",
    "triton_decode_calls",  # the decode dispatch's other kernel (newer: absent from older COUNTERS)
    "triton_prefill_calls",
    "graph_replays",
    "graph_captures",
    "eager_steps",
    "jit_compiles",  # newer than the rest: absent from older checkouts' COUNTERS
    "jit_compiles_after_ready",
)


def counters() -> dict[str, int] | None:
    """kvrelay_kernels' launch counters now, or None where this checkout has none."""
    try:
        from kvrelay_kernels import counters as module
    except ImportError:
        return None
    current = getattr(module, "COUNTERS", None)
    if current is None:
        return None
    return {
        name: int(getattr(current, name, 0) or 0)
        for name in COUNTER_NAMES
        if hasattr(current, name)
    }


def counter_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    if before is None or after is None:
        return {}
    return {name: after[name] - before.get(name, 0) for name in after}
