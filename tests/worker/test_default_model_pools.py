"""The real default model through the router's relay, a prefill and a decode worker over NIXL
and over gRPC: greedy outputs of concurrent prompts equal transformers' own greedy generate,
token for token, and so does the streamed text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.config import RouterConfig
from kvrelay.router.local import complete, local_router
from kvrelay.router.types import GenerateChunk
from kvrelay.worker.pools import Pools
from tests.worker.test_faults import assert_whole

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who",
]
NEW_TOKENS = 16


@pytest.mark.parametrize("backend", ["nixl", "grpc"])
def test_default_model_disaggregated_equals_transformers(
    worker_ray: None, default_model_dir: Path, backend: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    pools = Pools.start(
        str(default_model_dir),
        transfer_backend=backend,
        engine_kwargs={"num_blocks": 64, "block_size": 16, "max_model_len": 512},
    )
    try:
        # min_tokens = max_tokens masks EOS exactly as HF's min_new_tokens does.
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

        async def main() -> tuple[list[GenerateChunk], float]:
            config = RouterConfig(max_local_prefill_tokens=0)
            router = await local_router(pools.workers, tokenizer, config=config)
            outs = await asyncio.gather(*(complete(router, p, params) for p in prompts))
            return outs, router.metrics.leases_lost._value.get()

        outs, leases_lost = asyncio.run(main())
        results = [out.choices[0].token_ids for out in outs]
        decode_stats = pools.stats()[1]
        assert decode_stats.kv_pull_fallbacks == 0 and decode_stats.kv_transfer_failures == 0
        assert decode_stats.kv_bytes_pulled > 0
        assert leases_lost == 0
        assert_whole(pools.workers)
    finally:
        pools.shutdown()

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for text, ids, result in zip(PROMPTS, prompts, results, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )
        assert result == ref[0, len(ids) :].tolist(), text
    for out, result in zip(outs, results, strict=True):
        assert out.choices[0].text == tokenizer.decode(result, skip_special_tokens=True)
