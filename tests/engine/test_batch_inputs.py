"""build_batch_inputs: a step's chunks flattened into model inputs (vectorized over the batch),
checked against the definition written out token by token."""

from __future__ import annotations

import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.request import Request
from kvrelay.engine.runner import build_batch_inputs, padded_block_table
from kvrelay.engine.scheduled import ScheduledChunk

BLOCK = 4


def request(rid: str, prompt: list[int], outputs: list[int], computed: int) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=50), max_total_tokens=100)
    r.output_token_ids = list(outputs)
    r.num_computed_tokens = computed
    return r


def test_decodes_and_chunks_flatten_as_token_by_token() -> None:
    decode = request("d", [5, 6, 7, 8, 9], [10, 11], computed=6)  # its last output is new
    first_chunk = request("p", list(range(20, 31)), [], computed=0)
    middle_chunk = request("m", list(range(40, 50)), [], computed=4)
    chunks = [
        ScheduledChunk.of(decode, 1),
        ScheduledChunk.of(first_chunk, 6),  # tokens 0-5 of 11: samples nothing
        ScheduledChunk.of(middle_chunk, 6),  # tokens 4-9 of 10: reaches the end, samples
    ]
    tables = [[3, 9], [7, 1], [12, 4, 8]]
    inputs = build_batch_inputs(chunks, tables, BLOCK, num_blocks=16)

    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for chunk, table in zip(chunks, tables, strict=True):
        for p in range(chunk.start, chunk.end):
            ids.append(chunk.request.token_ids(p, p + 1)[0])
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    assert inputs.input_ids.tolist() == ids == [11, *range(20, 26), *range(44, 50)]
    assert inputs.positions.tolist() == positions
    assert inputs.attn.slot_mapping.tolist() == slots
    assert inputs.attn.seq_lens.tolist() == [7, 6, 10]
    assert inputs.attn.query_start_loc.tolist() == [0, 1, 7, 13]
    assert inputs.logits_indices.tolist() == [0, 12]  # the decode and the finished chunk
    assert inputs.attn.block_tables.tolist() == [[3, 9, 0], [7, 1, 0], [12, 4, 8]]
    dtypes = [inputs.input_ids.dtype, inputs.positions.dtype, inputs.attn.slot_mapping.dtype]
    assert dtypes == [torch.int64] * 3
    assert inputs.attn.block_tables.dtype == inputs.attn.seq_lens.dtype == torch.int32


def test_the_padded_table_keeps_each_row_in_order() -> None:
    table = padded_block_table([[4], [1, 2, 3], [], [9, 8]])
    assert table.tolist() == [[4, 0, 0], [1, 2, 3], [0, 0, 0], [9, 8, 0]]
    assert str(table.dtype) == "int32"
