"""Engine scenarios on fake CUDA, run in a process of their own (the fake runtime is
process-wide): `python -m tests.fake_cuda.scenarios OUT.json`. Each scenario's findings (or its
traceback) go into one JSON object that tests/engine/test_fake_cuda.py asserts on.

Every step runs under the strict rules (mode.py); the sampler's one sync per step, the only
device read allowed, is the one thing replaced: fake tensors have no values, so each step
pretends that token 7 was sampled (as the meta-device test does)."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine
from kvrelay.engine.sampler import SamplerOutput, SamplingRow
from kvrelay.models import loader
from kvrelay.transfer.kv_regions import PinnedStaging, block_bytes, chunk_segments, flat_bytes
from kvrelay_kernels.counters import COUNTERS
from tests.fake_cuda import kernels, runtime
from tests.fake_cuda.mode import FakeCudaMode

SAMPLED = 7
MAX_NUM_SEQS = 8
PREEMPTION_TOKENS = 40
BATCH_TOKENS = 4


def write_model(folder: Path, head_dim: int, **shape: Any) -> Path:
    """A 2-layer GQA Llama, by default 4 query heads of `head_dim` (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{
        "vocab_size": 512, "hidden_size": 4 * head_dim, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": head_dim, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        **shape,
    })  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def patch_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights read on the host, then moved (safetensors writes through raw pointers, which a
    fake tensor does not have), and `Module.to` without `swap_tensors` (fake parameters refuse
    it); the tensors end up where the loader put them, as on a GPU."""
    read = loader.load_file

    def load_file(path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
        return {name: t.to(device) for name, t in read(path, device="cpu").items()}

    def module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device = torch.device(args[0] if args else kwargs["device"])
        for module in self.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)
            for name, param in list(module._parameters.items()):
                if param is not None and param.device != device:
                    module._parameters[name] = torch.nn.Parameter(param.to(device), False)
        return self

    monkeypatch.setattr(loader, "load_file", load_file)
    monkeypatch.setattr(torch.nn.Module, "to", module_to)


def make_engine(model: Path, **overrides: Any) -> Engine:
    args: dict[str, Any] = dict(
        model=str(model), device="cuda", dtype="bfloat16", kv_cache_memory="64MiB",
        max_num_seqs=MAX_NUM_SEQS, max_model_len=1024, max_num_batched_tokens=64,
    )  # fmt: skip
    return EngineArgs(**{**args, **overrides}).create_engine(with_tokenizer=False)


def fake_sampling(engine: Engine) -> None:
    """The sampler runs on the device up to its one sync, which is replaced (see the top);
    under async scheduling, the read of the sampled ids' host copy is (it holds no values)."""
    sampler = engine.runner.sampler
    sampler.read_tokens = lambda tokens: [SAMPLED] * len(tokens)  # type: ignore[method-assign]

    def sample(
        logits: torch.Tensor, rows: Sequence[SamplingRow], uniforms: torch.Tensor
    ) -> SamplerOutput:
        tokens, _ = sampler.sample_on_device(logits, rows, uniforms)
        assert tokens.device.type == "cuda" and tokens.shape == (len(rows),)
        return SamplerOutput([SAMPLED] * len(rows), [None] * len(rows))

    sampler.sample = sample  # type: ignore[method-assign]


def add_mixed_requests(engine: Engine) -> None:
    """Greedy, random with every truncation and allowed tokens, penalties with logprobs and
    logit_bias, two samples of one prompt; one prompt long enough to be prefilled in chunks
    while the others decode."""
    engine.add_request(
        "short",
        [4, 5, 6],
        _params(temperature=0.8, top_p=0.9, top_k=5, seed=1, allowed_token_ids=[4, 7, 11, 30]),
    )
    engine.add_request(
        "penalised",
        [9] * 6,
        _params(
            repetition_penalty=1.3, presence_penalty=0.5, logprobs=2, logit_bias={11: 3, 12: -100}
        ),
    )
    engine.add_request("long", list(range(3, 203)), _params(temperature=0.0))
    # Two samples of one prompt share its partial last block: the first token each writes
    # there copies the block first (copy-on-write).
    engine.add_request("pair", [5] * 10, _params(n=2, temperature=0.9))


