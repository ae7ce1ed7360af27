"""jit_watch: Triton compiles counted, and those while serving flagged. The hook's logic is
tested here directly; its installation into Triton in a fresh process (a Triton imported in
this one would turn the interpreter tests off: tests/kernels/triton_interp/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvrelay_kernels import jit_watch
from kvrelay_kernels.counters import COUNTERS
from tests.fresh_python import run_fresh_python


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    jit_watch.reset()
    before = (COUNTERS.jit_compiles, COUNTERS.jit_compiles_after_ready)
    yield
    jit_watch.reset()
    COUNTERS.jit_compiles, COUNTERS.jit_compiles_after_ready = before


def compiles() -> tuple[int, int]:
    return COUNTERS.jit_compiles, COUNTERS.jit_compiles_after_ready


def test_compiles_before_and_during_warm_up_are_not_serving_stalls() -> None:
    start = compiles()
    jit_watch.on_compile(key="k0")  # before any engine: a benchmark's own kernels
    with jit_watch.warming_up():
        jit_watch.on_compile(key="k1")
    assert compiles() == (start[0] + 2, start[1])


def test_a_compile_after_ready_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    start = compiles()
    with jit_watch.warming_up():
        pass
    jit_watch.on_compile(repr="_paged_attention_kernel[num_warps=4](...)")
    assert compiles() == (start[0] + 1, start[1] + 1)
    assert "_paged_attention_kernel" in caplog.text and "while serving" in caplog.text


def test_a_second_engine_warming_up_while_one_serves_is_not_flagged() -> None:
    """Two engines in one process (the GPU check's transfer part): the second's start-up
    compiles its own variants, expectedly."""
    start = compiles()
    with jit_watch.warming_up():
        pass
    with jit_watch.warming_up():
        jit_watch.on_compile(key="second engine")
    jit_watch.on_compile(key="a stall")
    assert compiles() == (start[0] + 2, start[1] + 1)


def test_the_installed_hook_counts_chains_and_never_skips_a_compile() -> None:
    """In a fresh process: Triton's own hook slot gets ours, which calls the hook that was
    there and returns None (a true value would make Triton skip the compile)."""
    script = """
import json, triton
from kvrelay_kernels import jit_watch
from kvrelay_kernels.counters import COUNTERS
seen = []
triton.knobs.runtime.jit_cache_hook = lambda *a, **k: seen.append(k.get("key")) or True
assert jit_watch.install() and jit_watch.install()  # once per process
hook = triton.knobs.runtime.jit_cache_hook
with jit_watch.warming_up():
    first = hook(key="a")
second = hook(key="b")
print(json.dumps([first, second, seen, COUNTERS.jit_compiles, COUNTERS.jit_compiles_after_ready]))
"""
    out = run_fresh_python(script, "kernels")
    assert json.loads(out.strip().splitlines()[-1]) == [None, None, ["a", "b"], 2, 1]
