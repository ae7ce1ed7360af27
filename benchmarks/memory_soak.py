#!/usr/bin/env python
"""Memory soak: steady mixed traffic against `kvrelay serve` for N minutes while the RSS of
the serve (router) process and of every engine worker is sampled, to tell a leak from memory
that levels off (issues 13 and 41).

The traffic churns the prefill worker's KV blocks: prompts of varied length (most past
--max-local-prefill-tokens, so they are relayed), some sharing a long prefix (prefix-cache
hits) and some not, streams and non-streams, chat and completions, n = 2 now and then, and
clients that hang up mid-stream. Workers are told apart by the router's log line
`worker <engine_id> (<role>, pid <pid>, ...) joined`.

Prints RSS over time per process (MiB), then per process its RSS at the start, once warmed
up (--warm-up-min) and at the end, the slope of the samples after the warm-up (least squares,
MiB per hour) and a verdict: "flat" when that slope is at most --max-mib-per-hour (issue 41's
target: 10), else "growing". With --probe the workers also write their memory probe
(services/kvrelay/worker/memory_probe.py: glibc's heap, objects, per-request structures) and
the report ends with what changed in each after the warm-up.

    .venv/bin/python benchmarks/memory_soak.py --minutes 30 --concurrency 8 --probe /tmp/probe
    .venv/bin/python benchmarks/memory_soak.py --url http://127.0.0.1:8000 \\
        --server-log serve.log --minutes 5 --sample-s 10
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serving.probe_report import probe_report
from serving.processes import WORKER_JOINED, listening_pid, process_tree, rss_mib
from serving.servers import RunningServer, ServerSpec, free_port

WORDS = ("river", "stone", "cloud", "paper", "garden", "engine", "silver", "orange", "window",
         "mountain", "letter", "bright", "quiet", "market", "winter", "signal", "forest",
         "basket", "rocket", "candle", "harbor", "planet", "violin")  # fmt: skip
SERVE = "serve"


@dataclass
class Counts:
    """Requests by outcome, shared by the client threads."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def total(self) -> int:
        with self.lock:
            return sum(self.outcomes.values())


def make_prefixes(rng: random.Random, count: int = 6) -> list[str]:
    """Long shared system-like prefixes (about 150-400 tokens each): prefix-cache hits."""
    return [
        f"System {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(120, 320)))
        for i in range(count)
    ]


