#!/usr/bin/env python
"""Offline throughput: kvrelay's continuous batching vs Hugging Face `generate` static batches.

One run, same model, same prompts: 64 requests with prompt lengths 16-512 and output lengths
16-256 (EOS ignored, fixed seed), then single-stream decode. Prints tokens/s of each and the
ratio to the best Hugging Face figure measured in the same run.

    .venv/bin/python benchmarks/offline_throughput.py            # the full workload
    .venv/bin/python benchmarks/offline_throughput.py --quick    # 16 requests, a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 512))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_requests)])


def run_kvrelay(llm: object, work: Workload) -> float:
    """Seconds to generate the whole workload in one continuous batch."""
    from kvrelay import SamplingParams
    from kvrelay.llm import LLM

    assert isinstance(llm, LLM)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert got == work.output_tokens, (
        f"kvrelay produced {got} tokens, expected {work.output_tokens}"
    )
    return elapsed


def run_hf(model: torch.nn.Module, work: Workload, batch_size: int, pad_id: int) -> float:
    """Seconds for HF `generate` in static batches: left-padded prompts, each batch runs to its
    longest requested output (shorter requests' extra tokens are wasted work, as in real use)."""
    start = time.perf_counter()
    batches = range(0, len(work.prompts), batch_size)
    for lo in tqdm(batches, desc=f"hf batch {batch_size}", unit="batch"):
        prompts = work.prompts[lo : lo + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(work.output_lens[lo : lo + batch_size])
        with torch.inference_mode():
            model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def single_stream(
    llm: object, model: torch.nn.Module, tokens: int, repeats: int
) -> tuple[float, float]:
    """Decode tokens/s of one stream (16-token prompt), kvrelay and HF, medians of `repeats`."""
    from kvrelay import SamplingParams
    from kvrelay.llm import LLM

    assert isinstance(llm, LLM)
    prompt = list(range(1000, 1016))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ours, theirs = [], []
    for _ in tqdm(range(repeats), desc="single stream", unit="run"):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ours.append(tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(  # type: ignore[operator]
                input_ids=torch.tensor([prompt]),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        theirs.append(tokens / (time.perf_counter() - start))
    return statistics.median(ours), statistics.median(theirs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder (default: the embedded default)"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 requests, HF batch 8 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-batch-sizes", default="8,32", help="comma-separated static batch sizes"
    )
    parser.add_argument(
        "--single-tokens", type=int, default=128, help="tokens per single-stream run"
    )
    parser.add_argument("--repeats", type=int, default=3, help="single-stream repeats (median)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both sides' dtype (default float32; kvrelay's auto would be bf16 on some CPUs)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.hf_batch_sizes, args.repeats = 16, "8", 1
    return args


def print_report(rows: list[tuple[str, float]], single_ours: float, single_hf: float) -> None:
    """The mixed-workload table (rows[0] is kvrelay's), then the single-stream one."""
    ours = rows[0][1]
    best_hf = max(rate for _, rate in rows[1:])
    print("\n| run | output tokens/s | vs best HF |")
    print("|---|---:|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} | {rate / best_hf:.2f}x |")
    print("\n| single stream decode | tokens/s | ratio |")
    print("|---|---:|---:|")
    print(f"| kvrelay | {single_ours:.1f} | {single_ours / single_hf:.2f}x |")
    print(f"| HF generate, batch 1 | {single_hf:.1f} | 1.00x |")
    print(f"\nmixed workload: kvrelay / best HF = {ours / best_hf:.2f}x (target >= 2x)")
    print(f"single stream: kvrelay / HF = {single_ours / single_hf:.2f}x (target >= 2x)")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from kvrelay.llm import LLM
    from kvrelay.models.default_model import pull_default_model

    path = args.model or str(pull_default_model())
    llm = LLM(
        path,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory="2GiB",
        dtype=args.dtype,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    work = make_workload(args.num_requests, llm.engine.config.model_config.vocab_size, args.seed)
    print(
        f"workload: {len(work.prompts)} requests, {sum(map(len, work.prompts))} prompt tokens, "
        f"{work.output_tokens} output tokens; torch threads {torch.get_num_threads()}"
    )

    rows = [("kvrelay continuous batching", work.output_tokens / run_kvrelay(llm, work))]
    for size in (int(s) for s in args.hf_batch_sizes.split(",")):
        rate = work.output_tokens / run_hf(hf, work, size, pad_id=0)
        rows.append((f"HF generate, static batch {size}", rate))
    single_ours, single_hf = single_stream(llm, hf, args.single_tokens, args.repeats)
    print_report(rows, single_ours, single_hf)


if __name__ == "__main__":
    main()
