"""Test helpers for kvrelay.models: a hand-built paged KV cache and the step metadata for it.

The metadata is computed here independently of the engine, so the model tests do not depend
on the block manager.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from kvrelay.models import AttentionInputs, CausalLM
from kvrelay.models.quantized import QUANT_KERNEL_ENV


class PagedKV:
    """A KV cache with shuffled block ids per sequence, and the metadata of each step."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size))
        free = list(range(num_blocks))
        # Shuffled so a sequence's blocks are neither contiguous nor in order.
        random.Random(seed).shuffle(free)
        self.free = free
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(
        self, chunks: Sequence[tuple[str, Sequence[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        """Append `chunks` ((seq id, new token ids) each) and return
        `(input_ids [T], positions [T], attn)` for one forward."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids.extend(tokens)
            positions.extend(range(start, end))
            self.lens[seq] = end
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        # Padding entries point at block 0 on purpose: attention must ignore them.
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        attn = AttentionInputs.build(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            block_size=self.block_size,
        )
        return torch.tensor(ids), torch.tensor(positions), attn

    def forward_logits(
        self, model: CausalLM, chunks: Sequence[tuple[str, Sequence[int]]]
    ) -> torch.Tensor:
        """Run one step and return `[T, vocab]` logits of every query row."""
        input_ids, positions, attn = self.step(chunks)
        with torch.inference_mode():
            hidden = model(input_ids, positions, self.cache, attn)
            return model.compute_logits(hidden)


@pytest.fixture
def paged_kv() -> type[PagedKV]:
    return PagedKV


@pytest.fixture(params=["auto", "torch"])
def quant_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each quantized-layer test twice: kvrelay's CPU block kernel, and torch's int4 kernel."""
    monkeypatch.setenv(QUANT_KERNEL_ENV, request.param)
    return str(request.param)
