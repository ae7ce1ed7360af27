"""Each new family through the real engine (EngineArgs.create_engine, fp32): greedy tokens equal
to transformers' `generate`, token for token, for a batch of prompts run in small prefill
chunks over a paged cache, on the torch backend and on this machine's default one (cpu where
its C++ kernels build); the sliding windows are shorter than the sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.engine.args import EngineArgs
from tests.engine.conftest import run_to_completion
from tests.hf_checkpoints import CASES, WINDOWED_CASES, make_checkpoint

transformers = pytest.importorskip("transformers")

# One case per family and RoPE scaling, windows and caps included.
GREEDY_CASES = [
    "qwen3-qknorm-headdim",
    "qwen3-yarn-tied",
    "qwen3-window-layers",
    "mistral-window",
    "phi3-longrope-short",
    "phi3-longrope-long",
    "phi3-window",
    "gemma2-caps",
    "gemma3-local-rope",
    "gemma3-final-cap-tied",
]
PROMPT_LENGTHS = (5, 9, 17)
NEW_TOKENS = 10


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 97, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(hf_model: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", GREEDY_CASES)
def test_engine_greedy_equals_transformers(tmp_path: Path, case: str, backend: str) -> None:
    family, overrides = {**CASES, **WINDOWED_CASES}[case]
    hf_model = make_checkpoint(tmp_path, family, overrides)
    engine = EngineArgs(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=8,  # prompts prefill in chunks beside the others' decodes
    ).create_engine(with_tokenizer=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert done[str(i)][0] == _hf_greedy(hf_model, prompt), f"{case}: prompt {i}"
