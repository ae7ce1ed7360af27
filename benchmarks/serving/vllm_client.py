"""vLLM's own client, `vllm bench serve`, pointed at any server: its command line, its run
(the API key passed as OPENAI_API_KEY, as vLLM's client reads it) and its result JSON read
back into the few numbers serve_compare.py tabulates."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    """What every server is asked: the same random prompts (fixed seed), fixed lengths."""

    input_len: int = 128
    output_len: int = 128
    prompts_per_stream: int = 4  # --num-prompts = this x concurrency ...
    fixed_prompts: int | None = None  # ... unless this is set
    seed: int = 0

    def num_prompts(self, concurrency: int) -> int:
        return self.fixed_prompts or self.prompts_per_stream * concurrency


@dataclass(frozen=True)
class Point:
    """One server at one concurrency, as vLLM's client measured it."""

    concurrency: int
    output_throughput: float  # tok/s
    median_ttft_ms: float
    p99_itl_ms: float
    median_tpot_ms: float
    completed: int
    failed: int
    duration_s: float
    cores_busy: float | None = None  # the server's CPU seconds / wall seconds, when measured


def bench_command(
    vllm_bin: Path,
    base_url: str,
    served_model: str,
    tokenizer: Path,
    concurrency: int,
    workload: Workload,
    result_dir: Path,
    result_file: str,
) -> list[str]:
    """`vllm bench serve` on /v1/completions (the OpenAI completions backend: every server
    here serves it), random dataset, EOS ignored so every output has the same length."""
    return [
        str(vllm_bin),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        served_model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--ignore-eos",
        # Greedy everywhere: the client no longer sends temperature 0 by itself, and each
        # server's own default (llama-server 0.8 with top-k/top-p, ...) costs differently.
        "--temperature",
        "0",
        "--num-prompts",
        str(workload.num_prompts(concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        str(workload.seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]


def bench_env(api_key: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The client's environment: ours, plus the key it sends as `Authorization: Bearer`, no
    proxy for the loopback servers, and vLLM's CPU platform: without it vLLM's generic
    platform loads the AVX512-BF16 build of its kernels, and the client dies of SIGILL on a
    CPU with AVX2 only."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def parse_result(data: dict[str, Any], concurrency: int) -> Point:
    """The numbers of one `--save-result` JSON. Older vLLMs have no "failed" key: then the
    requests with an error message are the failed ones."""
    failed = data.get("failed")
    if failed is None:
        failed = sum(1 for e in data.get("errors", []) if e)
    return Point(
        concurrency=concurrency,
        output_throughput=float(data["output_throughput"]),
        median_ttft_ms=float(data["median_ttft_ms"]),
        p99_itl_ms=float(data["p99_itl_ms"]),
        median_tpot_ms=float(data["median_tpot_ms"]),
        completed=int(data["completed"]),
        failed=int(failed),
        duration_s=float(data["duration"]),
    )


def run_bench(
    command: list[str], env: dict[str, str], result_path: Path, log_path: Path, timeout: float
) -> dict[str, Any]:
    """Run the client (its output appended to `log_path`) and return its result JSON; a
    RuntimeError naming the log when it fails or writes none."""
    result_path.unlink(missing_ok=True)
    with log_path.open("a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        try:
            done = subprocess.run(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"vllm bench serve ran past {timeout:.0f} s; see {log_path}"
            ) from exc
    if done.returncode != 0 or not result_path.is_file():
        raise RuntimeError(
            f"vllm bench serve exited with {done.returncode} and "
            f"{'a' if result_path.is_file() else 'no'} result file; its log: {log_path}"
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result