def _params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 6, "min_tokens": 2, **kwargs})


def run_steps(engine: Engine, mode: FakeCudaMode) -> dict[str, Any]:
    """Step to the end under the strict rules; what each step launched, and the outcome."""
    steps: list[list[tuple[str, int]]] = []
    finished: dict[str, list[int]] = {}
    aborted: list[str] = []
    with mode.strict_rules():
        while engine.has_unfinished_requests() and len(steps) < 200:
            before = len(kernels.LOG.calls)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
                    if out.outputs[0].finish_reason == "abort":
                        aborted.append(out.request_id)
            steps.append(kernels.LOG.calls[before:])
    pool = engine.kv_cache.pool
    return {
        "finished": finished,
        "aborted": aborted,
        "steps": steps,
        "pool_whole": pool.is_whole(),
        "uploads": mode.uploads,
        "device_ops": mode.device_ops,
    }


def scenario_engine(model: Path, mode: FakeCudaMode, **overrides: Any) -> dict[str, Any]:
    # Step by step (run_steps records what each engine step launched): the overlapped loop
    # has its own scenarios (async_scenarios.py). These requests' min_tokens kept every step
    # synchronous until async scheduling learned to overlap min_tokens.
    engine = make_engine(model, **{"async_scheduling": False, **overrides})
    fake_sampling(engine)
    add_mixed_requests(engine)
    result = run_steps(engine, mode)
    result["backend"] = engine.runner.model.backend.name
    result["graphs"] = engine.runner.graphs is not None
    return result


