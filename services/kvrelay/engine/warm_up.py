"""Before an engine on an accelerator says it is ready: one step of each kind it can run.

Triton compiles a kernel variant on its first launch in a process (~0.2 s of ptxas, more for
attention), and the first step of a kind also pays for cuBLAS's heuristics and the caching
allocator's first blocks. Met while serving, that is a stall of every request in the step.
So the engine runs, on its own cache and before any request, the step kinds a scheduler can
produce: a prefill alone, a prefill chunk continuing a context beside a decode (a mixed step,
which splits the batch between two kernels), and decodes alone (eager: what runs when CUDA
graphs are off or a batch is larger than the largest graph); each step's logits are sampled
greedily and through every truncation (the device sampler is a Triton kernel too). Kernel
variants depend on the model's shapes and dtype and on these kinds, never on the batch size
or the lengths: the kernels do not specialize on values that change from step to step
(`jit_watch.py` counts any compile after this, and the GPU check requires none).

The blocks written are the cache's first ones, free at start-up; nothing is kept. The engine
warms up on accelerators only: a CPU engine has nothing to compile here (its extensions are
built when the model is packed), though the steps run on any device.
"""

from __future__ import annotations

import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.runner import CausalLMModel
from kvrelay.engine.sampler import Sampler, SamplingRow
from kvrelay.models.inputs import AttentionInputs

# (context length, query tokens) per sequence of each warm-up step. Contexts cross a block
# boundary (16-token blocks) so the attention loops run more than one block.
PREFILL_ONLY = ((3, 3),)
MIXED = ((18, 1), (21, 4))  # a decode, then a chunk whose context began in an earlier step
DECODES = ((17, 1), (2, 1))
WARM_UP_STEPS = (PREFILL_ONLY, MIXED, DECODES)


def blocks_needed(block_size: int) -> int:
    """Blocks the largest warm-up step writes (each sequence gets its own)."""
    return max(sum(-(-ctx // block_size) for ctx, _ in step) for step in WARM_UP_STEPS)


def step_inputs(
    sequences: tuple[tuple[int, int], ...], block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
    """Host tensors of one warm-up step: token ids, positions and attention inputs, each
    sequence on fresh blocks from block 0."""
    tables: list[list[int]] = []
    slots: list[int] = []
    positions: list[int] = []
    starts = [0]
    next_block = 0
    for context, q_len in sequences:
        count = -(-context // block_size)
        table = list(range(next_block, next_block + count))
        next_block += count
        tables.append(table)
        span = range(context - q_len, context)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    attn = AttentionInputs.build(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in sequences], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        block_size=block_size,
        num_blocks=num_blocks,
    )
    ids = torch.zeros(len(positions), dtype=torch.int64)
    return ids, torch.tensor(positions, dtype=torch.int64), attn


# Sampled from each warm-up step's logits: a row through every truncation (the device
# sampler is one Triton kernel: compiled here, not at the first sampled request), then a
# greedy one.
_TRUNCATING = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
WARM_UP_ROWS = (
    SamplingRow(_TRUNCATING, [3], [], None, ()),
    SamplingRow(SamplingParams(temperature=0.0), [3], [], None, ()),
)


@torch.inference_mode()
def warm_up(model: CausalLMModel, kv_cache: torch.Tensor, sampler: Sampler | None = None) -> int:
    """Run each warm-up step (forward pass, logits and, with `sampler`, its device work on
    them) on `kv_cache`'s device; returns how many ran (0 when the cache is too small)."""
    device = kv_cache.device
    block_size, num_blocks = int(kv_cache.shape[3]), int(kv_cache.shape[0])
    if num_blocks < blocks_needed(block_size):
        return 0
    if getattr(model.backend, "name", None) == "cuda":  # before graphs capture the choice
        from kvrelay_kernels.decode_timing import prepare_for_model

        prepare_for_model(model, kv_cache)  # which decode kernel per batch x context, timed
    for sequences in WARM_UP_STEPS:
        ids, positions, attn = step_inputs(sequences, block_size, num_blocks)
        hidden = model(
            ids.to(device, non_blocking=True),
            positions.to(device, non_blocking=True),
            kv_cache,
            attn.to(device, non_blocking=True),
        )
        rows = torch.tensor([q for _, q in sequences], dtype=torch.int64).cumsum(0) - 1
        logits = model.compute_logits(hidden[rows.to(device, non_blocking=True)])
        if sampler is not None:
            sampled = WARM_UP_ROWS[: logits.shape[0]]
            uniforms = torch.full((len(sampled),), 0.5)
            sampler.sample_on_device(logits[: len(sampled)], sampled, uniforms)
    return len(WARM_UP_STEPS)
