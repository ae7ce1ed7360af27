"""gpu_check part 3 times each graphed decode batch twice on one engine: as served (async
scheduling on CUDA) and with the overlap held aside (`engine_steps.synchronous`). On the CPU,
with async scheduling forced on: holding it aside and giving it back changes no token and
leaks no block, and an engine without it is left as it was."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine import Engine
from tests.engine.conftest import (
    EngineFactory,
    assert_pool_whole,
    make_engine,
    run_to_completion,
    tiny_llama_dir,
)

__all__ = ["make_engine", "tiny_llama_dir"]  # the engine tests' fixtures, used here
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def steps() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    from gpu_parts import engine_steps

    yield engine_steps


def _add(engine: Engine, tag: str) -> None:
    for i in range(3):
        engine.add_request(f"{tag}{i}", [5 + i, 9, 11 + 2 * i, 4], PARAMS)


def test_holding_the_overlap_aside_runs_synchronously_and_gives_it_back(
    steps: ModuleType, make_engine: EngineFactory
) -> None:
    reference = make_engine(async_scheduling=False)
    _add(reference, "a")
    _add(reference, "b")
    expected = run_to_completion(reference)
    engine = make_engine(async_scheduling=True)
    overlap = engine.overlap
    assert overlap is not None
    _add(engine, "a")
    got = run_to_completion(engine)
    launched = overlap.launched
    with steps.synchronous(engine) as held:
        assert held and engine.overlap is None and engine.scheduler.fence is None
        _add(engine, "b")
        got.update(run_to_completion(engine))
    assert overlap.launched == launched  # nothing overlapped while held aside
    assert engine.overlap is overlap and engine.scheduler.fence is overlap
    _add(engine, "c")
    after = run_to_completion(engine)
    assert overlap.launched > launched
    assert got == expected
    assert after == {f"c{i}": expected[f"a{i}"] for i in range(3)}
    assert_pool_whole(engine)


def test_an_engine_without_async_scheduling_is_left_alone(
    steps: ModuleType, make_engine: EngineFactory
) -> None:
    engine = make_engine(async_scheduling=False)
    with steps.synchronous(engine) as held:
        assert not held and engine.overlap is None
    assert engine.overlap is None
