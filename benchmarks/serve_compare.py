#!/usr/bin/env python
"""kvrelay vs llama.cpp on one workload: each server started here, measured alone, stopped.

(a) `kvrelay serve` disaggregated (1 prefill + 1 decode worker), (b) `kvrelay serve
--colocated`, (c) llama-cpp-python's OpenAI server on the same model's GGUF (2 threads), when a
Python with `llama_cpp` is given, and (d) llama.cpp's C++ `llama-server` with 16 parallel
slots and continuous batching, when its binary is given (the stronger peer: ratios are taken
to it when it ran). Same random prompts (fixed seed), streamed, fixed output
lengths, --max-concurrency 16. Prints each server's vLLM-style table, then one comparison
table with the ratios to llama.cpp measured in the same run (the machine is shared and noisy:
the ratios are the result, not the absolute numbers).

    .venv/bin/python benchmarks/serve_compare.py --llama-cpp-python /work/llamacpp-venv/bin/python

llama.cpp's peer is never a project dependency; build it in its own venv (10-13 minutes):
    python3 -m venv /work/llamacpp-venv
    nice -n 19 /work/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve import add_workload_args, benchmark_one, make_requests
from serving.servers import (
    RunningServer,
    ServerSpec,
    kvrelay_spec,
    llama_cpp_spec,
    llama_server_spec,
)

SERVERS = ("disaggregated", "colocated", "llama.cpp", "llama-server")
LLAMA = "llama.cpp"
LLAMA_SERVER = "llama.cpp server"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma-separated subset of {','.join(SERVERS)} (default all)",
    )
    add("--kvrelay-bin", default=None, help="the kvrelay command (default: next to this Python)")
    add("--model", default=None, help="kvrelay's --model folder (default: the default model)")
    add(
        "--llama-cpp-python",
        default=None,
        help="a Python with llama-cpp-python[server]; without it llama.cpp is skipped",
    )
    add(
        "--llama-server",
        default=None,
        help="llama.cpp's llama-server binary (cmake --build build --target llama-server); "
        "without it that peer is skipped",
    )
    add("--llama-parallel", type=int, default=16, help="llama-server slots (default 16)")
    add("--gguf", default=None, help="GGUF for llama.cpp (default: the default model's source)")
    add("--llama-cpp-threads", type=int, default=2, help="llama.cpp --n_threads (default 2)")
    add("--ready-timeout", type=float, default=600.0, help="seconds to wait for each server")
    add("--log-dir", default="/tmp/kvrelay-serve-compare", help="server logs go here")
    add("--result-json", default=None, help="write every server's results to this file")
    add_workload_args(parser)
    # A workload that finishes in minutes on 2 CPU cores; the cap is the target.
    parser.set_defaults(
        num_prompts=32, random_input_len=128, random_output_len=64, max_concurrency=16
    )
    return parser


def default_gguf() -> Path:
    from kvrelay.models.default_model import SOURCE_GGUF, default_model_dir

    return default_model_dir() / SOURCE_GGUF


def llama_cpp_ready(python: str | None) -> str | None:
    """Why llama.cpp cannot run (None when it can)."""
    if python is None:
        return (
            "no --llama-cpp-python given; build one outside the project: python3 -m venv "
            "/work/llamacpp-venv && nice -n 19 /work/llamacpp-venv/bin/pip install "
            "'llama-cpp-python[server]'"
        )
    probe = subprocess.run(
        [python, "-c", "import llama_cpp.server"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return f"{python} cannot import llama_cpp.server: {probe.stderr.strip()[-300:]}"
    return None


def eos_ids(args: argparse.Namespace) -> list[int]:
    from kvrelay.models.default_model import default_model_dir
    from kvrelay.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_model_dir())
    return sorted(set(tokenizer.all_special_ids) | {tokenizer.eos_token_id} - {None})


def plan(args: argparse.Namespace) -> list[ServerSpec]:
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(wanted) - set(SERVERS)
    if unknown:
        raise SystemExit(f"unknown --servers {sorted(unknown)}; choose from {SERVERS}")
    kvrelay_bin = args.kvrelay_bin or str(Path(sys.executable).parent / "kvrelay")
    if not Path(kvrelay_bin).exists():
        kvrelay_bin = shutil.which("kvrelay") or kvrelay_bin
    specs = []
    if "disaggregated" in wanted:
        specs.append(kvrelay_spec("kvrelay disaggregated", kvrelay_bin, False, args.model))
    if "colocated" in wanted:
        specs.append(kvrelay_spec("kvrelay colocated", kvrelay_bin, True, args.model))
    if LLAMA in wanted:
        why_not = llama_cpp_ready(args.llama_cpp_python)
        if why_not:
            print(f"skipping llama.cpp: {why_not}")
        else:
            gguf = Path(args.gguf) if args.gguf else default_gguf()
            if not gguf.is_file():
                raise SystemExit(f"no GGUF at {gguf}; run `kvrelay model pull-default`")
            specs.append(
                llama_cpp_spec(args.llama_cpp_python, gguf, args.llama_cpp_threads, eos_ids(args))
            )
    if "llama-server" in wanted:
        if args.llama_server is None or not Path(args.llama_server).is_file():
            print("skipping llama-server: give --llama-server PATH to llama.cpp's binary")
        else:
            gguf = Path(args.gguf) if args.gguf else default_gguf()
            specs.append(
                llama_server_spec(
                    args.llama_server, gguf, args.llama_cpp_threads, args.llama_parallel
                )
            )
    return specs


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: output tok/s, median TTFT and TPOT per server, each with its ratio to the
    llama.cpp peer — llama-server when it ran, else llama-cpp-python (throughput: higher is
    better; latencies: lower is better)."""
    peer = LLAMA_SERVER if LLAMA_SERVER in results else LLAMA
    base = results.get(peer)
    rows = [
        f"| server | output tok/s | vs {peer} | median TTFT ms | vs {peer} "
        f"| median TPOT ms | vs {peer} | ok/failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['output_throughput']:.1f} "
            f"| {_ratio(r['output_throughput'], base and base['output_throughput'])} "
            f"| {r['median_ttft_ms']:.0f} "
            f"| {_ratio(r['median_ttft_ms'], base and base['median_ttft_ms'])} "
            f"| {r['median_tpot_ms']:.1f} "
            f"| {_ratio(r['median_tpot_ms'], base and base['median_tpot_ms'])} "
            f"| {r['completed']}/{r['failed']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    specs = plan(args)
    if not specs:
        print("nothing to run")
        return 1
    requests = make_requests(args)
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for spec in specs:
        print(f"\n### {spec.name}: {' '.join(spec.command)}")
        try:
            with RunningServer(spec, Path(args.log_dir), args.ready_timeout):
                results[spec.name] = asyncio.run(
                    benchmark_one(args, spec.base_url, requests, None, spec.extra_body)
                )
        except (RuntimeError, TimeoutError) as exc:
            # One server failing must not lose the others' measurements.
            errors[spec.name] = str(exc)
            print(f"{spec.name} failed: {exc}")
    print(
        f"\n{len(requests)} requests, input {args.random_input_len} / output "
        f"{args.random_output_len} tokens, max concurrency {args.max_concurrency}, seed "
        f"{args.seed}"
    )
    if results:
        print(comparison_table(results))
    for name, error in errors.items():
        print(f"{name}: FAILED: {error}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"results": results, "errors": errors}))
        print(f"wrote {args.result_json}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
