#!/usr/bin/env python
"""Prefix caching: time to first token and throughput with the cache on vs off, one run.

The default model; 64 requests submitted at once, each one of 4 shared ~512-token prefixes
plus ~32 unique tokens (random token ids, fixed seed), 32 output tokens each (EOS ignored).
Prints a markdown table of median / p90 TTFT and total throughput (prompt + output tokens per
second) for both, and the ratios measured in the same run.

    .venv/bin/python benchmarks/prefix_cache.py            # the full workload
    .venv/bin/python benchmarks/prefix_cache.py --quick    # 16 requests of shorter prompts
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm


@dataclass(frozen=True)
class Result:
    ttfts: list[float]  # seconds, one per request
    elapsed: float  # seconds from submission to the last token
    total_tokens: int  # prompt + output tokens
    hit_tokens: int

    @property
    def throughput(self) -> float:
        return self.total_tokens / self.elapsed

    def ttft_percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(count)]

    prefixes = [tokens(args.prefix_len + rng.randint(-8, 8)) for _ in range(args.num_prefixes)]
    return [
        prefixes[i % args.num_prefixes] + tokens(args.unique_len + rng.randint(-4, 4))
        for i in range(args.num_requests)
    ]


def run(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> Result:
    from kvrelay import SamplingParams
    from kvrelay.engine.args import EngineArgs

    engine = EngineArgs(
        model=args.model,
        enable_prefix_caching=caching,
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
    ).create_engine()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("warmup", prompts[0][:16], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()  # the warm-up must not seed the cache
    stats_before = engine.stats()
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    ttfts: dict[str, float] = {}
    output_tokens = 0
    label = "cache on" if caching else "cache off"
    with tqdm(total=len(prompts), desc=label, unit="req") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in ttfts and "first_token_time" in out.metrics:
                    ttfts[out.request_id] = (
                        out.metrics["first_token_time"] - out.metrics["arrival_time"]
                    )
                if out.finished:
                    output_tokens += len(out.outputs[0].token_ids)
                    bar.update(1)
    elapsed = time.monotonic() - start
    expected = args.output_len * len(prompts)
    assert output_tokens == expected, f"{output_tokens} output tokens, expected {expected}"
    hits = engine.stats().prefix_cache_hits - stats_before.prefix_cache_hits
    total = sum(len(p) for p in prompts) + output_tokens
    return Result([ttfts[str(i)] for i in range(len(prompts))], elapsed, total, hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512, help="shared tokens (about)")
    parser.add_argument("--unique-len", type=int, default=32, help="unique tokens (about)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 requests, 128-token prefixes")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.prefix_len = 16, 128
    if args.model is None:
        from kvrelay.models.default_model import pull_default_model

        args.model = str(pull_default_model(progress=True))
    from kvrelay.config import ModelConfig

    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    prompts = make_prompts(args, vocab)
    on = run(args, prompts, caching=True)
    off = run(args, prompts, caching=False)

    print(
        f"\n{len(prompts)} requests, {args.num_prefixes} shared prefixes of ~{args.prefix_len} "
        f"tokens + ~{args.unique_len} unique, {args.output_len} output tokens each\n"
    )
    print("| prefix cache | median TTFT (s) | p90 TTFT (s) | throughput (tok/s) | hit tokens |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("on", on), ("off", off)):
        print(
            f"| {name} | {statistics.median(r.ttfts):.2f} | {r.ttft_percentile(0.9):.2f} "
            f"| {r.throughput:.1f} | {r.hit_tokens} |"
        )
    print(
        f"| **off / on** | **{statistics.median(off.ttfts) / statistics.median(on.ttfts):.2f}x** "
        f"| **{off.ttft_percentile(0.9) / on.ttft_percentile(0.9):.2f}x** "
        f"| **{on.throughput / off.throughput:.2f}x** (on / off) | |"
    )


if __name__ == "__main__":
    main()
