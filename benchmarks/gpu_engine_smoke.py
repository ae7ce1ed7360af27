#!/usr/bin/env python
"""A short engine run on a tiny random-weight Llama with the `auto` attention backend:
checks that the engine starts, logs its backend choice and generates. Run by gpu_check.sh.

    python benchmarks/gpu_engine_smoke.py --steps 32
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrelay.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvrelay.engine.engine import Engine
    from kvrelay.engine.sampling import SamplingParams
    from kvrelay.models.loader import load_model
    from kvrelay_kernels import select_backend

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
        backend = select_backend(args.backend)
        model, model_config = load_model(path, backend)
        model.prepack()
        engine = Engine(
            EngineConfig(
                model=str(path),
                model_config=model_config,
                cache=CacheConfig(block_size=16, num_blocks=256),
                scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
                max_model_len=256,
            ),
            model,
            tokenizer=None,
        )
        for i in range(args.requests):
            prompt = [(i * 7 + j) % 1000 + 3 for j in range(20 + 5 * i)]
            engine.add_request(
                str(i), prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            )
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens += len(output.outputs[0].token_ids)
        elapsed = time.perf_counter() - start
    print(f"engine smoke: backend={backend.name} tokens={tokens} in {elapsed:.2f} s")
    return 0 if tokens == args.requests * args.max_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
