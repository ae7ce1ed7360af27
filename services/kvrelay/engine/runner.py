"""Turns a scheduled batch into model inputs, runs the forward pass and samples next tokens.

It owns the model, the KV tensor and the sampler; it never decides what to run (the scheduler
does) nor what a token means for the request (the engine does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvrelay.engine.isolation import sample_isolating
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import SampleLogprobs, Sampler, SamplingRow
from kvrelay.engine.scheduler import ScheduledChunk
from kvrelay.models.inputs import AttentionInputs
from kvrelay_kernels import AttentionBackend


class CausalLMModel(Protocol):
    """What the runner needs of a model (kvrelay.models)."""

    backend: AttentionBackend  # the kernel ops; the runner uses its copy_blocks

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionInputs,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request whose chunk reached its last token (or a fork's)."""

    token_id: int
    logprobs: SampleLogprobs | None


class StepResult(NamedTuple):
    """What one step sampled: tokens in chunk order (forks after their leader), and the
    requests whose sampling failed alone (their traceback logged; the others unaffected)."""

    sampled: list[tuple[Request, SampledToken]]
    failed: list[Request]


@dataclass(frozen=True)
class BatchInputs:
    """Flattened model inputs of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [num_sampled] int64 row of each sampled chunk's last token

    def to(self, device: torch.device) -> BatchInputs:
        """The step's inputs on `device`: built on the host, uploaded once per step without
        waiting (`non_blocking`); `self` on the CPU, so the CPU path pays nothing.

        Next slices (issue 14): stage them in reusable pinned host buffers (a pageable
        source makes each non_blocking copy a staged, host-blocking one) and keep the
        block tables on the device, updated incrementally, instead of re-sending them.
        """
        if self.input_ids.device == device:
            return self
        return BatchInputs(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            self.attn.to(device, non_blocking=True),
            self.logits_indices.to(device, non_blocking=True),
        )


def build_batch_inputs(
    chunks: Sequence[ScheduledChunk],
    block_tables: Sequence[list[int]],
    block_size: int,
    num_blocks: int | None = None,
) -> BatchInputs:
    """Flatten the chunks into token, position, slot and block-table tensors, on the host (the
    plan reads their values: on a device that would be a sync); `BatchInputs.to` uploads."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    for chunk, table in zip(chunks, block_tables, strict=True):
        token_ids.extend(chunk.request.token_ids(chunk.start, chunk.end))
        span = range(chunk.start, chunk.end)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        seq_lens.append(chunk.end)
        query_start_loc.append(len(token_ids))
        if chunk.samples:
            logits_indices.append(len(token_ids) - 1)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    attn = AttentionInputs.build(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        block_size=block_size,
        num_blocks=num_blocks,
    )
    return BatchInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=attn,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


class ModelRunner:
    """Runs one step of the model on the worker's KV tensor."""

    def __init__(
        self, model: CausalLMModel, kv_cache: torch.Tensor, block_size: int, sampler: Sampler
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device  # every step tensor is moved here, once per step
        self.block_size = block_size
        self.sampler = sampler

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        block_tables: Sequence[list[int]],
        copies: Sequence[tuple[int, int]] = (),
    ) -> StepResult:
        """Copy the copy-on-write blocks, compute the chunks' K/V, and sample one token for
        each chunk that ends its request and for each of its forks (same logits row, each
        with its own generator). A request whose sampling fails is reported in `failed`
        rather than failing the step (isolation.py); a failed forward pass raises.
        """
        if copies:
            # Before the forward pass: it may write into a copy's source (its last owner).
            src = torch.tensor([s for s, _ in copies], dtype=torch.int64)
            dst = torch.tensor([d for _, d in copies], dtype=torch.int64)
            dev = self.device
            self.model.backend.copy_blocks(
                self.kv_cache, src.to(dev, non_blocking=True), dst.to(dev, non_blocking=True)
            )
        inputs = build_batch_inputs(
            chunks, block_tables, self.block_size, self.kv_cache.shape[0]
        ).to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn)
        sampled_chunks = [chunk for chunk in chunks if chunk.samples]
        if not sampled_chunks:
            return StepResult([], [])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        requests = [r for c in sampled_chunks for r in (c.request, *c.forks)]
        if len(requests) > len(sampled_chunks):
            # logits: [num_sampled_chunks, V] -> [len(requests), V], a leader's row repeated
            rows_of = [i for i, c in enumerate(sampled_chunks) for _ in range(1 + len(c.forks))]
            rows_t = torch.tensor(rows_of, dtype=torch.int64)
            logits = logits[rows_t.to(logits.device, non_blocking=True)]
        rows = [
            SamplingRow(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                eos_token_ids=r.eos_token_ids,
            )
            for r in requests
        ]
        samples = sample_isolating(self.sampler, logits, rows, [r.request_id for r in requests])
        result = StepResult([], [])
        for request, sample in zip(requests, samples, strict=True):
            if sample is None:
                result.failed.append(request)
            else:
                result.sampled.append((request, SampledToken(sample.token_id, sample.logprobs)))
        return result
