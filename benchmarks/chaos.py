#!/usr/bin/env python
"""Chaos benchmark (issue 13): steady streaming load on a `kvrelay serve` it starts, and a
`kill -9` of a random worker (prefill or decode) every --every seconds for --minutes minutes.

Before the chaos every request of the workload (greedy and seeded-random completions) runs once
undisturbed: its baseline. Under chaos each stream is compared with its baseline. Prints:
requests completed / migrated (the router's kvrelay_requests_migrated_total) / failed; the
migration's added latency as the client saw it (p50 / p99 of the largest inter-token gap of the
streams that lived through a kill, against p50 / p99 of the inter-token gaps of undisturbed
streams); per kill the time until the replacement joined and until /health was ready and a new
request was served; KV blocks and leases left after the run (must be 0); greedy (and seeded)
streams equal to their baseline. Exits 1 when blocks or leases leaked, a stream broke
mid-stream (a client noticed) or a greedy stream differed from its baseline.

    .venv/bin/python benchmarks/chaos.py --minutes 10 --every 30 --concurrency 4

The next kill waits until the previous victim has been replaced (so a kill never hits a dead
process), then for the rest of its --every interval. Worker pids come from the router's log
(`worker <id> (<role>, pid <pid>, ...) joined`).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from serving.outcomes import Stats, stream_text
from serving.processes import WORKER_JOINED
from serving.servers import RunningServer, ServerSpec, free_port

PROMPTS = (
    "Once upon a time in a small village at the foot of the mountains there lived an old "
    "clockmaker who",
    "The three most important ideas in the history of science are, in my opinion,",
    "Dear diary, today the weather was strange: in the morning it snowed, and then",
    "Write a short letter to a friend who has just moved to a city by the sea.",
    "Explain to a child why the sky is blue and why sunsets are red.",
)
ROLES = ("prefill", "decode")
KILLS_HEADER = (
    f"{'#':>3} {'at (s)':>8} {'role':>8} {'pid':>8} {'replaced (s)':>14} {'serving (s)':>14}"
)


@dataclass(frozen=True)
class Spec:
    """One request of the workload: greedy (seed None) or seeded random sampling."""

    prompt: str
    seed: int | None

    def payload(self, max_tokens: int) -> dict[str, object]:
        sampling = {"temperature": 0.0} if self.seed is None else {"temperature": 0.8,
                                                                   "seed": self.seed}  # fmt: skip
        return {"prompt": self.prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, **sampling}  # fmt: skip


def workload(size: int) -> list[Spec]:
    """`size` requests: even ones greedy, odd ones seeded."""
    return [Spec(PROMPTS[i % len(PROMPTS)], None if i % 2 == 0 else 1000 + i) for i in range(size)]


@dataclass
class Result:
    spec: int  # index in the workload
    start: float
    end: float
    pieces: list[str] | None  # None: refused or broken (counted in Stats)
    gaps: list[float]


@dataclass
class KillRecord:
    role: str
    pid: int
    at: float
    replaced_s: float | None = None  # the replacement's `joined` line appeared
    serving_s: float | None = None  # then /health 200 and a new request answered 200


@dataclass
class Run:
    stats: Stats = field(default_factory=Stats)
    results: list[Result] = field(default_factory=list)
    kills: list[KillRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def wait_until(check: Callable[[], object], timeout_s: float, every_s: float = 0.1) -> bool:
    """Poll `check` until it is truthy (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


def current_worker(log_path: Path, role: str) -> int | None:
    """The pid of the last worker of `role` that joined, from the router's log."""
    text = log_path.read_text(errors="replace")
    joined = [m for m in WORKER_JOINED.finditer(text) if m["role"] == role]
    return int(joined[-1]["pid"]) if joined else None


def one_stream(client: httpx.Client, url: str, specs: list[Spec], index: int, run: Run,
               max_tokens: int) -> Result:  # fmt: skip
    start = time.monotonic()
    got = stream_text(client, url, specs[index].payload(max_tokens), run.stats)
    pieces, gaps = got if got is not None else (None, [])
    return Result(index, start, time.monotonic(), pieces, gaps)


def client_loop(url: str, specs: list[Spec], run: Run, stop: threading.Event, seed: int,
                max_tokens: int) -> None:  # fmt: skip
    rng = random.Random(seed)
    with httpx.Client() as client:
        while not stop.is_set():
            result = one_stream(client, url, specs, rng.randrange(len(specs)), run, max_tokens)
            with run.lock:
                run.results.append(result)
            if result.pieces is None:
                stop.wait(0.5)  # refused (no decode worker) or broken: do not spin


def baseline(url: str, specs: list[Spec], max_tokens: int, concurrency: int) -> list[list[str]]:
    """Every request once, undisturbed, `concurrency` at a time."""
    run, todo = Run(), list(range(len(specs)))

    def worker() -> None:
        with httpx.Client() as client:
            while True:
                with run.lock:
                    if not todo:
                        return
                    index = todo.pop()
                result = one_stream(client, url, specs, index, run, max_tokens)
                with run.lock:
                    run.results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pieces = {r.spec: r.pieces for r in run.results}
    if any(pieces[i] is None for i in range(len(specs))):
        raise SystemExit(f"the undisturbed baseline failed: {run.stats.failures}")
    return [pieces[i] or [] for i in range(len(specs))]


def serves(url: str) -> bool:
    """/health is 200 and a short new request is answered 200."""
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code != 200:
            return False
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    except httpx.HTTPError:
        return False


def kill_one(url: str, log_path: Path, rng: random.Random, run: Run) -> KillRecord | None:
    """kill -9 a random worker; wait for its replacement and for service (120 s at most)."""
    role = rng.choice(ROLES)
    pid = current_worker(log_path, role)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    kill = KillRecord(role, pid, time.monotonic())
    with run.lock:
        run.kills.append(kill)
    if wait_until(lambda: current_worker(log_path, role) not in (pid, None), 120):
        kill.replaced_s = time.monotonic() - kill.at
        if wait_until(lambda: serves(url), 120, every_s=0.3):
            kill.serving_s = time.monotonic() - kill.at
    return kill


def chaos_loop(url: str, log_path: Path, args: argparse.Namespace, run: Run,
               stop: threading.Event) -> None:  # fmt: skip
    rng = random.Random(args.seed)
    while not stop.wait(args.every):
        kill_one(url, log_path, rng, run)


def drive(url: str, log_path: Path, args: argparse.Namespace, specs: list[Spec]) -> Run:
    """The load and the kills for --minutes, with a progress line; returns what happened."""
    run, stop, chaos_stop = Run(), threading.Event(), threading.Event()
    clients = [
        threading.Thread(target=client_loop,
                         args=(url, specs, run, stop, args.seed + i, args.max_tokens))
        for i in range(args.concurrency)
    ]  # fmt: skip
    killer = threading.Thread(target=chaos_loop, args=(url, log_path, args, run, chaos_stop))
    for thread in [*clients, killer]:
        thread.start()
    total_s = args.minutes * 60
    started = time.monotonic()
    bar = tqdm(total=round(total_s), unit="s", desc="chaos", disable=args.no_progress)
    while (elapsed := time.monotonic() - started) < total_s:
        time.sleep(min(1.0, total_s - elapsed))
        bar.n = min(round(time.monotonic() - started), bar.total)
        with run.lock:
            done = sum(r.pieces is not None for r in run.results)
            bar.set_postfix(kills=len(run.kills), completed=done, failed=len(run.stats.failures))
    bar.close()
    chaos_stop.set()
    killer.join()  # a kill in progress is waited for (its replacement is measured)
    stop.set()
    for thread in clients:
        thread.join()
    return run


def gauge_sum(text: str, name: str, pool: str | None = None) -> float:
    pools = pool or r"\w+"
    pattern = rf'^{name}\{{pool="({pools})"\}} (\S+)$'
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))