def make_request(rng: random.Random, prefixes: list[str]) -> tuple[str, dict[str, Any], bool]:
    """(path, body, cancel mid-stream) of one request of the mix."""
    kind = rng.random()
    words = [rng.choice(WORDS) for _ in range(rng.randrange(4, 500))]
    tail = f"{rng.randrange(10**9)} " + " ".join(words)  # a unique tail: misses after it
    if kind < 0.5:
        prompt = rng.choice(prefixes) + " " + tail  # shared prefix: hits, then a miss
    elif kind < 0.9:
        prompt = tail  # no shared prefix
    else:
        prompt = " ".join(words[:8])  # short: runs whole on the decode worker
    body: dict[str, Any] = {
        "max_tokens": rng.randrange(4, 40),
        "temperature": 0.8,
        "seed": rng.randrange(2**31),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.1:
        body["n"] = 2
    cancel = body["stream"] and rng.random() < 0.15
    if cancel:
        body["max_tokens"] = 64
    if rng.random() < 0.3:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body, cancel
    body["prompt"] = prompt
    return "/v1/completions", body, cancel


def send(client: httpx.Client, url: str, request: tuple[str, dict[str, Any], bool]) -> str:
    """Send one request; its outcome (`ok`, `cancelled`, `HTTP <code>`, `error <kind>`)."""
    path, body, cancel = request
    try:
        with client.stream("POST", url + path, json=body, timeout=300) as reply:
            if reply.status_code != 200:
                reply.read()
                return f"HTTP {reply.status_code}"
            chunks = 0
            for line in reply.iter_lines():
                chunks += line.startswith("data:")
                if cancel and chunks >= 3:
                    return "cancelled"  # leaving the block closes the connection
            return "ok"
    except httpx.HTTPError as exc:
        return f"error {type(exc).__name__}"


def client_loop(url: str, counts: Counts, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    prefixes = make_prefixes(random.Random(0))  # the same prefixes in every client
    with httpx.Client() as client:
        while not stop.is_set():
            outcome = send(client, url, make_request(rng, prefixes))
            counts.add(outcome)
            if outcome.startswith(("HTTP", "error")):
                stop.wait(0.5)  # refused (429) or broken: do not spin


def worker_roles(log_path: Path | None) -> dict[int, str]:
    """pid -> "<role> <engine_id>" from the router's `joined` lines in the server's log."""
    if log_path is None:
        return {}
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    joined = WORKER_JOINED.finditer(text)
    return {int(m["pid"]): f"{m['role']} {m['id']}" for m in joined}


@dataclass
class Sample:
    elapsed_s: float
    requests: int
    rss_mib: dict[str, float]  # process label -> RSS
    ray_rss_mib: dict[str, float] = field(default_factory=dict)  # Ray's own, by `ray_label`


def ray_label(name: str) -> str:
    """A Ray process's label from its name in the tree (processes.py): the actor or agent
    (`ray::DashboardAgent`, `ray::IDLE`), the script (`dashboard.py`) or the binary."""
    words = name.split()
    if not words:
        return "ray ?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]
    script = next((w for w in words if w.endswith(".py")), None)
    return f"ray {script or words[0]}"


def take_sample(root: int, log_path: Path | None, started: float, counts: Counts) -> Sample:
    """RSS of the serve process, each engine worker, and Ray's other processes summed, and
    those by `ray_label` (summed where several share one)."""
    roles = worker_roles(log_path)
    rss: dict[str, float] = {}
    ray: collections.Counter[str] = collections.Counter()
    for pid, name in process_tree(root).items():
        value = rss_mib(pid)
        if value is None:
            continue
        if pid == root:
            rss[SERVE] = value
        elif pid in roles:
            rss[roles[pid]] = value
        else:
            ray[ray_label(name)] += value
    rss["ray other (sum)"] = sum(ray.values())
    return Sample(time.monotonic() - started, counts.total(), rss, dict(ray))


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60 if var else float("nan")


@dataclass(frozen=True)
class Growth:
    """One process's RSS at the start, once warmed up and at the end (MiB), and the slope of
    its samples after the warm-up (least squares, MiB per hour)."""

    start_mib: float
    warm_mib: float
    end_mib: float
    slope_mib_per_hour: float
    verdict: str


def growth(samples: list[Sample], label: str, warm_up_s: float, max_mib_per_hour: float) -> Growth:
    """`label`'s growth, and the verdict: "flat" when the slope of the samples from
    `warm_up_s` on is at most `max_mib_per_hour`, "growing" above it, "too short to tell"
    with fewer than 3 samples after the warm-up."""
    points = [(s.elapsed_s, s.rss_mib[label]) for s in samples if label in s.rss_mib]
    nan = float("nan")
    if not points:
        return Growth(nan, nan, nan, nan, "no samples")
    warm = [p for p in points if p[0] >= warm_up_s - 1e-6]
    if len(warm) < 3:
        return Growth(points[0][1], nan, points[-1][1], nan, "too short to tell")
    slope = slope_per_min(warm) * 60
    verdict = "flat" if slope <= max_mib_per_hour else "growing"
    return Growth(points[0][1], warm[0][1], points[-1][1], slope, verdict)


def format_report(samples: list[Sample], counts: Counts, args: argparse.Namespace) -> str:
    labels = [SERVE, *sorted({k for s in samples for k in s.rss_mib} - {SERVE})]
    width = max(16, *(len(label) + 2 for label in labels))
    lines = [
        "{:=^80}".format(" kvrelay memory soak "),
        f"duration {args.minutes:g} min, concurrency {args.concurrency}, "
        f"sample every {args.sample_s:g} s",
        "requests: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.outcomes.items())),
        "{:-^80}".format(" RSS (MiB) over time "),
        f"{'min':>6}{'requests':>10}" + "".join(f"{label:>{width}}" for label in labels),
    ]
    for s in samples:
        cells = "".join(
            f"{s.rss_mib[label]:>{width}.1f}" if label in s.rss_mib else f"{'-':>{width}}"
            for label in labels
        )
        lines.append(f"{s.elapsed_s / 60:>6.1f}{s.requests:>10}{cells}")
    return "\n".join(lines + growth_lines(samples, labels, args))


def growth_lines(samples: list[Sample], labels: list[str], args: argparse.Namespace) -> list[str]:
    """The growth section: each process in `labels`, then Ray's own under their sum."""
    ray_samples = [Sample(s.elapsed_s, s.requests, s.ray_rss_mib) for s in samples]
    ray_labels = sorted({k for s in samples for k in s.ray_rss_mib})
    rows = [(label, label, samples) for label in labels]
    rows += [(f"  {label}", label, ray_samples) for label in ray_labels]
    width = max(16, *(len(name) + 2 for name, _, _ in rows))
    lines = [
        "{:-^80}".format(" growth (MiB) "),
        f"{'process':<{width}}{'start':>9}{'warm':>9}{'end':>9}{'MiB/hour':>10}  verdict",
    ]
    for name, label, of in rows:
        g = growth(of, label, args.warm_up_min * 60, args.max_mib_per_hour)
        lines.append(
            f"{name:<{width}}{g.start_mib:>9.1f}{g.warm_mib:>9.1f}{g.end_mib:>9.1f}"
            f"{g.slope_mib_per_hour:>10.1f}  {g.verdict}"
        )
    return [
        *lines,
        f"rule: flat when the least-squares slope of the samples from minute "
        f"{args.warm_up_min:g} on (warm) is <= {args.max_mib_per_hour:g} MiB/hour "
        f"(needs >= 3 samples there)",
        "=" * 80,
    ]
    return "\n".join(lines)


def soak(
    args: argparse.Namespace, url: str, root: int, log_path: Path | None
) -> tuple[list[Sample], Counts]:
    """Run the clients for --minutes, sampling RSS every --sample-s; the samples and counts."""
    counts, stop = Counts(), threading.Event()
    threads = [
        threading.Thread(target=client_loop, args=(url, counts, stop, args.seed + i), daemon=True)
        for i in range(args.concurrency)
    ]
    started = time.monotonic()
    samples = [take_sample(root, log_path, started, counts)]
    for thread in threads:
        thread.start()
    total_s = args.minutes * 60
    next_sample = started + args.sample_s
    while (now := time.monotonic()) < started + total_s:
        time.sleep(max(0.0, min(next_sample, started + total_s) - now))
        if time.monotonic() >= next_sample:
            samples.append(take_sample(root, log_path, started, counts))
            next_sample += args.sample_s
            if not args.no_progress:
                progress(samples[-1], total_s, counts)
    stop.set()
    deadline = time.monotonic() + 30  # requests still running then are left (daemon threads)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    samples.append(take_sample(root, log_path, started, counts))
    return samples, counts


def progress(sample: Sample, total_s: float, counts: Counts) -> None:
    rss = " ".join(f"{k.split()[0]}={v:.0f}" for k, v in sample.rss_mib.items())
    with counts.lock:
        bad = sum(n for k, n in counts.outcomes.items() if k not in ("ok", "cancelled"))
    print(
        f"[{sample.elapsed_s:6.0f}/{total_s:.0f} s] requests={sample.requests} "
        f"refused/failed={bad} RSS MiB: {rss}",
        file=sys.stderr,
        flush=True,
    )


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    """--probe and its options (worker/memory_probe.py)."""
    add = parser.add_argument
    add(
        "--probe",
        type=Path,
        default=None,
        help="a directory: the started server's workers write their memory probe there "
        "(worker/memory_probe.py) and the report summarizes it (not with --url)",
    )
    add(
        "--probe-s",
        type=float,
        default=30.0,
        help="with --probe: seconds between a worker's probe lines (default 30)",
    )
    add(
        "--probe-tracemalloc",
        action="store_true",
        help="with --probe: the workers also trace Python allocations (slower: not for the "
        "RSS verdict, tracemalloc's own tables are in it)",
    )
    add("--url", default=None, help="a running server's HTTP URL (default: start one here)")
    add(
        "--server-log",
        type=Path,
        default=None,
        help="with --url: that server's log, for the workers' `joined` lines (roles)",
    )
    add(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `kvrelay serve` argument (repeatable): --serve-arg=--num-blocks=800",
    )
    add("--seed", type=int, default=0, help="seed of the traffic (default 0)")
    add("--no-progress", action="store_true", help="no progress lines on stderr")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Steady mixed traffic against kvrelay serve while the RSS of the serve "
        "process and each engine worker is sampled; prints RSS over time and each one's "
        "slope after the warm-up in MiB per hour, with a verdict.",
    )
    add = parser.add_argument
    add("--minutes", type=float, default=30.0, help="duration of the traffic (default 30)")
    add("--concurrency", type=int, default=4, help="client threads (default 4)")
    add("--sample-s", type=float, default=30.0, help="seconds between RSS samples (default 30)")
    add(
        "--warm-up-min",
        type=float,
        default=5.0,
        help="minutes of warm-up left out of the slope (default 5)",
    )
    add(
        "--max-mib-per-hour",
        type=float,
        default=10.0,
        help="the verdict's threshold on the slope after warm-up (default 10 MiB/hour)",
    )
    add_probe_args(parser)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.concurrency < 1:
        parser.error("--minutes and --sample-s must be > 0, --concurrency >= 1")
    if args.warm_up_min < 0 or args.max_mib_per_hour < 0 or args.probe_s <= 0:
        parser.error("--warm-up-min and --max-mib-per-hour must be >= 0, --probe-s > 0")
    if args.probe is not None and args.url:
        parser.error("--probe needs the server started here: leave out --url")
    return args


def probe_env(args: argparse.Namespace) -> dict[str, str]:
    """The started server's environment for --probe (its Ray workers inherit it)."""
    if args.probe is None:
        return {}
    args.probe.mkdir(parents=True, exist_ok=True)
    env = {
        "KVRELAY_MEMORY_PROBE": str(args.probe.resolve()),
        "KVRELAY_MEMORY_PROBE_S": str(args.probe_s),
    }
    if args.probe_tracemalloc:
        env["KVRELAY_MEMORY_PROBE_TRACEMALLOC"] = "1"
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    roles: dict[int, str] = {}
    if args.url:
        port = httpx.URL(args.url).port
        root = listening_pid(port) if port else None
        if root is None:
            print(f"no process listens on {args.url}'s port", file=sys.stderr)
            return 2
        samples, counts = soak(args, args.url.rstrip("/"), root, args.server_log)
    else:
        kvrelay = shutil.which("kvrelay") or str(Path(sys.executable).with_name("kvrelay"))
        http_port, grpc_port = free_port(), free_port()
        command = [kvrelay, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                   *args.serve_arg]  # fmt: skip
        url = f"http://127.0.0.1:{http_port}"
        spec = ServerSpec("kvrelay", command, url, "/health", env=probe_env(args))
        with tempfile.TemporaryDirectory() as logs, RunningServer(spec, Path(logs), 600) as srv:
            assert srv._process is not None
            samples, counts = soak(args, spec.base_url, srv._process.pid, srv.log_path)
            roles = worker_roles(srv.log_path)
    print(format_report(samples, counts, args), flush=True)
    if args.probe is not None:
        print(probe_report(args.probe, roles, args.warm_up_min * 60), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
