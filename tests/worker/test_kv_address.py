"""A real EngineWorker in a pod's environment (issue 16): it reports its generation, pod and
node; its gRPC KV server binds $KVRELAY_KV_HOST and advertises exactly it, so a decode worker
elsewhere pulls the bytes (no recompute); told a wrong address, the decode worker falls back
to recompute loudly (a WARNING naming the peer and the address, and the fallback counter the
kvrelay_kv_transfer_failures metric sums); and a drained worker says so in its status.
In-process workers on the tiny model: two loopback addresses stand in for two pods."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.common.messages import DrainState, EngineRequest, KVHandle, Role
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.worker.actor import EngineWorker, Placement
from kvrelay.worker.deltas import request_deltas
from tests.engine.conftest import EngineFactory
from tests.transfer.plans import SECRET
from tests.worker.conftest import TINY_ENGINE_KWARGS
from tests.worker.test_pools import colocated, greedy

PROMPT = list(range(3, 23))  # five full blocks of 4
PREFILL_POD = {
    "KVRELAY_KV_HOST": "127.0.0.2",
    "KVRELAY_POD_NAME": "svc-prefill-worker-x7k2p",
    "KVRELAY_NODE_NAME": "gpu-node-3",
    "KVRELAY_GENERATION": "0a1b2c3d4e5f",
}


def start(
    tiny_llama_dir: Path, role: Role, env: dict[str, str], mp: pytest.MonkeyPatch
) -> EngineWorker:
    """A worker built in `env`, as a Ray actor inherits its pod's environment."""
    with mp.context() as scoped:
        for name in ("KVRELAY_KV_HOST", *PREFILL_POD):
            scoped.delenv(name, raising=False)
        for name, value in env.items():
            scoped.setenv(name, value)
        args = EngineArgs.from_kwargs(str(tiny_llama_dir), dict(TINY_ENGINE_KWARGS))
        return EngineWorker(args, role, "grpc", kv_secret=SECRET)


@pytest.fixture
def pair(tiny_llama_dir: Path) -> Iterator[tuple[EngineWorker, EngineWorker]]:
    mp = pytest.MonkeyPatch()
    prefill = start(tiny_llama_dir, Role.PREFILL, PREFILL_POD, mp)
    decode = start(tiny_llama_dir, Role.DECODE, {"KVRELAY_POD_NAME": "svc-decode-worker-q9m4t"}, mp)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


async def relayed(
    prefill: EngineWorker, decode: EngineWorker, request_id: str, params: SamplingParams
) -> list[int]:
    first = await prefill.prefill(
        EngineRequest(request_id, PROMPT, params), decode.engine.engine_id
    )
    handle = first.kv_handle
    assert isinstance(handle, KVHandle)
    tokens: list[int] = []
    async for delta in request_deltas(
        decode.loop, EngineRequest(request_id, PROMPT, params, handle)
    ):
        for sample in delta.samples:
            tokens[sample.start :] = sample.token_ids
    await prefill.release_kv(request_id)
    return tokens


async def test_the_worker_reports_where_it_runs_and_serves_kv_there(
    pair: tuple[EngineWorker, EngineWorker], make_engine: EngineFactory
) -> None:
    prefill, decode = pair
    info = prefill.describe()
    assert (info.generation, info.pod, info.node) == (
        "0a1b2c3d4e5f",
        "svc-prefill-worker-x7k2p",
        "gpu-node-3",
    )
    assert decode.describe().pod == "svc-decode-worker-q9m4t"
    meta = prefill.kv_metadata()
    assert meta.payload.decode().startswith("127.0.0.2:")
    decode.add_peer(meta)
    tokens = await relayed(prefill, decode, "r1", greedy(6))
    assert tokens == colocated(make_engine, {"r1": PROMPT}, 6)["r1"]
    stats = await decode.stats()
    assert stats.kv_bytes_pulled > 0 and stats.kv_pull_fallbacks == 0  # the KV travelled


async def test_a_pull_from_a_wrong_address_recomputes_loudly(
    pair: tuple[EngineWorker, EngineWorker],
    make_engine: EngineFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill, decode = pair
    meta = prefill.kv_metadata()
    port = meta.payload.decode().rpartition(":")[2]
    wrong = f"127.0.0.1:{port}"  # what the worker advertised before: its pod's own loopback
    decode.add_peer(dataclasses.replace(meta, payload=wrong.encode()))
    with caplog.at_level(logging.WARNING):
        tokens = await relayed(prefill, decode, "r2", greedy(6))
    assert tokens == colocated(make_engine, {"r2": PROMPT}, 6)["r2"]  # recomputed, correct
    assert (await decode.stats()).kv_pull_fallbacks == 1  # kvrelay_kv_transfer_failures
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    pull = [m for m in warnings if "KV pull failed" in m]
    assert pull and prefill.engine.engine_id in pull[0] and wrong in pull[0], warnings
    assert any("recomputing its prompt" in m for m in warnings)


async def test_a_drained_worker_says_so(pair: tuple[EngineWorker, EngineWorker]) -> None:
    prefill, _ = pair
    assert prefill.status().state is DrainState.SERVING and prefill.status().alive
    info = prefill.drain()
    assert info.pod == "svc-prefill-worker-x7k2p"
    assert prefill.status().state is DrainState.DRAINING
    prefill.drain()  # again: no change
    assert prefill.status().state is DrainState.DRAINING


def test_placement_defaults_off_kubernetes() -> None:
    import socket

    placement = Placement.from_env({})
    assert placement == Placement(generation="", pod=socket.gethostname(), node="")
    assert Placement.from_env({"KVRELAY_POD_NAME": " p ", "KVRELAY_GENERATION": "g"}) == Placement(
        "g", "p", ""
    )
