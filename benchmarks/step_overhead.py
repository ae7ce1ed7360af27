#!/usr/bin/env python
"""What serving costs on top of the engine: one stream's offline decode step time against its
time per output token through `kvrelay serve`, per dtype, measured in one run (issue 15).

For each dtype and serving mode `kvrelay serve` is started with the same model and dtype, its
workers on the threads `kvrelay serve` gives them by default (all cores colocated, half each
disaggregated) and the offline engine on as many, and --repeats pairs are run back to back:
the offline engine (kvrelay.llm.LLM, in this process, the server idle meanwhile) decodes one
greedy stream and every decode step is timed, then the same stream is sent to the server over
HTTP and its TPOT is the time from the first to the last token over the tokens in between.
Each pair's ratio is TPOT / median step; the table gives the medians. Pairing matters on a
shared host, whose speed drifts by 20-40% within minutes: an offline figure taken minutes
before the served one says little about it.
The target: serving TPOT within 10% of the offline step (a ratio <= 1.10).

    .venv/bin/python benchmarks/step_overhead.py
    .venv/bin/python benchmarks/step_overhead.py --dtypes float32 --modes colocated --repeats 5
    .venv/bin/python benchmarks/step_overhead.py --dtypes bfloat16 --quantization q4_1
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvrelay.models.quantized_loading import QUANTIZATIONS
from serving.decode_steps import decode_step_ms
from serving.servers import RunningServer, kvrelay_spec

PROMPT = "The history of the printing press begins"
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class Row:
    dtype: str  # and the weights' quantization, when there is one ("bfloat16, q4_1")
    threads: int  # torch threads of the offline engine and of each served worker
    offline_ms: float  # median decode step of the offline engine
    mode: str
    tpot_ms: float  # median time per output token through the server
    ratio: float  # median of the paired runs' TPOT / step


class OfflineStream:
    """One greedy stream at a time through the offline engine, in this process."""

    def __init__(
        self,
        model: str | None,
        dtype: str,
        tokens: int,
        quantization: str = "none",
        int8_activations: bool = False,
        threads: int | None = None,
    ) -> None:
        from kvrelay import SamplingParams
        from kvrelay.llm import LLM

        self.llm = LLM(
            model,
            dtype=dtype,
            quantization=quantization,
            int8_activations=int8_activations,
            num_threads=threads,
        )
        self.threads = threads
        self.prompt = self.llm.get_tokenizer().encode(PROMPT)
        self.params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        self._runs = 0
        self.step_ms()  # the first run warms caches and oneDNN's primitives

    def step_ms(self) -> float:
        """Median wall time of one decode step of a fresh stream, engine only."""
        if self.threads is not None:  # torch's count is per process: another engine's may hold
            import torch

            torch.set_num_threads(self.threads)
        self._runs += 1
        return decode_step_ms(self.llm.engine, self.prompt, self.params, f"offline-{self._runs}")

    def close(self) -> None:
        del self.llm
        gc.collect()


def served_tpot_ms(base_url: str, tokens: int) -> float:
    """One streamed completion's time per output token after the first, in ms.

    Read line by line with the standard library's http.client: the client shares the server's
    two cores, so its CPU is charged to the stream it times. httpx's streamed lines cost ~0.46
    ms of CPU a token there (measured on the 2-core EPYC, bf16: as much as the router spent).
    """
    payload = {"prompt": PROMPT, "max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True,
               "temperature": 0, "stream": True}  # fmt: skip
    url = urllib.parse.urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=600)
    arrivals: list[float] = []
    try:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/completions", json.dumps(payload), headers)
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"the server answered {reply.status}: {reply.read(300)!r}")
        for line in reply:  # lines of the chunked body, as they arrive
            data = line.removeprefix(b"data:").strip()
            if not data or data == b"[DONE]":
                continue
            if any(c.get("text") for c in json.loads(data).get("choices", [])):
                arrivals.append(time.perf_counter())
    finally:
        connection.close()
    if len(arrivals) < 2:
        raise RuntimeError(f"the server streamed {len(arrivals)} token chunks, expected {tokens}")
    return 1000 * (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def _descendants(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) of `root` and every process below it (Ray's GCS,
    raylet and workers are children of the serving process)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = {}, [root]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        name = cmd.rsplit("/", 1)[-1].split(" ")[0][:40] or "?"
        found[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_ms_per_token(root: int, base_url: str, tokens: int, streams: int) -> dict[str, float]:
    """CPU time each process of the server (by name) spends per output token of `streams`
    concurrent streams: a profile that load on the machine distorts less than wall times."""
    before = _descendants(root)
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda _: served_tpot_ms(base_url, tokens), range(streams)))
    after = _descendants(root)
    tokens *= streams
    spent: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        spent[name] = spent.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    return {name: 1000 * s / tokens for name, s in sorted(spent.items()) if s > 0}


def worker_threads(mode: str) -> int:
    """The torch threads `kvrelay serve` gives each worker by default in `mode`: the cores over
    its workers (one colocated; a prefill and a decode worker disaggregated). The offline
    engine of a row runs with as many, so that a row compares serving, not thread counts."""
    return max(1, (os.cpu_count() or 1) // (1 if mode == "colocated" else 2))


def paired_row(
    args: argparse.Namespace, dtype: str, mode: str, offline: OfflineStream | None, log_dir: Path
) -> Row:
    """--repeats (offline step, served TPOT) pairs, back to back, against one server whose
    workers run `worker_threads(mode)` threads, as `offline` does."""
    kvrelay_bin = shutil.which("kvrelay") or str(Path(sys.executable).parent / "kvrelay")
    threads = worker_threads(mode)
    flags = ("--dtype", dtype, "--quantization", args.quantization)
    flags += ("--worker-threads", str(threads))
    flags += ("--int8-activations",) if args.int8_activations else ()
    label = weights_label(dtype, args.quantization, args.int8_activations)
    spec = kvrelay_spec(f"kvrelay {mode} {label}", kvrelay_bin, mode == "colocated",
                        args.model, flags)  # fmt: skip
    steps: list[float] = []
    tpots: list[float] = []
    with RunningServer(spec, log_dir, ready_timeout=300) as server:
        served_tpot_ms(server.spec.base_url, 8)  # warm-up
        for _ in tqdm(range(args.repeats), desc=f"{mode} {label}", unit="pair"):
            steps.append(offline.step_ms() if offline is not None else float("nan"))
            tpots.append(served_tpot_ms(server.spec.base_url, args.tokens))
        assert server._process is not None
        for streams in args.cpu_profile:
            cpu = cpu_ms_per_token(server._process.pid, server.spec.base_url, args.tokens, streams)
            shown = ", ".join(f"{name} {ms:.1f}" for name, ms in cpu.items())
            total = sum(cpu.values())
            print(
                f"CPU ms per token, {mode} {label}, {streams} streams: {shown} (total {total:.1f})"
            )
    ratios = [tpot / step for step, tpot in zip(steps, tpots, strict=True)]
    median = statistics.median
    return Row(label, threads, median(steps), mode, median(tpots), median(ratios))


def weights_label(dtype: str, quantization: str, int8_activations: bool = False) -> str:
    """How a row names its weights: the dtype, and the quantization when there is one (with
    int8 activations, "int8" after it)."""
    label = dtype if quantization == "none" else f"{dtype}, {quantization}"
    return f"{label}, int8" if int8_activations else label


def table(rows: list[Row]) -> str:
    lines = [
        "| dtype | threads | offline step (ms) | serving mode | serving TPOT (ms) "
        "| overhead (ms) | TPOT / step (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dtype} | {r.threads} | {r.offline_ms:.1f} | {r.mode} | {r.tpot_ms:.1f} | "
            f"{r.tpot_ms - r.offline_ms:+.1f} | {r.ratio:.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model path (default: the embedded one)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated serving modes: disaggregated, colocated")  # fmt: skip
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                        help="weights kept quantized, offline and served alike (q4_1: the "
                             "default model's source GGUF)")  # fmt: skip
    parser.add_argument("--int8-activations", action="store_true",
                        help="with --quantization: int8 activations, offline and served "
                             "(llama.cpp's scheme, not exact)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--repeats", type=int, default=5,
                        help="offline/served pairs per row (medians)")  # fmt: skip
    parser.add_argument("--cpu-profile", type=lambda v: [int(n) for n in v.split(",")], default=[],
                        metavar="STREAMS",
                        help="also print CPU ms per output token per server process at these "
                             "concurrencies (e.g. 1,8)")  # fmt: skip
    parser.add_argument("--skip-offline", action="store_true",
                        help="serving figures only (the offline column reads nan)")  # fmt: skip
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as logs:
        for dtype in args.dtypes:
            offline: dict[int, OfflineStream] = {}  # one engine per thread count
            for mode in args.modes:
                threads = worker_threads(mode)
                if not args.skip_offline and threads not in offline:
                    offline[threads] = OfflineStream(args.model, dtype, args.tokens,
                                                     args.quantization, args.int8_activations,
                                                     threads)  # fmt: skip
                rows.append(paired_row(args, dtype, mode, offline.get(threads), Path(logs)))
            for stream in offline.values():
                stream.close()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