def counter_value(text: str, name: str, outcome: str) -> float:
    match = re.search(rf'^{name}\{{outcome="{outcome}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def leftovers(url: str, num_blocks: int, timeout_s: float = 30.0) -> tuple[int, int, str]:
    """(KV blocks in use, leases held) once they drop to 0 or at the deadline, and /metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        blocks = sum(
            round(gauge_sum(text, "kvrelay_kv_cache_usage_ratio", pool) * num_blocks
                  * gauge_sum(text, "kvrelay_pool_workers", pool))
            for pool in ("prefill", "decode", "colocated")
        )  # fmt: skip
        leases = round(gauge_sum(text, "kvrelay_kv_leases"))
        if (blocks == 0 and leases == 0) or time.monotonic() >= deadline:
            return blocks, leases, text


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


@dataclass
class Outcome:
    """What the report says, in numbers (the exit status comes from `passed`)."""

    completed: int
    disturbed: int
    failed: int
    refused: int
    greedy: tuple[int, int]  # (equal to baseline, compared)
    seeded: tuple[int, int]
    blocks: int
    leases: int

    @property
    def passed(self) -> bool:
        equal = self.greedy[0] == self.greedy[1]
        return self.blocks == 0 and self.leases == 0 and equal and self.failed == 0


def judge(run: Run, specs: list[Spec], base: list[list[str]], left: tuple[int, int]) -> Outcome:
    done = [r for r in run.results if r.pieces is not None]
    kills = [k.at for k in run.kills]
    disturbed = [r for r in done if any(r.start <= t <= r.end for t in kills)]
    greedy = [r for r in done if specs[r.spec].seed is None]
    seeded = [r for r in done if specs[r.spec].seed is not None]
    outcomes = run.stats.outcomes
    return Outcome(
        completed=len(done),
        disturbed=len(disturbed),
        failed=sum(n for o, n in outcomes.items() if o.startswith("broken")),
        refused=sum(n for o, n in outcomes.items() if o.startswith("HTTP") and o != "HTTP 200"),
        greedy=(sum(r.pieces == base[r.spec] for r in greedy), len(greedy)),
        seeded=(sum(r.pieces == base[r.spec] for r in seeded), len(seeded)),
        blocks=left[0],
        leases=left[1],
    )


def latency_rows(run: Run) -> list[tuple[str, str]]:
    kills = [k.at for k in run.kills]
    done = [r for r in run.results if r.pieces is not None and r.gaps]
    hit = [max(r.gaps) * 1000 for r in done if any(r.start <= t <= r.end for t in kills)]
    calm = [g * 1000 for r in done if not any(r.start <= t <= r.end for t in kills)
            for g in r.gaps]  # fmt: skip
    return [
        ("P50 largest gap, streams through a kill (ms):", f"{percentile(hit, 50):.0f}"),
        ("P99 largest gap, streams through a kill (ms):", f"{percentile(hit, 99):.0f}"),
        ("P50 inter-token gap, undisturbed (ms):", f"{percentile(calm, 50):.0f}"),
        ("P99 inter-token gap, undisturbed (ms):", f"{percentile(calm, 99):.0f}"),
    ]


def report(args: argparse.Namespace, run: Run, outcome: Outcome, metrics: str) -> str:
    row = "{:<50}{:>18}".format
    roles = [sum(k.role == r for k in run.kills) for r in ROLES]
    lines = ["{:=^68}".format(" kvrelay chaos "),
             row("Duration (min):", f"{args.minutes:g}"),
             row("Kill every (s) / clients:", f"{args.every:g} / {args.concurrency}"),
             row("Kills (prefill / decode):", f"{roles[0]} / {roles[1]}"),
             "{:-^68}".format(" requests "),
             row("Completed:", outcome.completed),
             row("  of which lived through a kill:", outcome.disturbed),
             row("Migrated (router, resumed):",
                 f"{counter_value(metrics, 'kvrelay_requests_migrated_total', 'resumed'):.0f}"),
             row("Migrations failed (router):",
                 f"{counter_value(metrics, 'kvrelay_requests_migrated_total', 'failed'):.0f}"),
             row("Failed (broken mid-stream):", outcome.failed),
             row("Refused before a token (503 / 429):", outcome.refused),
             "{:-^68}".format(" migration latency, as clients saw it "),
             *(row(k, v) for k, v in latency_rows(run)),
             "{:-^68}".format(" kills "),
             KILLS_HEADER]  # fmt: skip
    first = run.kills[0].at if run.kills else 0.0
    for i, k in enumerate(run.kills, 1):
        replaced, serving = (f"{v:.1f}" if v is not None else "never" for v in
                             (k.replaced_s, k.serving_s))  # fmt: skip
        lines.append(f"{i:>3} {k.at - first:>8.1f} {k.role:>8} {k.pid:>8} {replaced:>14} "
                     f"{serving:>14}")  # fmt: skip
    lines += ["{:-^68}".format(" verdict "),
              row("Leaked KV blocks (must be 0):", outcome.blocks),
              row("KV leases left (must be 0):", outcome.leases),
              row("Greedy streams equal to baseline:", verdict(outcome.greedy)),
              row("Seeded streams equal to baseline:", verdict(outcome.seeded)),
              *(f"failure: {f}" for f in run.stats.failures), "=" * 68]  # fmt: skip
    return "\n".join(lines)


def verdict(counts: tuple[int, int]) -> str:
    return f"{'yes' if counts[0] == counts[1] else 'no'} ({counts[0]}/{counts[1]})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Steady streaming load on a kvrelay serve started here, and kill -9 of a "
        "random worker every --every seconds: requests completed / migrated / failed, the gap "
        "clients saw, time to replacement, leaked KV blocks. Exits 1 when blocks or leases "
        "leaked or a greedy stream differed from its undisturbed run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--minutes", type=float, default=10.0, help="how long the chaos lasts")
    add("--every", type=float, default=30.0,
        help="seconds between kills (each waits for the last victim's replacement)")  # fmt: skip
    add("--concurrency", type=int, default=4, help="streaming clients")
    add("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    add("--requests", type=int, default=None,
        help="distinct requests in the workload, half greedy, half seeded; "
             "None: 2 x --concurrency")  # fmt: skip
    add("--num-blocks", type=int, default=512, help="KV blocks per worker (serve --num-blocks)")
    add("--local-prefill-tokens", type=int, default=0,
        help="serve --max-local-prefill-tokens: 0 sends every prompt through the prefill "
             "worker, so that its kills hit requests")  # fmt: skip
    add("--serve-arg", action="append", default=[],
        help="extra `kvrelay serve` argument (repeatable): --serve-arg=--num-decode=2")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of the kills and the clients' choices")
    add("--no-progress", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.every <= 0 or args.concurrency < 1:
        parser.error("--minutes, --every and --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kvrelay = shutil.which("kvrelay") or str(Path(sys.executable).with_name("kvrelay"))
    http_port, grpc_port = free_port(), free_port()
    command = [kvrelay, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--num-blocks", str(args.num_blocks), "--max-local-prefill-tokens",
               str(args.local_prefill_tokens), *args.serve_arg]  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    specs = workload(args.requests or 2 * args.concurrency)
    with (
        tempfile.TemporaryDirectory() as logs,
        RunningServer(ServerSpec("kvrelay", command, url, "/health"), Path(logs), 600) as server,
    ):
        base = baseline(url, specs, args.max_tokens, args.concurrency)
        run = drive(url, server.log_path, args, specs)
        blocks, leases, metrics = leftovers(url, args.num_blocks)
        outcome = judge(run, specs, base, (blocks, leases))
        print(report(args, run, outcome, metrics), flush=True)
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    sys.exit(main())
