#!/usr/bin/env python
"""Serving benchmark of any OpenAI-compatible server, with `vllm bench serve`'s metrics.

Random prompts (random token ids decoded by the model's tokenizer, fixed seed), streamed
requests with a fixed output length (ignore_eos + min_tokens where the server accepts them),
Poisson / gamma arrivals or all at once, an optional concurrency cap. Prints vLLM's result
table (TTFT, TPOT, ITL, E2EL; throughputs; goodput under SLOs) and optionally writes JSON.

    .venv/bin/kvrelay serve --http-port 8000 --grpc-port 50051 &
    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 32 --random-input-len 128 --random-output-len 64 --max-concurrency 16 \\
        --goodput ttft:2000 tpot:100 --metric-percentiles 50,90,99

To compare kvrelay (disaggregated and colocated) with llama.cpp on the same workload, see
benchmarks/serve_compare.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from serving.dataset import SampleRequest, random_requests
from serving.metrics import calculate_metrics, parse_goodput
from serving.openai_http import EndpointConfig
from serving.report import format_table, result_dict
from serving.runner import RunSettings, run_benchmark


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload and measurement flags, shared with serve_compare.py."""
    add = parser.add_argument
    add("--endpoint", default="/v1/completions", help="API path (default /v1/completions)")
    add("--dataset-name", default="random", choices=["random"], help="only random for now")
    add("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    add("--random-input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    add("--random-output-len", type=int, default=128, help="output tokens (default 128)")
    add(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from L*(1-r)..L*(1+r) (default 0: fixed)",
    )
    add(
        "--tokenizer",
        default=None,
        help="model folder whose tokenizer builds the prompts (default: kvrelay's default model)",
    )
    add(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; inf sends all at once (default inf)",
    )
    add(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 is Poisson, <1 burstier (default 1)",
    )
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add("--seed", type=int, default=0, help="seeds prompts and arrivals (default 0)")
    add("--num-warmups", type=int, default=0, help="untimed requests first (default 0)")
    add(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let EOS end outputs early (default: ask for exactly the output length)",
    )
    add(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)",
    )
    add(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics whose percentiles are shown (default ttft,tpot,itl,e2el)",
    )
    add(
        "--metric-percentiles",
        default="99",
        help="comma-separated percentiles, e.g. 50,90,99 (default 99)",
    )
    add("--disable-tqdm", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server URL (default %(default)s)")
    add("--model", default=None, help="model id to ask for (default: the server's first)")
    add("--result-json", default=None, help="write the results (vLLM's keys) to this file")
    add_workload_args(parser)
    return parser


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}")
    return values


def make_requests(args: argparse.Namespace) -> list[SampleRequest]:
    # Imported here: transformers takes seconds to import and --help must not wait for it.
    from kvrelay.models.default_model import default_model_dir
    from kvrelay.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_model_dir())
    return random_requests(
        tokenizer,
        num_prompts=args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
    )


async def first_model(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(f"{base_url.rstrip('/')}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


def settings_from(args: argparse.Namespace) -> RunSettings:
    return RunSettings(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        show_progress=not args.disable_tqdm,
    )


async def benchmark_one(
    args: argparse.Namespace,
    base_url: str,
    requests: list[SampleRequest],
    model: str | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the workload against one server, print vLLM's table, return the result dict."""
    goodput = parse_goodput(args.goodput or [])
    percentiles = parse_percentiles(args.metric_percentiles)
    model = model or args.model or await first_model(base_url)
    config = EndpointConfig(
        api_url=base_url.rstrip("/") + args.endpoint,
        model=model,
        ignore_eos=args.ignore_eos,
        extra_body=extra_body or {},
    )
    settings = settings_from(args)
    run = await run_benchmark(config, requests, settings)
    metrics = calculate_metrics(run.records, run.duration, percentiles, goodput)
    failures = [r.error for r in run.records if not r.success]
    if failures:
        print(f"{len(failures)} failed requests; the first: {failures[0]}")
    selected = tuple(args.percentile_metrics.split(","))
    print(format_table(metrics, run, settings, bool(goodput), selected))
    return result_dict(
        metrics,
        run,
        bool(goodput),
        {"base_url": base_url, "model_id": model, "num_prompts": len(requests)},
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_goodput(args.goodput or [])
        parse_percentiles(args.metric_percentiles)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    requests = make_requests(args)
    result = asyncio.run(benchmark_one(args, args.base_url, requests))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
