"""`--gpu-memory-utilization`: size the KV cache from what the GPU has left (issue 14).

As vLLM does: after the weights are loaded, one profiling forward pass at the step's largest
shape (`max_num_batched_tokens` tokens, logits for `max_num_seqs` rows) measures the peak
activation memory; the KV cache then gets `utilization x total` minus everything in use
(weights, CUDA context, other processes) minus that peak. The arithmetic is plain functions,
unit-tested without a GPU; only `measure_cuda` reads the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.cuda_graphs import DecodeGraphs
from kvrelay.engine.kv_cache.layout import allocate_kv_cache, kv_block_bytes
from kvrelay.engine.runner import CausalLMModel
from kvrelay.models.inputs import AttentionInputs

logger = logging.getLogger(__name__)
_MIB = 2**20


@dataclass(frozen=True)
class MemoryProfile:
    """What a profiling pass saw, in bytes."""

    total: int  # the device's memory
    used_before: int  # in use before the pass: weights, CUDA context, other processes
    peak_increase: int  # the pass's peak allocation above what was allocated before it


def kv_cache_budget(profile: MemoryProfile, utilization: float, reserved: int = 0) -> int:
    """Bytes left for the KV cache: `utilization x total - used - peak - reserved` (0 when
    negative); `reserved` is what is allocated later (the CUDA graphs' scratch)."""
    used = profile.used_before + profile.peak_increase + reserved
    return max(int(profile.total * utilization) - used, 0)


def kv_blocks_for_budget(
    budget: int, block_bytes: int, block_size: int, max_model_len: int, utilization: float
) -> int:
    """How many KV blocks `budget` bytes hold.

    Raises:
        ValueError: fewer blocks than one request of `max_model_len` tokens needs.
    """
    blocks = budget // block_bytes
    needed = -(-max_model_len // block_size)
    if blocks < needed:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves {budget / _MIB:.0f} MiB for the KV "
            f"cache after the weights and a profiled step: {blocks} blocks of {block_size} "
            f"tokens, but one request of max_model_len {max_model_len} needs {needed} "
            f"({needed * block_bytes / _MIB:.0f} MiB); lower --max-model-len or raise "
            "--gpu-memory-utilization (or set --num-blocks / --kv-cache-memory)"
        )
    return int(blocks)


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int
) -> tuple[list[int], list[list[int]]]:
    """The profiling step: `num_tokens` prompt tokens as whole prefills of at most
    `max_model_len` each. Returns each sequence's length and its blocks (fresh, in order)."""
    lens: list[int] = []
    left = num_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    tables: list[list[int]] = []
    next_block = 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return lens, tables


@torch.inference_mode()
def run_profile_step(
    model: CausalLMModel,
    kv_cache: torch.Tensor,
    num_tokens: int,
    max_model_len: int,
    num_logit_rows: int,
) -> None:
    """One forward pass of the biggest step into `kv_cache` (enough blocks for
    `profile_batch`), then logits and a softmax over `num_logit_rows` rows (the sampler's
    working set), on whatever device the cache is."""
    block_size = int(kv_cache.shape[3])
    lens, tables = profile_batch(num_tokens, max_model_len, block_size)
    device = kv_cache.device
    width = max(len(t) for t in tables)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, n in zip(tables, lens, strict=True)
        for p in range(n)
    ]
    attn = AttentionInputs.build(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_size=block_size,
        num_blocks=int(kv_cache.shape[0]),
    ).to(device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    hidden = model(ids, positions, kv_cache, attn)
    rows = torch.arange(num_logit_rows, device=device) % num_tokens
    torch.softmax(model.compute_logits(hidden[rows]), dim=-1)


def profile_blocks_needed(num_tokens: int, max_model_len: int, block_size: int) -> int:
    """Blocks the profiling step's cache needs."""
    _, tables = profile_batch(num_tokens, max_model_len, block_size)
    return sum(len(t) for t in tables)


def measure_cuda(
    model: CausalLMModel,
    kv_cache: torch.Tensor,
    num_tokens: int,
    max_model_len: int,
    num_logit_rows: int,
) -> MemoryProfile:
    """Run the profiling step on the cache's CUDA device and report its memory."""
    device = kv_cache.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(model, kv_cache, num_tokens, max_model_len, num_logit_rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - allocated
    profile = MemoryProfile(total=total, used_before=total - free, peak_increase=peak)
    logger.info(
        "memory profile: %.0f MiB total, %.0f MiB in use before the profiled step, "
        "%.0f MiB peak during it",
        total / _MIB,
        profile.used_before / _MIB,
        peak / _MIB,
    )
    return profile


def size_kv_cache_for_gpu(
    config: EngineConfig, model: CausalLMModel, utilization: float
) -> EngineConfig:
    """`config` with its KV cache sized in blocks from a profiling step on its CUDA device.

    Raises:
        ValueError: not even one request of max_model_len fits (see `kv_blocks_for_budget`).
    """
    dtype = getattr(torch, config.dtype)
    block_size = config.cache.block_size
    tokens = config.scheduler.max_num_batched_tokens
    scratch = allocate_kv_cache(
        config.model_config,
        profile_blocks_needed(tokens, config.max_model_len, block_size),
        block_size,
        dtype,
        device=config.device,
    )
    profile = measure_cuda(
        model, scratch, tokens, config.max_model_len, config.scheduler.max_num_seqs
    )
    del scratch
    torch.cuda.empty_cache()
    reserved = 0
    if not config.enforce_eager:
        reserved = DecodeGraphs.workspace_bytes(
            config.model_config, config.scheduler.max_num_seqs, config.max_model_len
        )
    blocks = kv_blocks_for_budget(
        kv_cache_budget(profile, utilization, reserved),
        kv_block_bytes(config.model_config, block_size, dtype),
        block_size,
        config.max_model_len,
        utilization,
    )
    logger.info("KV cache: %d blocks from --gpu-memory-utilization %s", blocks, utilization)
    return replace(config, cache=replace(config.cache, num_blocks=blocks))
