"""The KV write fence (engine/handoff.py): a prefill engine waits on it before it makes each KV
handle (what a worker publishes for NIXL and gRPC pulls alike), and it costs nothing off CUDA."""

from __future__ import annotations

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.handoff import KVHandoff, KVWriteFence
from tests.engine.conftest import EngineFactory, make_engine, tiny_llama_dir  # noqa: F401


class RecordingFence(KVWriteFence):
    """Records, at each wait, how many leases the engine held: the new one must not exist yet."""

    def __init__(self, seen: list[int], handoff: KVHandoff) -> None:
        super().__init__("cpu")
        self.seen, self.handoff = seen, handoff

    def wait(self) -> None:
        self.seen.append(self.handoff.num_leases)
        super().wait()


@pytest.mark.parametrize("device", ["cpu", "meta", torch.device("cpu")])
def test_off_cuda_the_fence_does_nothing(device: str | torch.device) -> None:
    fence = KVWriteFence(device)
    for _ in range(3):
        fence.wait()
    assert fence.num_waits == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_without_a_device_and_without_cuda_the_fence_does_nothing() -> None:
    fence = KVWriteFence()
    fence.wait()
    assert fence.num_waits == 0 and not torch.cuda.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_fence_waits_for_queued_work() -> None:
    kv = torch.zeros(1 << 20, device="cuda")
    fence = KVWriteFence(kv.device)
    kv.add_(1)  # queued, maybe still running
    fence.wait()
    assert fence.num_waits == 1 and torch.cuda.current_stream().query()


def test_a_prefill_engine_waits_on_the_fence_before_each_handle(
    make_engine: EngineFactory,  # noqa: F811
) -> None:
    engine = make_engine(role="prefill")
    seen: list[int] = []
    engine.handoff.kv_fence = RecordingFence(seen, engine.handoff)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    handles = []
    while engine.has_unfinished_requests():
        handles += [out.kv_handle for out in engine.step() if out.kv_handle is not None]
    assert len(handles) == 3
    # One wait per handle, each before its lease was granted (0, 1, 2 leases held then).
    assert seen == [0, 1, 2]
    assert engine.handoff.num_leases == 3


def test_other_roles_never_wait(make_engine: EngineFactory) -> None:  # noqa: F811
    engine = make_engine(role="both")
    seen: list[int] = []
    engine.handoff.kv_fence = RecordingFence(seen, engine.handoff)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == []


def test_a_failing_fence_publishes_no_handle(make_engine: EngineFactory) -> None:  # noqa: F811
    class Broken(KVWriteFence):
        def wait(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine = make_engine(role="prefill")
    engine.handoff.kv_fence = Broken()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.handoff.num_leases == 0


def test_the_engine_fences_its_own_kv_device(make_engine: EngineFactory) -> None:  # noqa: F811
    """The fence is told the KV tensor's device (not left to guess the current CUDA one)."""
    engine = make_engine(role="prefill")
    assert engine.handoff.kv_fence.device == engine.kv_tensor.device
