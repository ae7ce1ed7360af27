"""`--device`: parsing and resolution, the CPU path unchanged, and placement checked on `meta`.

On the meta device tensors have shapes but no data, so anything that reads a value on the
host (`.item()`, `int(t)`, `.tolist()`, `.cpu()`) raises there; `OnDeviceOnly` also fails any
op that mixes a meta tensor with a host one (which on CUDA would be an implicit copy, often
a sync), apart from explicit uploads with `non_blocking=True`. Host-only ops (the step's
inputs are built on the host) are allowed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import EngineConfig, SchedulerConfig
from kvrelay.engine.args import EngineArgs
from kvrelay.engine.device import CPU_AUTO_DTYPE_ENV, resolve_device, resolve_dtype
from kvrelay.engine.engine import Engine
from kvrelay.engine.sampler import Sampler, SamplerOutput, SamplingRow
from kvrelay.models.cpu_features import cpu_has_native_bf16
from kvrelay.models.loader import load_model
from kvrelay.worker.pools import actor_engine_args, worker_num_gpus
from kvrelay_kernels import cpu_extension, select_backend
from kvrelay_kernels.cpu_fused import load_fused_ops
from tests.engine.conftest import TINY_VOCAB, hf_greedy, run_to_completion
from tests.fake_cuda.mode import COPIES, non_blocking


class OnDeviceOnly(TorchDispatchMode):
    """Fails any op that touches a meta tensor together with a host tensor, unless it is an
    upload with `non_blocking=True`; counts the ops that ran on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.meta_ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        if "meta" in devices or kwargs.get("device") == torch.device("meta"):
            self.meta_ops += 1
            host = [t for t in tensors if t.device.type == "cpu"]
            upload = func.overloadpacket in COPIES and non_blocking(func, args, kwargs)
            if host and not upload:
                raise AssertionError(
                    f"{func} mixes host tensors {[h.shape for h in host]} "
                    "with the device's: an implicit copy (a sync on CUDA)"
                )
        return func(*args, **kwargs)


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def test_device_names_resolve() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu" and resolve_device("meta") == "meta"
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda:0")
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="m", model_config=None, device="gpu")  # type: ignore[arg-type]


