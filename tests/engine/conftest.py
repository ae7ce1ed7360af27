"""Engine fixtures: a tiny random Llama checkpoint written by the test session itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.engine.engine import Engine
from kvrelay.models.loader import load_model
from kvrelay_kernels import select_backend

TINY_VOCAB = 128


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama with large random weights, so greedy choices are clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(tiny_llama_dir: Path) -> EngineFactory:
    """Build an engine on the tiny model; keyword arguments override cache / scheduler knobs."""

    def build(
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        max_model_len: int = 256,
        enable_prefix_caching: bool = True,
        role: str = "both",
        kv_transfer_failure: str = "recompute",
        async_scheduling: bool | None = None,
    ) -> Engine:
        model, model_config = load_model(tiny_llama_dir, select_backend("torch"))
        model.prepack()  # as EngineArgs.create_engine does
        config = EngineConfig(
            model=str(tiny_llama_dir),
            model_config=model_config,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
            ),
            max_model_len=max_model_len,
            role=role,
            kv_transfer_failure=kv_transfer_failure,
            async_scheduling=async_scheduling,
        )
        return Engine(config, model, tokenizer=None)

    return build


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' own greedy decoding, EOS ignored."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list[list[int]]]:
    """Step until idle; returns each request's sample token ids."""
    done: dict[str, list[list[int]]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [o.token_ids for o in output.outputs]
    raise AssertionError("engine did not finish")


def assert_pool_whole(engine: Engine) -> None:
    """Nothing leaked: every block has reference count 0 (cached-but-free blocks are free)."""
    engine.kv_cache.pool.check_invariants()
    assert engine.kv_cache.pool.is_whole(), "KV blocks leaked"
    assert engine.kv_cache.num_requests() == 0
    assert not engine.has_unfinished_requests()


def load_model_config_135m() -> ModelConfig:
    """SmolLM2-135M's shape (9 query heads of 64 dims, 3 KV heads, 30 layers)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
