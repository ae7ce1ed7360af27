"""Random-weight models for the engine checks, built on the spot from a LlamaConfig (no cached
weights needed), their transformers reference, kvrelay engines over them, and the kernel
counters read defensively (they are newer than this script may be)."""

from __future__ import annotations

import gc
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gpu_parts.report import Context

# The embedded default, SmolLM2-135M-Instruct (ARCHITECTURE.md section 4), and a ~1B Llama
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


def dtype_of(ctx: Context) -> torch.dtype:
    return torch.bfloat16 if ctx.cuda else torch.float32


def build_model(ctx: Context, name: str) -> tuple[Path, Any]:
    """A random-weight Llama of shape `name` saved as safetensors under ctx.work_dir, and the
    transformers model holding the very same weights, on the device, in eval mode. Reused
    when asked again (ctx.shared)."""
    key = f"model:{name}"
    if key in ctx.shared:
        return ctx.shared[key]
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(SMALL_SHAPES if ctx.small else SHAPES)[name], bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(ctx.device):  # random init on the GPU: seconds, not a minute on the CPU
        model = LlamaForCausalLM(config)
    model.to(dtype_of(ctx)).eval().requires_grad_(False)
    folder = ctx.work_dir / name
    model.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    ctx.log(f"{name}: {params:.0f} M parameters, built in {time.perf_counter() - start:.1f} s")
    ctx.shared[key] = (folder, model)
    return folder, model


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
) -> Any:
    """A kvrelay engine over `folder` on the device. `eager` asks for --enforce-eager (CUDA
    graphs off), raising NotImplementedError where the engine has no such option."""
    from kvrelay.engine.args import EngineArgs

    kwargs: dict[str, Any] = dict(
        model=str(folder),
        device=ctx.device,
        dtype=str(dtype_of(ctx)).removeprefix("torch."),
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


def greedy(max_tokens: int) -> Any:
    from kvrelay.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts`, all added at once (continuous batching)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(max_tokens))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def hf_generate(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`; equal-length prompts go as one static batch."""
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
                min_new_tokens=max_tokens,
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
    "triton_prefill_calls",
    "graph_replays",
    "graph_captures",
    "eager_steps",
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
