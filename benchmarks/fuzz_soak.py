#!/usr/bin/env python
"""Fuzz soak: N minutes of well-behaved streams mixed with hostile HTTP and gRPC traffic
against `kvrelay serve`, checking that no request can hurt another (issue 12).

Phase 1 (the first --clean-fraction of the time) runs only the well-behaved streams; phase 2
adds the hostile clients. A greedy victim stream runs throughout and must always produce the
tokens of its first run. Prints requests by outcome, the 5xx count (must be 0), victim
equality, the p99 inter-token gap of the well-behaved streams with hostile traffic against
phase 1 (a ratio: the machine is shared and noisy), and the RSS of the server and each of its
processes (Ray workers included) at start and end. Exits 1 on any 5xx, gRPC UNKNOWN /
INTERNAL, broken connection or victim difference.

    .venv/bin/python benchmarks/fuzz_soak.py --minutes 10 --concurrency 4
    .venv/bin/python benchmarks/fuzz_soak.py --url http://127.0.0.1:8000 \\
        --grpc-target 127.0.0.1:50051 --minutes 1

The hostile cases are generated here (tests/fuzz/corpus.py keeps the seed corpus for the
regression tests; benchmarks import nothing from tests).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from tqdm import tqdm

from kvrelay.v1 import generation_pb2 as pb
from serving.outcomes import COMPLETIONS, Stats, is_failure, stream_text
from serving.processes import listening_pid, rss_snapshot
from serving.servers import RunningServer, ServerSpec, free_port

CHAT = "/v1/chat/completions"
GENERATE = "/kvrelay.v1.Generation/Generate"
VICTIM = {"prompt": "The capital of France is Paris. The capital of Italy is", "max_tokens": 24,
          "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
PROMPTS = ("Tell me about the sea.", "Write a haiku about rain.", "List three colours.",
           "Explain gravity to a child.", "What is a prime number?")  # fmt: skip
BAD_INTS = (0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30)
BAD_FLOATS = ("NaN", "Infinity", "-Infinity", "1e-300", "1e-40", "1e300", "-1e300", "0")
FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
          "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "stop_token_ids", "stream", "echo", "best_of", "stop", "prompt")  # fmt: skip
ROLES = ("tool", "bogus", "", "SYSTEM", "user", "developer")


def _bad_value(rng: random.Random) -> str:
    """Raw JSON text for a hostile field value (NaN and Infinity as the JSON extensions)."""
    choices = [
        lambda: str(rng.choice(BAD_INTS)),
        lambda: rng.choice(BAD_FLOATS),
        lambda: "null",
        lambda: json.dumps(rng.choice(["abc \ud800 def", "a\x00b", "", "x" * 100])),
        lambda: f"[{rng.choice(BAD_INTS)}]",
        lambda: "[" * 2000 + "]" * 2000,
        lambda: '{"a": {"b": []}}',
        lambda: "true",
    ]
    return rng.choice(choices)()


def hostile_http(rng: random.Random) -> tuple[str, str, bytes]:
    """(method, path, body) of one hostile HTTP request."""
    kind = rng.randrange(100)
    if kind < 45:  # one field at a boundary or of the wrong type
        name = rng.choice(FIELDS)
        raw = f'{{"prompt": "Hello", "max_tokens": 2, "{name}": {_bad_value(rng)}}}'
        return "POST", COMPLETIONS, raw.encode()
    if kind < 60:  # the engine killers of issue 12 and big bounds
        fields: dict[str, Any] = rng.choice([
            {"stop_token_ids": [rng.choice([2**63, 2**64])], "min_tokens": 1},
            {"temperature": 1.0, "repetition_penalty": rng.choice([1e-300, 1e-40])},
            {"seed": 2**64 - 1, "n": 2, "stream": rng.random() < 0.5},
            {"n": 3000}, {"n": 256, "max_tokens": 8000},
        ])  # fmt: skip
        body = json.dumps({"prompt": "Hello", "max_tokens": 2, **fields}).encode()
        return "POST", COMPLETIONS, body
    if kind < 75:  # chat: bad roles, surrogates (escaped or raw bytes), bad limits
        role = json.dumps(rng.choice(ROLES)).encode()
        content = rng.choice([b'"Hi"', b'"abc \\ud800 def"', b'"abc \xed\xa0\x80 def"', b"null"])
        limit = rng.choice([b"2", b"0", b"-1", b"null", b"1e300"])
        body = b'{"messages": [{"role": %s, "content": %s}], "max_tokens": 2, ' % (role, content)
        return "POST", CHAT, body + b'"max_completion_tokens": %s}' % limit
    if kind < 80:  # bodies past the limit (a 20 MB prompt or unknown field)
        text = b"a " * (rng.choice([5, 20]) * 500_000)
        key = rng.choice([b"prompt", b"padding"])
        return "POST", COMPLETIONS, b'{"max_tokens": 2, "%s": "%s"}' % (key, text)
    return _malformed_http(rng)


def _malformed_http(rng: random.Random) -> tuple[str, str, bytes]:
    """Bodies that are not a JSON object at all, unknown routes and wrong methods."""
    return rng.choice([
        ("POST", COMPLETIONS, b'{"prompt": "Hello", '),
        ("POST", COMPLETIONS, rng.randbytes(rng.randrange(1, 64))),
        ("POST", CHAT, b"[" * 100_000 + b"]" * 100_000),
        ("POST", COMPLETIONS, b"[]"),
        ("POST", "/v1/nope", b"{}"),
        ("GET", COMPLETIONS, b""),
        ("DELETE", CHAT, b""),
    ])  # fmt: skip


def hostile_grpc(rng: random.Random) -> bytes:
    """A serialized hostile GenerateRequest, or malformed bytes."""
    kind = rng.randrange(100)
    if kind < 25:
        return rng.randbytes(rng.randrange(0, 48))
    if kind < 50:
        data = bytearray(_grpc_request(rng).SerializeToString())
        for _ in range(rng.randrange(1, 4)):
            if data:
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        return bytes(data)
    return _grpc_request(rng).SerializeToString()


def _grpc_request(rng: random.Random) -> Any:
    sampling: dict[str, Any] = rng.choice([
        {"repetition_penalty": 1e-40, "temperature": 1.0}, {"seed": 2**64 - 1, "n": 2},
        {"n": 3000}, {"n": 256, "max_tokens": 8000}, {"max_tokens": 0}, {"logprobs": 2**32 - 1},
        {"temperature": math.nan}, {"top_p": math.inf}, {"stop_token_ids": [2**32 - 1]},
    ])  # fmt: skip
    sampling.setdefault("max_tokens", 2)
    if rng.random() < 0.5:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role=rng.choice(ROLES), content="Hi")])
        return pb.GenerateRequest(messages=chat, sampling=pb.SamplingOptions(**sampling))
    request_id = rng.choice(["", "shared"])  # a reused id must not reach another request
    options = pb.SamplingOptions(**sampling)
    return pb.GenerateRequest(prompt="Hello", request_id=request_id, sampling=options)


def send_http(
    client: httpx.Client, url: str, method: str, path: str, body: bytes, stats: Stats
) -> None:
    try:
        with client.stream(method, url + path, content=body, timeout=300,
                           headers={"Content-Type": "application/json"}) as reply:  # fmt: skip
            raw = reply.read()
            stats.count(f"HTTP {reply.status_code}", raw.decode(errors="replace"))
    except httpx.HTTPError as exc:
        stats.count("broken connection (HTTP)", repr(exc))


def send_grpc(channel: grpc.Channel, data: bytes, stats: Stats) -> None:
    call: Any = channel.unary_stream(GENERATE)  # no (de)serializers: the bytes as they are
    try:
        for _ in call(data, timeout=300):
            pass
    except grpc.RpcError as exc:
        stats.count(f"gRPC {exc.code().name}", exc.details() or "")
        return
    stats.count("gRPC OK")


@dataclass
class Target:
    url: str
    grpc_target: str | None


def well_behaved(
    target: Target, stats: Stats, phase: list[str], stop: threading.Event, seed: int
) -> None:
    """Streams of ordinary requests; their gaps are filed under the phase they started in."""
    rng = random.Random(seed)
    with httpx.Client() as client:
        while not stop.is_set():
            payload = {"prompt": rng.choice(PROMPTS), "max_tokens": 32, "temperature": 0.7,
                       "stream": True, "seed": rng.randrange(2**32)}  # fmt: skip
            started_in = phase[0]
            result = stream_text(client, target.url, payload, stats)
            if result is None:
                stop.wait(0.2)  # refused (429) or broken: do not spin
                continue
            with stats.lock:
                stats.gaps_s[started_in].extend(result[1])


def hostile(
    target: Target, stats: Stats, phase: list[str], stop: threading.Event, seed: int
) -> None:
    """Hostile HTTP and gRPC requests, one after another, from phase 2 on."""
    rng = random.Random(seed)
    channel = grpc.insecure_channel(target.grpc_target) if target.grpc_target else None
    with httpx.Client() as client:
        while not stop.is_set():
            if phase[0] == "clean":
                stop.wait(0.2)
                continue
            if channel is not None and rng.random() < 0.3:
                send_grpc(channel, hostile_grpc(rng), stats)
            else:
                send_http(client, target.url, *hostile_http(rng), stats)
    if channel is not None:
        channel.close()


def victim(target: Target, stats: Stats, stop: threading.Event) -> None:
    """The same greedy stream over and over: every run must equal the first."""
    with httpx.Client() as client:
        while not stop.is_set():
            result = stream_text(client, target.url, VICTIM, stats)
            if result is not None:
                with stats.lock:
                    stats.victim_runs.append(result[0])
            else:
                stop.wait(0.2)


@dataclass
class Settings:
    minutes: float
    concurrency: int
    hostile_concurrency: int
    clean_fraction: float
    seed: int
    progress: bool


def p99_ms(gaps: list[float]) -> float:
    if len(gaps) < 2:
        return gaps[0] * 1000 if gaps else math.nan
    return statistics.quantiles(gaps, n=100, method="inclusive")[98] * 1000


def run_traffic(target: Target, settings: Settings, stats: Stats) -> None:
    """Phase 1 (clean) then phase 2 (hostile), the victim throughout; returns when done."""
    phase, stop = ["clean"], threading.Event()
    clients = [(well_behaved, i) for i in range(settings.concurrency)]
    clients += [(hostile, 1000 + i) for i in range(settings.hostile_concurrency)]
    threads = [threading.Thread(target=victim, args=(target, stats, stop))]
    threads += [
        threading.Thread(target=fn, args=(target, stats, phase, stop, settings.seed + offset))
        for fn, offset in clients
    ]
    for thread in threads:
        thread.start()
    total_s = settings.minutes * 60
    started = time.monotonic()
    bar = tqdm(total=round(total_s), unit="s", desc="clean", disable=not settings.progress)
    while (elapsed := time.monotonic() - started) < total_s:
        if phase[0] == "clean" and elapsed >= total_s * settings.clean_fraction:
            phase[0] = "hostile"
            bar.set_description("hostile")
        time.sleep(min(1.0, total_s - elapsed))
        bar.n = min(round(time.monotonic() - started), bar.total)
        with stats.lock:
            bar.set_postfix(requests=sum(stats.outcomes.values()), failures=len(stats.failures))
    bar.close()
    stop.set()
    for thread in threads:
        thread.join()


def report(
    settings: Settings, stats: Stats, rss: tuple[dict[int, tuple[str, float]], ...]
) -> tuple[str, bool]:
    """The printed table, and whether the soak passed."""
    server_errors = sum(n for o, n in stats.outcomes.items() if is_failure(o))
    http_5xx = sum(n for o, n in stats.outcomes.items() if o.startswith("HTTP 5"))
    baseline = stats.victim_runs[0] if stats.victim_runs else None
    equal = sum(run == baseline for run in stats.victim_runs)
    victims_ok = bool(stats.victim_runs) and equal == len(stats.victim_runs)
    clean, hostile_p99 = p99_ms(stats.gaps_s["clean"]), p99_ms(stats.gaps_s["hostile"])
    clients = f"{settings.concurrency} / {settings.hostile_concurrency}"
    rows = [
        ("Duration (min):", f"{settings.minutes:g}"),
        ("Clients (normal / hostile):", clients),
    ]
    rows += [(f"  {outcome}:", str(n)) for outcome, n in sorted(stats.outcomes.items())]
    rows += [
        ("5xx responses (must be 0):", str(http_5xx)),
        ("All server-side failures (must be 0):", str(server_errors)),
        (
            "Victim runs equal to baseline:",
            f"{'yes' if victims_ok else 'no'} ({equal}/{len(stats.victim_runs)})",
        ),
        ("P99 ITL without hostile traffic (ms):", f"{clean:.1f}"),
        ("P99 ITL with hostile traffic (ms):", f"{hostile_p99:.1f}"),
        ("P99 ITL ratio (hostile / clean):", f"{hostile_p99 / clean:.2f}"),
    ]
    lines = ["{:=^64}".format(" kvrelay fuzz soak "), *(f"{k:<46}{v:>18}" for k, v in rows[:2])]
    lines += [
        "{:-^64}".format(" requests by outcome "),
        *(f"{k:<46}{v:>18}" for k, v in rows[2:-6]),
    ]
    lines += ["{:-^64}".format(" verdict "), *(f"{k:<46}{v:>18}" for k, v in rows[-6:])]
    lines += [
        "{:-^64}".format(" RSS (MiB) "),
        f"{'pid':>8}  {'process':<32}{'start':>12}{'end':>12}",
    ]
    for pid in sorted(set(rss[0]) | set(rss[1])):
        name = (rss[0].get(pid) or rss[1][pid])[0]
        start, end = (f"{r[pid][1]:.0f}" if pid in r else "-" for r in rss)
        lines.append(f"{pid:>8}  {name[:32]:<32}{start:>12}{end:>12}")
    lines += [*(f"failure: {f}" for f in stats.failures), "=" * 64]
    return "\n".join(lines), server_errors == 0 and victims_ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Mixed well-behaved and hostile traffic against kvrelay serve (issue 12): "
        "fails (exit 1) on any 5xx, gRPC UNKNOWN/INTERNAL, broken connection or victim "
        "stream that differs from its first run.",
    )
    add = parser.add_argument
    add("--minutes", type=float, default=10.0, help="total duration, both phases (default 10)")
    add("--concurrency", type=int, default=4, help="well-behaved streaming clients (default 4)")
    add("--hostile-concurrency", type=int, default=None,
        help="hostile clients in phase 2 (default: --concurrency)")  # fmt: skip
    add("--clean-fraction", type=float, default=0.2,
        help="share of the time without hostile traffic: phase 1, the ITL reference "
        "(default 0.2)")  # fmt: skip
    add("--url", default=None, help="a running server's HTTP URL (default: start one here)")
    add("--grpc-target", default=None,
        help="its gRPC host:port (with --url; without it, no gRPC traffic)")  # fmt: skip
    add("--serve-arg", action="append", default=[],
        help="extra `kvrelay serve` argument (repeatable): --serve-arg=--colocated")  # fmt: skip
    add("--seed", type=int, default=0, help="seed of the traffic generators (default 0)")
    add("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not 0 < args.clean_fraction < 1:
        parser.error("--clean-fraction must be in (0, 1)")
    return args


def soak(args: argparse.Namespace, target: Target, server_pid: int | None) -> bool:
    hostile_clients = args.hostile_concurrency
    if hostile_clients is None:
        hostile_clients = args.concurrency
    settings = Settings(args.minutes, args.concurrency, hostile_clients, args.clean_fraction,
                        args.seed, not args.no_progress)  # fmt: skip
    stats = Stats()
    start_rss = rss_snapshot(server_pid)
    run_traffic(target, settings, stats)
    table, passed = report(settings, stats, (start_rss, rss_snapshot(server_pid)))
    print(table, flush=True)
    return passed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        port = httpx.URL(args.url).port
        target = Target(args.url.rstrip("/"), args.grpc_target)
        return 0 if soak(args, target, listening_pid(port) if port else None) else 1
    kvrelay = shutil.which("kvrelay") or str(Path(sys.executable).with_name("kvrelay"))
    http_port, grpc_port = free_port(), free_port()
    command = [kvrelay, "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    spec = ServerSpec(
        "kvrelay", [*command, *args.serve_arg], f"http://127.0.0.1:{http_port}", "/health"
    )
    with tempfile.TemporaryDirectory() as logs, RunningServer(spec, Path(logs), 600) as server:
        assert server._process is not None
        target = Target(spec.base_url, f"127.0.0.1:{grpc_port}")
        return 0 if soak(args, target, server._process.pid) else 1


if __name__ == "__main__":
    sys.exit(main())
