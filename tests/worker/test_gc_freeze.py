"""freeze_start_up_objects: a worker's start-up objects leave the garbage collector's walks;
later garbage is still collected. In a fresh process: freezing this one would keep the test
session's objects forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.engine.args import EngineArgs
from kvrelay.worker import actor
from kvrelay.worker.actor import EngineWorker
from tests.fresh_python import run_fresh_python
from tests.worker.conftest import TINY_ENGINE_KWARGS


def test_start_up_objects_are_frozen_and_later_cycles_still_collected() -> None:
    script = """
import gc, json, weakref
from kvrelay.worker.engine_builder import freeze_start_up_objects
start_up = [[i] for i in range(50_000)]
freeze_start_up_objects()
frozen = gc.get_freeze_count()
class Node: pass
later = Node(); later.me = later  # a cycle made while serving
alive = weakref.ref(later); del later
gc.collect()
print(json.dumps([frozen, alive() is None, len(start_up)]))
"""
    frozen, collected, kept = json.loads(run_fresh_python(script, "services", "kernels"))
    assert frozen >= 50_000 and collected and kept == 50_000


@pytest.mark.parametrize("own_process", [True, False])
def test_only_a_worker_with_its_own_process_freezes(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, own_process: bool
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(actor, "freeze_start_up_objects", lambda: calls.append(True))
    args = EngineArgs(model=str(tiny_llama_dir), **TINY_ENGINE_KWARGS)
    EngineWorker(args, own_process=own_process)
    assert calls == ([True] if own_process else [])
