"""The engine on the Triton backend (interpreted) produces the same greedy tokens as on torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.models.loader import load_model
from kvrelay_kernels import available_backends, select_backend, triton_attention


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, GQA 4 query / 2 KV heads of 16 dims; large weights make greedy clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def _generate(model_dir: Path, backend: str, prompts: list[list[int]]) -> dict[str, list[int]]:
    model, model_config = load_model(model_dir, select_backend(backend))
    model.prepack()
    config = EngineConfig(
        model=str(model_dir),
        model_config=model_config,
        # block_size 4 and 12 tokens per step: prompts span partial blocks and are prefilled
        # in chunks next to other sequences' decodes, so every kind of row is exercised.
        cache=CacheConfig(block_size=4, num_blocks=48, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4),
        max_model_len=64,
    )
    engine = Engine(config, model, tokenizer=None)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=6))
    done: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    assert len(done) == len(prompts), "the engine did not finish"
    return done


def test_engine_greedy_tokens_match_torch_on_triton(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "triton" in available_backends()  # offered on a CPU under the interpreter
    prompts = [list(range(3, 17)), [5, 9, 11], list(range(20, 27))]
    expected = _generate(tiny_llama, "torch", prompts)
    calls: list[int] = []
    kernel = triton_attention.paged_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_attention", counting)
    got = _generate(tiny_llama, "triton", prompts)
    assert calls, "the Triton kernel was never called"
    assert got == expected
    assert all(len(tokens) == 6 for tokens in got.values())
