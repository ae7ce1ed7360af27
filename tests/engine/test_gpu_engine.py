"""The engine on a GPU (skipped elsewhere): CUDA graphs give the eager run's greedy tokens,
and the counters show the graphs and the CUDA decode kernel ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import EngineArgs
from kvrelay_kernels import cuda_backend
from kvrelay_kernels.counters import COUNTERS
from tests.engine.conftest import run_to_completion

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def llama_hd64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama with head_dim 64 (a compiled CUDA decode kernel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama-hd64")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def _run(path: Path, eager: bool) -> dict[str, list[list[int]]]:
    engine = EngineArgs(
        model=str(path), device="cuda", dtype="float32", num_blocks=256, block_size=16,
        max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager,
    ).create_engine(with_tokenizer=False)  # fmt: skip
    assert (engine.runner.graphs is None) == eager
    for i in range(6):  # 6 decodes: the graph of 8, two rows padded
        prompt = list(range(3 + i, 20 + 7 * i))
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=24))
    return run_to_completion(engine)


def test_graphs_give_the_eager_tokens(llama_hd64: Path) -> None:
    if not cuda_backend.is_available():
        pytest.fail("the CUDA kernels did not build (see the log)")
    eager = _run(llama_hd64, eager=True)
    before = COUNTERS.as_dict()
    graphed = _run(llama_hd64, eager=False)
    assert graphed == eager
    assert COUNTERS.graph_replays - before["graph_replays"] > 10
    assert COUNTERS.cuda_decode_calls > before["cuda_decode_calls"]
