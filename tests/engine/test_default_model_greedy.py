"""The real default model: greedy output equals transformers token for token, as one batch run
in tiny prefill chunks through a KV pool small enough to force preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three fruits:",
    "def fibonacci(n):\n    ",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: 'The cat sleeps on the warm windowsill while it rains outside.'",
    "Question: A train leaves at 3pm and travels 120 km at 60 km/h. When does it arrive? "
    "Think step by step and explain every step of your reasoning clearly before answering.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had spent his whole life building clocks that never told the right time. "
    "One winter morning, a stranger knocked on his door carrying a broken pocket watch and",
]
NEW_TOKENS = 24


def test_greedy_batch_with_chunks_and_preemption_equals_transformers(
    default_model_dir: Path,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # 12 blocks x 16 tokens: room for the longest request alone, far from all eight at once.
    llm = LLM(str(default_model_dir), max_num_batched_tokens=16, num_blocks=12, block_size=16)
    # min_tokens = max_tokens masks EOS exactly as HF's min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert llm.engine.kv_cache.pool.is_whole()

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    lengths = set()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        lengths.add(ids.shape[1])
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )
        assert output.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
    assert len(lengths) == len(PROMPTS), "prompts should all differ in length"