def scenario_preemption(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """15 blocks of 16 tokens for five requests that need 20 by their ends: running requests
    are preempted and recomputed, their rows of the device block table rewritten."""
    engine = make_engine(model, kv_cache_memory=None, num_blocks=15, async_scheduling=False)
    fake_sampling(engine)
    long_params = _params(temperature=0.0, max_tokens=PREEMPTION_TOKENS)
    engine.add_request("long", list(range(3, 153)), long_params)
    for i in range(4):
        engine.add_request(f"s{i}", [4 + i] * 14, long_params)
    result = run_steps(engine, mode)
    result["preemptions"] = engine.scheduler.num_preemptions
    return result


def scenario_gpu_check_batch(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """The GPU check's throughput run at its size: 256 concurrent requests of 64 tokens on an
    engine of max_num_seqs 256 (graphs of up to 256 rows) and 2048 batched tokens."""
    engine = make_engine(
        model, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_memory="1GiB"
    )
    fake_sampling(engine)
    params = _params(temperature=0.0, max_tokens=BATCH_TOKENS, min_tokens=0)
    for i in range(256):
        engine.add_request(f"r{i}", [3 + i % 100] * 64, params)
    result = run_steps(engine, mode)
    result["graph_sizes"] = engine.runner.graphs.sizes if engine.runner.graphs else []
    result["max_decode_rows"] = max(
        (rows for step in result["steps"] for name, rows in step if name == "decode"), default=0
    )
    return result


def scenario_long_context(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """The GPU check's transfer engines' context (4160): graphs with a fixed split-K count
    over a shared workspace, and eager decodes that choose their own."""
    engine = make_engine(model, max_model_len=4160, max_num_batched_tokens=2048)
    fake_sampling(engine)
    engine.add_request("long", list(range(3, 4003)), _params(temperature=0.0))
    engine.add_request("short", [5] * 20, _params(temperature=0.0))
    return run_steps(engine, mode)


def scenario_memory_profile(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """No KV size given: sized from the device's free memory after a profiling step."""
    engine = make_engine(model, kv_cache_memory=None, gpu_memory_utilization=0.5)
    return {
        "num_blocks": engine.num_blocks,
        "block_bytes": block_bytes(engine.kv_tensor),
        "block_size": engine.config.cache.block_size,
        "kv_device": str(engine.kv_tensor.device),
    }


def scenario_handoff(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """Prefill on one engine, the blocks through pinned staging (as a gRPC pull moves them),
    decode on another: the fence waits on the prefill's KV writes before the handle leaves."""
    pre, dec = make_engine(model, role="prefill"), make_engine(model, role="decode")
    for engine in (pre, dec):
        fake_sampling(engine)
    prompt = list(range(3, 60))
    pre.add_request("r", prompt, _params(temperature=0.0))
    events_before = runtime.LOG.events_waited
    handles = [out.kv_handle for out in run_until_handle(pre, mode)]
    fence_waits = runtime.LOG.events_waited - events_before
    handle = handles[0]
    assert handle is not None
    plan = dec.add_prefilled_request("r", prompt, _params(temperature=0.0), handle)
    assert plan is not None
    staging = PinnedStaging(dec.kv_tensor.device, chunk_bytes=1 << 16)
    size = block_bytes(pre.kv_tensor)
    region = flat_bytes(pre.kv_tensor)
    offset = 0
    for block in plan.remote_block_ids:
        for data in staging.read(region[block * size : (block + 1) * size]):
            segments = chunk_segments(plan.local_block_ids, size, offset, len(data))
            staging.write(flat_bytes(dec.kv_tensor), segments, data)
            offset += len(data)
    staging.finish()
    dec.finish_pull("r", ok=True)
    decoded = run_steps(dec, mode)
    pre.release_kv("r")
    return {
        "fence_waits": fence_waits,
        "bytes_moved": offset,
        "pinned_allocations": mode.pinned_allocations,
        "decoded": decoded,
        "prefill_pool_whole": pre.kv_cache.pool.is_whole(),
    }


def run_until_handle(engine: Engine, mode: FakeCudaMode) -> list[Any]:
    outs = []
    with mode.strict_rules():
        while engine.has_unfinished_requests():
            outs += [out for out in engine.step() if out.finished]
    return outs


def scenario_warm_up(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """What an engine launches before it is ready (eager, so no graph capture adds to it)."""
    make_engine(model, enforce_eager=True)
    return {"calls": list(kernels.LOG.calls)}


def scenario_direct_call(model: Path, mode: FakeCudaMode) -> dict[str, Any]:
    """`cuda_backend.paged_attention` without a plan, as the GPU check's kernel part calls it:
    a mixed step whose decodes are not contiguous (decode, prefill, decode), so the split
    gathers by the plan's index tensors, which must be on the query's device. The metadata
    comes from the host (a direct caller may pass it there); not strict: such a caller syncs."""
    from kvrelay_kernels import cuda_backend

    heads, kv_heads, dim = 4, 2, 64
    query = torch.empty(5, heads, dim, dtype=torch.bfloat16, device="cuda")
    kv_cache = torch.empty(8, 1, 2, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([20, 10, 33], dtype=torch.int32)
    starts = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    out = cuda_backend.paged_attention(query, kv_cache, 0, tables, lens, starts, dim**-0.5)
    return {"out": [str(out.device), list(out.shape)], "calls": list(kernels.LOG.calls)}


def scenario_rules(model: Path, mode: FakeCudaMode) -> dict[str, str]:
    """The rig itself: each thing a decode step must not do is caught while strict."""
    device = torch.empty(4, 8, device="cuda")
    host = torch.arange(4)
    attempts: dict[str, Callable[[], object]] = {
        "item": lambda: device.sum().item(),
        "tolist": lambda: device[0].tolist(),
        "blocking_upload": lambda: host.to("cuda"),
        "blocking_download": lambda: device.to("cpu"),
        "host_operand": lambda: device[:, 0] + host,
        "list_index": lambda: device[[0, 2]],
        "tensor_on_device": lambda: torch.tensor([1, 2], device="cuda"),
    }
    caught: dict[str, str] = {}
    with mode.strict_rules():
        allowed = host.to("cuda", non_blocking=True) + device[:, 0]  # the right way: fine
        for name, attempt in attempts.items():
            try:
                attempt()
                caught[name] = "not caught"
            except Exception as error:  # which error it was is the finding
                caught[name] = type(error).__name__
    caught["allowed_device"] = str(allowed.device)
    return caught


# add_mixed_requests' requests: each finishes with 6 tokens (min_tokens 2, max_tokens 6).
MIXED_REQUESTS = frozenset({"short", "penalised", "long", "pair"})


def install_rig() -> FakeCudaMode:
    """The rig in this process (fake CUDA runtime and kernels, model loading onto the fake
    device), never undone: each scenario module runs in a process of its own. Returns the
    mode to run the scenarios in."""
    monkeypatch = pytest.MonkeyPatch()
    mode = FakeCudaMode()
    runtime.install(monkeypatch, mode)
    kernels.install(monkeypatch)
    patch_loading(monkeypatch)
    return mode


def run_one(mode: FakeCudaMode, run: Callable[[], Any]) -> dict[str, Any]:
    """One scenario, the kernel and runtime logs and the rule violations cleared first: its
    result (or the traceback the test fails on) and the rules it broke."""
    kernels.LOG.calls.clear()
    kernels.LOG.decode_splits.clear()
    runtime.LOG.__init__()  # type: ignore[misc]
    mode.violations.clear()
    try:
        part: dict[str, Any] = {"result": run()}
    except Exception:  # reported: the test fails on it
        part = {"error": traceback.format_exc()}
    part["violations"] = list(mode.violations)
    return part


def finished_run(report: dict[str, Any], name: str) -> dict[str, Any]:
    """A scenario's run of add_mixed_requests, after checking it kept the rules and finished
    every request whole (for the tests that read the report)."""
    part = report[name]
    assert "error" not in part, part["error"]
    assert part["violations"] == [], part["violations"]
    result: dict[str, Any] = part["result"]
    assert result["aborted"] == [] and result["pool_whole"]
    assert result["finished"] == {rid: [SAMPLED] * 6 for rid in MIXED_REQUESTS}
    return result


def main(out: Path) -> None:
    mode = install_rig()
    folder = out.parent
    hd64 = write_model(folder / "llama-hd64", 64)
    hd32 = write_model(folder / "llama-hd32", 32)
    # The GPU check's default-model shape (9 heads of 64 over 3 KV heads), 2 layers.
    smollm2 = write_model(
        folder / "smollm2-shape", 64, hidden_size=576, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    scenarios: dict[str, Callable[[], Any]] = {
        "rules": lambda: scenario_rules(hd64, mode),
        "graphs": lambda: scenario_engine(hd64, mode),
        "eager": lambda: scenario_engine(hd64, mode, enforce_eager=True),
        "preemption": lambda: scenario_preemption(hd64, mode),
        "no_decode_kernel": lambda: scenario_engine(hd32, mode),
        "memory_profile": lambda: scenario_memory_profile(hd64, mode),
        "gpu_check_batch": lambda: scenario_gpu_check_batch(smollm2, mode),
        "long_context": lambda: scenario_long_context(smollm2, mode),
        "handoff": lambda: scenario_handoff(hd64, mode),
        "direct_call": lambda: scenario_direct_call(hd64, mode),
        "warm_up": lambda: scenario_warm_up(hd64, mode),
    }
    results: dict[str, Any] = {}
    with mode:
        for name, run in scenarios.items():
            counters_before = asdict(COUNTERS)
            results[name] = run_one(mode, run)
            results[name]["counters"] = {
                k: v - counters_before[k] for k, v in asdict(COUNTERS).items()
            }
            results[name]["runtime"] = asdict(runtime.LOG)
            results[name]["decode_splits"] = sorted(set(kernels.LOG.decode_splits))
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
