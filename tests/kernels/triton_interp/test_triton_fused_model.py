"""The decoder with the fused Triton layer ops (gpu_fused.py) wired in, interpreted on the CPU:
the models' GPU path, which no CPU run takes otherwise (`gpu_fused_ops_for` answers for CUDA
tensors only, so these tests answer it for CPU ones). Same hidden states and KV cache as the
torch ops, within the fused norm's and SiLU's last-bit differences, and the same greedy tokens
through the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.engine.warm_up import MIXED, step_inputs
from kvrelay.models import layers, llama
from kvrelay.models.loader import load_model
from kvrelay_kernels import gpu_fused, select_backend


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, GQA 4 query / 2 KV heads of 16 dims; large weights make greedy clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-fused")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


class Launches:
    """The fused ops, answered for CPU tensors too, each call counted by name."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        ops = gpu_fused.load_gpu_fused_ops()
        assert ops is not None, "triton is installed for these tests"
        self.ops = gpu_fused.GpuFusedOps(
            **{name: self._counted(name, getattr(ops, name)) for name in self.NAMES}
        )

    NAMES = ("rms_norm", "add_rms_norm", "silu_and_mul", "rope_and_write_kv")

    def _counted(self, name: str, op: Callable[..., torch.Tensor]) -> Any:
        def call(*args: Any) -> torch.Tensor:
            self.counts[name] = self.counts.get(name, 0) + 1
            return op(*args)

        return call

    def ops_for(self, x: torch.Tensor) -> gpu_fused.GpuFusedOps | None:
        return self.ops if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None


def use_fused_ops(monkeypatch: pytest.MonkeyPatch) -> Launches:
    """From here on the models take the GPU path on the CPU: the fused ops answered, the CPU
    extension's not."""
    launches = Launches()
    for module in (layers, llama):
        monkeypatch.setattr(module, "gpu_fused_ops_for", launches.ops_for)
    monkeypatch.setattr(layers, "fused_ops_for", lambda x: None)
    return launches


def _forward(model_dir: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and KV cache of one mixed step (a decode beside a chunk), torch backend."""
    model, _ = load_model(model_dir, select_backend("torch"), dtype=dtype)
    kv = torch.zeros(model.kv_cache_shape(8, 16), dtype=dtype)
    ids, positions, attn = step_inputs(MIXED, block_size=16, num_blocks=8)
    ids = torch.randint(3, 128, ids.shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(ids, positions, kv, attn), kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_layers_compute_what_the_torch_ops_do(
    tiny_llama: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected_hidden, expected_kv = _forward(tiny_llama, dtype)
    launches = use_fused_ops(monkeypatch)
    hidden, kv = _forward(tiny_llama, dtype)
    # Per layer: one norm (layer 0 plain, then adding the last MLP output), RoPE + KV write,
    # add + norm after attention, SiLU x mul; the final norm adds the last MLP output.
    assert launches.counts == {
        "rms_norm": 1, "add_rms_norm": 4, "rope_and_write_kv": 2, "silu_and_mul": 2,
    }  # fmt: skip
    # The norm sums squares in another order and SiLU's exp is another: last-bit differences.
    tol = 1e-5 if dtype == torch.float32 else None  # None: torch's defaults for bf16
    torch.testing.assert_close(hidden, expected_hidden, atol=tol, rtol=tol)
    torch.testing.assert_close(kv, expected_kv, atol=tol, rtol=tol)
    assert kv.abs().sum() > 0 and torch.equal(kv[5:], torch.zeros_like(kv[5:]))


def _greedy(model_dir: Path) -> dict[str, list[int]]:
    model, model_config = load_model(model_dir, select_backend("torch"))
    config = EngineConfig(
        model=str(model_dir),
        model_config=model_config,
        cache=CacheConfig(block_size=4, num_blocks=48, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4),
        max_model_len=64,
    )
    engine = Engine(config, model, tokenizer=None)
    prompts = [[5, 9, 3, 7, 11, 4, 8, 6, 10, 12, 13], [3, 4], [7] * 9]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=6))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_the_engine_on_fused_layers_gives_the_same_greedy_tokens(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks beside decodes, through the engine, fp32: tokens equal."""
    expected = _greedy(tiny_llama)
    launches = use_fused_ops(monkeypatch)
    assert _greedy(tiny_llama) == expected
    assert launches.counts["rope_and_write_kv"] > 0
