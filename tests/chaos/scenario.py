"""The chaos scenario against one real `kvrelay serve`: undisturbed greedy runs first, then
`kill -9` of the decode worker, of the prefill worker, and of both in turn, each with streams
in flight; it records what clients saw and leaves the judging to the tests."""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.chaos.observers import (
    HealthProber,
    Stream,
    Worker,
    WorkerLog,
    completion_payload,
    gauges,
    wait_for,
)
from tests.servers import ServerProcess

MAX_TOKENS = 64
TOKENS_BEFORE_KILL = 4
PREFILL_CPU_S = 0.3
NEW_REQUEST_DEADLINE_S = 30.0
PROMPTS = (
    "Once upon a time in a small village at the foot of the mountains there lived an old "
    "clockmaker who",
    "The three most important ideas in the history of science are, in my opinion,",
    "Dear diary, today the weather was strange: in the morning it snowed, and then",
)
# Long prompts, prefilled (about 300 tokens, seconds on 2 cores) while the prefill worker is
# killed, so that the kill lands mid-prefill.
FRESH = {
    "prefill": " ".join(f"Step {i}: add {i} apples to the basket." for i in range(30)),
    "both": " ".join(f"Line {i}: the {i}th bird sang on the wall." for i in range(30)),
}
# Killing "both" kills the decode worker, then the prefill worker, without waiting between.
PHASES = (("decode", ("decode",)), ("prefill", ("prefill",)), ("both", ("decode", "prefill")))


@dataclass
class Kill:
    role: str
    pid: int
    at: float  # monotonic time of the SIGKILL
    served_at: float | None = None  # a new request answered 200 after it
    replacement: Worker | None = None


@dataclass
class Phase:
    name: str
    streams: list[Stream]
    kills: list[Kill]


@dataclass
class ChaosRun:
    baseline: dict[str, list[str]] = field(default_factory=dict)  # prompt -> tokens
    phases: list[Phase] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)  # every error text a client got
    probes: HealthProber | None = None
    workers: list[Worker] = field(default_factory=list)  # every worker that ever joined
    final_metrics: str = ""
    mid_prefill: dict[str, bool] = field(default_factory=dict)  # phase -> killed mid-prefill
    wall_s: float = 0.0


def run_streams(url: str, prompts: list[str], logprobs: bool = False) -> list[Stream]:
    return [Stream(completion_payload(p, MAX_TOKENS, logprobs)).start(url) for p in prompts]


def finish(streams: list[Stream], run: ChaosRun, timeout_s: float = 180.0) -> None:
    for stream in streams:
        assert stream.done.wait(timeout_s), f"a stream did not end in {timeout_s:g} s"
        run.client_errors.extend(stream.errors)


def serve_one(url: str, run: ChaosRun, deadline: float) -> float | None:
    """Send short requests until one is answered 200 (its time) or the deadline passes."""
    with httpx.Client(timeout=httpx.Timeout(5.0, read=60.0)) as client:
        while time.monotonic() < deadline:
            body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
            try:
                reply = client.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                run.client_errors.append(f"connection: {exc!r}")
            else:
                if reply.status_code == 200:
                    return time.monotonic()
                run.client_errors.append(f"HTTP {reply.status_code}: {reply.text}")
            time.sleep(0.3)  # a refusal is answered at once: pace the retries
    return None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_prefill(url: str, log: WorkerLog, prompt: str) -> Stream:
    """Stream `prompt` and return once the prefill worker is computing it: it has burnt
    PREFILL_CPU_S of CPU since (idle, it burns almost none; its stats are no help: they wait
    for the end of the step)."""
    worker = log.current("prefill")
    assert worker is not None
    before = cpu_seconds(worker.pid)
    (stream,) = run_streams(url, [prompt])
    wait_for(
        lambda: cpu_seconds(worker.pid) - before >= PREFILL_CPU_S or stream.tokens,
        30,
        "the prefill worker starts on the long prompt",
        every_s=0.05,
    )
    return stream


def chaos_phase(url: str, log: WorkerLog, run: ChaosRun, name: str, roles: tuple[str, ...]) -> None:
    streams = run_streams(url, list(PROMPTS))
    wait_for(
        lambda: all(len(s.tokens) >= TOKENS_BEFORE_KILL for s in streams),
        90,
        f"{name}: every stream has {TOKENS_BEFORE_KILL} tokens",
    )
    if name in FRESH:
        streams.append(start_prefill(url, log, FRESH[name]))
        run.mid_prefill[name] = not streams[-1].tokens
    kills = []
    for role in roles:
        worker = log.current(role)
        assert worker is not None, f"no {role} worker joined (no 'joined' line in the log)"
        os.kill(worker.pid, signal.SIGKILL)
        kills.append(Kill(role, worker.pid, time.monotonic()))
    served = serve_one(url, run, kills[0].at + NEW_REQUEST_DEADLINE_S + 30)
    for kill in kills:
        kill.served_at = served
        kill.replacement = wait_for(
            functools.partial(log.replacement, kill.role, kill.pid),
            60,
            f"{name}: a new {kill.role} worker",
        )
    finish(streams, run)
    run.phases.append(Phase(name, streams, kills))


def settled_metrics(url: str, timeout_s: float = 20.0) -> str:
    """/metrics once no pool holds a block, a lease or a request (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        busy = [
            value
            for name in ("kvrelay_kv_cache_usage_ratio", "kvrelay_kv_leases",
                         "kvrelay_num_requests_running", "kvrelay_num_requests_waiting")
            for value in gauges(text, name).values()
        ]  # fmt: skip
        if not any(busy) or time.monotonic() >= deadline:
            return text
        time.sleep(0.2)


def run_chaos(server: ServerProcess) -> ChaosRun:
    started = time.monotonic()
    url, run = server.http_url, ChaosRun()
    prompts = [*PROMPTS, *FRESH.values()]
    undisturbed = run_streams(url, prompts)
    finish(undisturbed, run)
    run.baseline = {p: s.tokens for p, s in zip(prompts, undisturbed, strict=True)}
    with WorkerLog(server.log) as log, HealthProber(url, server.grpc_target) as prober:
        run.probes = prober
        for name, roles in PHASES:
            chaos_phase(url, log, run, name, roles)
        run.workers = log.refresh()
    run.final_metrics = settled_metrics(url)
    run.wall_s = time.monotonic() - started
    return run


def logprobs_migration(server: ServerProcess) -> tuple[Stream, Stream]:
    """A greedy stream with logprobs, undisturbed, then again with its decode worker killed
    after TOKENS_BEFORE_KILL tokens (it resumes at the replacement): (undisturbed, disturbed)."""
    url, run = server.http_url, ChaosRun()
    (undisturbed,) = run_streams(url, [PROMPTS[0]], logprobs=True)
    finish([undisturbed], run)
    with WorkerLog(server.log) as log:
        (disturbed,) = run_streams(url, [PROMPTS[0]], logprobs=True)
        wait_for(lambda: len(disturbed.tokens) >= TOKENS_BEFORE_KILL, 90, "4 tokens")
        decode = log.current("decode")
        assert decode is not None
        os.kill(decode.pid, signal.SIGKILL)
        finish([disturbed], run)
        wait_for(lambda: log.replacement("decode", decode.pid), 60, "a new decode worker")
    return undisturbed, disturbed
