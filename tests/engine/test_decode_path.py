"""The runner's pure decode path (`execute_decodes`: inputs from the persistent block table,
uploaded in one copy, no plan), run on the CPU: with a stand-in for the CUDA graphs that runs
the model eagerly on exactly the tensors a graph would read, every request's tokens must equal
the plain host path's, through chunked prefills, forks (copy-on-write), preemptions, prefix
cache hits and requests finishing mid-batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine import plain_decodes
from kvrelay.engine.engine import Engine
from kvrelay.engine.runner import ModelRunner, build_batch_inputs
from kvrelay.engine.step_upload import StepUploader
from kvrelay.models.inputs import AttentionInputs
from tests.engine.conftest import EngineFactory, assert_pool_whole, run_to_completion

CPU = torch.device("cpu")


class _EagerGraphs:
    """Stands in for `DecodeGraphs` on the CPU: a pure decode step of any size "replays" by
    running the model eagerly on the tensors `replay` is given (what a graph's static inputs
    would be loaded with); every other step runs eagerly as it would without graphs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.replays = 0
        self.seen: list[dict[str, torch.Tensor]] = []

    def decode_size(self, num_seqs: int) -> int | None:
        return num_seqs

    def size_for(self, attn: AttentionInputs, num_tokens: int) -> int | None:
        return None  # the general path: eager, as without graphs

    def replay(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        assert size == input_ids.shape[0]
        self.replays += 1
        self.seen.append(
            {"input_ids": input_ids.clone(), "positions": positions.clone(),
             "slot_mapping": slot_mapping.clone(), "seq_lens": seq_lens.clone(),
             "block_tables": block_tables.clone()}
        )  # fmt: skip
        qsl = torch.arange(size + 1, dtype=torch.int32)
        runner = self.runner
        attn = AttentionInputs.build(
            slot_mapping, block_tables, seq_lens, qsl, runner.block_size, runner.kv_cache.shape[0]
        )
        return runner.model(input_ids, positions, runner.kv_cache, attn)


def _decode_path(engine: Engine) -> _EagerGraphs:
    """Route `engine`'s pure decode steps through `execute_decodes` on the CPU."""
    runner = engine.runner
    max_blocks = -(-engine.max_total_tokens // runner.block_size)
    runner.uploader = StepUploader(CPU, max_blocks, rows=1)  # rows=1: the table must grow
    graphs = _EagerGraphs(runner)
    runner.graphs = graphs  # type: ignore[assignment]
    return graphs


def _requests(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=14)
    engine.add_request("a", list(range(3, 40)), greedy)  # chunked: 37 tokens, budget 16
    engine.add_request("b", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20))
    # Three samples of one prompt: forks share its partial last block (copy-on-write).
    engine.add_request("c", [9] * 13, SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=11))
    engine.add_request("d", list(range(50, 61)), SamplingParams(temperature=0.0, max_tokens=9))
    engine.add_request("e", list(range(3, 30)), greedy)  # a prefix of a's prompt: cache hits
    engine.add_request(  # stops early on a token the model picks (whatever it is)
        "f",
        [4, 4, 4],
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=list(range(64))),
    )


@pytest.mark.parametrize("num_blocks", [24, 64])
def test_the_decode_path_gives_the_host_paths_tokens(
    make_engine: EngineFactory, num_blocks: int
) -> None:
    """24 blocks: preemptions (rows freed and re-used, tables re-allocated); 64: none."""
    results, replays = [], 0
    for decode_path in (False, True):
        engine = make_engine(num_blocks=num_blocks, max_num_batched_tokens=16)
        graphs = _decode_path(engine) if decode_path else None
        _requests(engine)
        results.append(run_to_completion(engine))
        assert_pool_whole(engine)
        if graphs is not None:
            replays = graphs.replays
        if num_blocks == 24:
            assert engine.scheduler.num_preemptions > 0
    assert results[0] == results[1]
    assert len(results[0]["c"]) == 3
    assert replays > 5  # the pure decode steps