def test_auto_dtype_on_a_cpu_follows_its_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)
    assert resolve_dtype("auto", "cpu", native_cpu_bf16=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu", native_cpu_bf16=False) == "float32"
    assert resolve_dtype("auto", "meta", native_cpu_bf16=True) == "float32"
    detected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_dtype("auto", "cpu") == detected
    assert resolve_dtype("float32", "cpu", native_cpu_bf16=True) == "float32"


def test_auto_dtype_override_for_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test suite's own setting (tests/conftest.py), and a deployment's way to pin it."""
    assert os.environ[CPU_AUTO_DTYPE_ENV] == "float32"  # set for every test
    assert resolve_dtype("auto", "cpu", native_cpu_bf16=True) == "float32"
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", "cpu", native_cpu_bf16=False) == "bfloat16"
    assert resolve_dtype("auto", "cuda") == "bfloat16"  # CUDA ignores it
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "fp16")
    with pytest.raises(ValueError, match="KVRELAY_CPU_AUTO_DTYPE='fp16': use one of float32"):
        resolve_dtype("auto", "cpu")


def test_device_flag_through_cli_and_engine_config(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert "--device" in parser.format_help()
    args = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (args.device, args.dtype) == ("auto", "auto")
    config = args.create_engine_config(tiny_llama_dir)
    if not torch.cuda.is_available():
        assert (config.device, config.dtype) == ("cpu", "float32")  # today's CPU default
    args = EngineArgs.from_cli_args(parser.parse_args(["--device", "meta", "--dtype", "float16"]))
    assert args.create_engine_config(tiny_llama_dir).device == "meta"
    assert worker_num_gpus("cuda:0", 0) == 1 and worker_num_gpus("cpu", 8) == 0
    assert (worker_num_gpus("auto", 0), worker_num_gpus("auto", 2)) == (0, 1)


def test_a_worker_actor_sees_its_one_gpu_as_cuda() -> None:
    """Ray shows a GPU actor only the GPU it picked: `cuda:3` would name one it cannot see."""
    assert actor_engine_args({"device": "cuda:3", "dtype": "auto"}) == {
        "device": "cuda",
        "dtype": "auto",
    }
    for device in ("cuda", "cpu", "auto", "meta"):
        assert actor_engine_args({"device": device})["device"] == device
    assert actor_engine_args({}) == {}


def test_device_cpu_gives_todays_greedy_tokens(tiny_llama_dir: Path) -> None:
    """`--device cpu` through EngineArgs: the same tokens as transformers (as test_engine's
    reference test expects of the default path), weights and cache on the CPU."""
    engine = EngineArgs(
        model=str(tiny_llama_dir),
        device="cpu",
        num_blocks=64,
        block_size=4,
        attention_backend="torch",
    ).create_engine(with_tokenizer=False)
    assert engine.kv_tensor.device.type == "cpu" and engine.kv_tensor.dtype == torch.float32
    prompts = [[5, 17, 99, 3, 42], list(range(3, 30))]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _greedy(8))
    done = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)][0] == hf_greedy(tiny_llama_dir, prompt, 8)


def test_a_cpu_engine_builds_its_fused_ops_before_its_first_step(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server is ready once its engine is built: the fused ops' extension (a ~30 s compile
    on a new CPU) must be loaded by then, not by the first request's forward pass."""
    name = "kvrelay_cpu_fused_ops"
    if load_fused_ops() is None:
        pytest.skip("the fused CPU ops do not build here")
    monkeypatch.delitem(cpu_extension._built, name)  # as a fresh process has it
    EngineArgs(model=str(tiny_llama_dir), device="cpu", num_blocks=16).create_engine(
        with_tokenizer=False
    )
    assert cpu_extension._built.get(name) is not None
    monkeypatch.delitem(cpu_extension._built, name)
    EngineArgs(model=str(tiny_llama_dir), device="meta", num_blocks=16).create_engine(
        with_tokenizer=False
    )
    assert name not in cpu_extension._built  # nothing to build for other devices


@pytest.fixture
def meta_engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    """The tiny model, its KV cache and every step tensor on the meta device."""
    model, model_config = load_model(tiny_llama_dir, select_backend("torch"), device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    config = EngineConfig(
        model=str(tiny_llama_dir),
        model_config=model_config,
        # 8-token steps: prompts are chunked, so later chunks attend to earlier context
        # (the reference's causal-mask path) and steps mix prefill chunks with decodes.
        scheduler=SchedulerConfig(max_num_batched_tokens=8),
        device="meta",
    )
    yield Engine(config, model, tokenizer=None)


def test_engine_steps_on_meta_never_touch_the_host(
    meta_engine: Engine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whole engine steps (prefill chunks, then decodes with mixed context lengths) on meta:
    the forward pass, the logits and the sampler up to its one sync per step (the sampled ids
    read back) run without reading a device value on the host or mixing devices. Only that
    one read is replaced: meta has no values, so each step pretends token 7 was sampled.
    Request "d" has a grammar (structured outputs) that token 7 ("$") completes in 4."""
    from kvrelay.common.structured_outputs import StructuredKind, StructuredOutputs
    from tests.engine.grammar_vocab import write_tokenizer

    write_tokenizer(tmp_path)  # the tiny model's vocabulary, where its grammar compiles
    meta_engine._grammar.compiler.model_path = str(tmp_path)
    sampler = meta_engine.runner.sampler
    calls: list[int] = []

    def sample(logits: torch.Tensor, rows: list[SamplingRow], u: torch.Tensor) -> SamplerOutput:
        tokens, (_, logprobs) = sampler.sample_on_device(logits, rows, u)
        assert logits.is_meta and tokens.is_meta and tokens.shape == (len(rows),)
        assert logprobs is None or logprobs.is_meta
        calls.append(len(rows))
        return SamplerOutput([7] * len(rows), [None] * len(rows))

    monkeypatch.setattr(sampler, "sample", sample)
    steps: list[int] = []
    execute = meta_engine.runner.execute

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return execute(*args, **kwargs)

    monkeypatch.setattr(meta_engine.runner, "execute", counted)
    meta_engine.add_request("a", list(range(3, 20)), _greedy(4))
    meta_engine.add_request(
        "b", [4, 5, 6], SamplingParams(temperature=0.8, top_p=0.9, top_k=5, max_tokens=4, seed=1)
    )
    meta_engine.add_request(
        "c",
        [9] * 6,
        SamplingParams(
            repetition_penalty=1.3, presence_penalty=0.5, max_tokens=4, logit_bias={5: 2.0}
        ),
    )
    dollars = StructuredOutputs(StructuredKind.REGEX, r"\$\$\$\$")
    meta_engine.add_request("d", [3, 8], SamplingParams(structured_outputs=dollars))
    mode = OnDeviceOnly()
    with mode:
        done = run_to_completion(meta_engine)
    assert sorted(done) == ["a", "b", "c", "d"] and all(d[0] == [7] * 4 for d in done.values())
    assert len(calls) >= 4 and mode.meta_ops > 100
    # The inputs went up staged (one copy per step) and the block tables live on the device.
    uploader = meta_engine.runner.uploader
    assert uploader is not None and uploader.table.table.is_meta
    assert uploader.stager.uploads == len(steps) > len(calls) and not uploader.stager.pinned


def test_sampler_on_meta_up_to_its_one_sync() -> None:
    """Every sampling feature (penalties, min_tokens, temperature, top-k / top-p / min-p,
    logprobs) runs on the logits' device; `sample` then reads the ids back once."""
    rows = [
        SamplingRow(_greedy(1), [1, 2], [3], None, (2,)),
        SamplingRow(
            SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, logprobs=3),
            [4],
            [],
            torch.Generator().manual_seed(3),
            (2,),
        ),
        SamplingRow(
            SamplingParams(
                temperature=1.2,
                top_k=4,
                frequency_penalty=0.4,
                repetition_penalty=1.1,
                min_tokens=2,
            ),
            [5, 6],
            [7],
            None,
            (2,),
        ),
    ]
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.randn(3, TINY_VOCAB)
    on_meta = logits.to("meta")
    with OnDeviceOnly() as mode:
        uniforms = sampler.draw_uniforms(rows)  # host RNG: see sampler.py
        tokens, (idx, logprobs) = sampler.sample_on_device(on_meta, rows, uniforms)
    assert tokens.is_meta and logprobs is not None and logprobs.is_meta and idx == [1]
    assert mode.meta_ops > 20
    cpu = sampler.sample(logits, rows, uniforms)  # the same rows, on the CPU, to the end
    assert len(cpu.token_ids) == 3 and cpu.logprobs[1] is not None


@pytest.mark.parametrize("constrained", [[1, 2], [0, 1, 2]], ids=["some rows", "every row"])
def test_constrained_rows_on_meta_upload_their_mask_without_waiting(
    tmp_path: Path, constrained: list[int]
) -> None:
    """Structured outputs: the grammar's bitmask is filled on the host, goes up in one
    non-blocking copy and is unpacked and applied on the device (sampled, greedy, min_tokens
    and logprobs rows alike); nothing is read back before the step's one sync."""
    from kvrelay.common.structured_outputs import StructuredOutputs
    from kvrelay.engine.grammar import GrammarCompiler
    from tests.engine.grammar_vocab import write_tokenizer

    write_tokenizer(tmp_path)
    compiler = GrammarCompiler(str(tmp_path), TINY_VOCAB, (2,))
    prototype = compiler.compile(StructuredOutputs.json_schema({"type": "object"})).result()
    params = [
        _greedy(1),
        SamplingParams(temperature=0.7, top_k=5, min_tokens=2, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias={5: 1.0}),
    ]
    rows = [
        SamplingRow(
            p,
            [4],
            [],
            torch.Generator().manual_seed(i),
            (2,),
            prototype.deep_copy() if i in constrained else None,
        )
        for i, p in enumerate(params)
    ]
    sampler = Sampler(torch.Generator().manual_seed(0))
    on_meta = torch.randn(3, TINY_VOCAB).to("meta")
    with OnDeviceOnly() as mode:
        uniforms = sampler.draw_uniforms(rows)
        tokens, (idx, logprobs) = sampler.sample_on_device(on_meta, rows, uniforms)
    assert tokens.is_meta and logprobs is not None and logprobs.is_meta and idx == [1]
    assert mode.meta_ops > 20
    compiler.shutdown()