def test_the_decode_paths_inputs_equal_the_host_built_ones(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pure decode step's tensors, checked against `build_batch_inputs` on the same
    chunks and the KV cache's own tables: tokens, positions, slots, lengths, and the block
    tables exactly, padding zeros included; decodes opening a block among them (their one
    new entry written alone: `take_changed().appended`)."""
    monkeypatch.setattr(plain_decodes, "MIN_ROWS", 1)  # openings taken for the whole batch
    engine = make_engine(num_blocks=24, max_num_batched_tokens=16)
    graphs = _decode_path(engine)
    expected: list[Any] = []
    openings: list[str] = []  # decodes that opened a block (one entry written for each)
    execute_decodes = engine.runner.execute_decodes
    uploader = engine.runner.uploader
    assert uploader is not None

    def checked(
        chunks: Any, table_of: Any, changed: Any, copies: Any = (), feed: Any = None,
        appended: Any = frozenset(),
    ) -> Any:  # fmt: skip
        tables = [table_of(c.request.request_id) for c in chunks]
        expected.append(build_batch_inputs(chunks, tables, engine.runner.block_size))
        before = uploader.stager.uploads
        openings.extend(appended)
        result = execute_decodes(chunks, table_of, changed, copies, feed, appended)
        assert uploader.stager.uploads == before + 1  # copy-on-write pairs in the same copy
        return result

    engine.runner.execute_decodes = checked  # type: ignore[method-assign]
    _requests(engine)
    run_to_completion(engine)
    assert len(expected) == len(graphs.seen) > 10 and openings
    for host, seen in zip(expected, graphs.seen, strict=True):
        assert torch.equal(seen["input_ids"], host.input_ids)
        assert torch.equal(seen["positions"], host.positions)
        assert torch.equal(seen["slot_mapping"], host.attn.slot_mapping)
        assert torch.equal(seen["seq_lens"], host.attn.seq_lens)
        assert torch.equal(seen["block_tables"], host.attn.block_tables)


def test_a_step_with_a_prefill_or_a_fork_takes_the_general_path(
    make_engine: EngineFactory,
) -> None:
    """The decode path is only for pure decode steps: a step holding a prefill chunk, or a
    leader whose forks join at its first token, goes through `execute` (with its plan)."""
    engine = make_engine()
    graphs = _decode_path(engine)
    engine.add_request("x", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4))
    engine.step()  # the prefill
    assert graphs.replays == 0
    engine.step()  # x decodes alone
    assert graphs.replays == 1
    engine.add_request("y", [9, 9], SamplingParams(temperature=0.0, max_tokens=3))
    engine.step()  # x decodes beside y's prefill: one step, general path
    assert graphs.replays == 1
    engine.add_request("z", [7], SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3))
    engine.step()  # z's 1-token prompt samples with a fork: general path
    assert graphs.replays == 1
    engine.step()
    assert graphs.replays == 2
    run_to_completion(engine)
    assert_pool_whole(engine)


def test_copy_on_write_pairs_go_up_with_a_decode_step(make_engine: EngineFactory) -> None:
    """Two samples share their prompt's partial last block: the first decode step copies it
    for one of them (copy-on-write) and is still a pure decode step, its pairs staged in the
    step's one copy; the tokens equal the host path's."""
    params = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=6)
    host = make_engine()
    host.add_request("pair", [5] * 10, params)
    expected = run_to_completion(host)
    engine = make_engine()
    graphs = _decode_path(engine)
    seen: list[Any] = []
    execute_decodes = engine.runner.execute_decodes

    def recorded(
        chunks: Any, table_of: Any, changed: Any, copies: Any = (), feed: Any = None,
        appended: Any = frozenset(),
    ) -> Any:  # fmt: skip
        seen.extend(copies)
        return execute_decodes(chunks, table_of, changed, copies, feed, appended)

    engine.runner.execute_decodes = recorded  # type: ignore[method-assign]
    engine.add_request("pair", [5] * 10, params)
    assert run_to_completion(engine) == expected and len(expected["pair"]) == 2
    assert_pool_whole(engine)
    assert len(seen) == 1 and graphs.replays == 5
