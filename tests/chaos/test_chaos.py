"""Chaos (issue 13): `kill -9` of the decode worker, then of the prefill worker, then of both in
turn, each with greedy streams in flight, against one real `kvrelay serve` (tests/chaos/
scenario.py runs it once; each test here judges one property of that run).

The server runs without prefix caching and with --max-local-prefill-tokens 0, so that every
prompt is really prefilled at the prefill worker: a long prompt is being prefilled when the
prefill worker is killed (the test waits until that worker's process burns CPU on it).

What "health tells the truth" means from outside (the test cannot see a worker being up; it
sees its pid die at the kill, and its replacement's `joined` line in the router's log):
- not ready only during a decode outage: from a decode worker's kill until its replacement's
  `joined` line was seen (plus 0.3 s: the test reads the log every 0.1 s, gRPC health mirrors
  /health every 0.1 s); never because of a prefill worker's death;
- not ready after each decode kill (unless the replacement joined faster than two probes), at
  the latest DETECTION_S after the kill (the time Ray takes to report the process dead), and
  ready again within 30 s;
- no token reaches a client between two consecutive not-ready probes of a service (a token
  then comes from a decode worker the health service says does not exist).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.observers import GRPC_SERVICES, INTERNALS, Probe, counter, gauges
from tests.chaos.scenario import (
    MAX_TOKENS,
    NEW_REQUEST_DEADLINE_S,
    ChaosRun,
    Kill,
    logprobs_migration,
    run_chaos,
)
from tests.servers import ServerProcess, start_server

# alone: /health and kill-recovery bounds in wall time (Makefile: RUN_SUITE).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.alone]

# Streams wait up to 120 s for a replacement (a loaded CI machine restarts a worker slowly);
# the 30 s bound of the issue is asserted on its own.
SERVER_ARGS = (
    "--no-prefix-caching",
    "--max-local-prefill-tokens",
    "0",
    "--num-blocks",
    "256",
    "--migration-timeout",
    "120",
)
DETECTION_S = 3.0  # kill -9 -> the router knows the worker is gone (measured: 1.4 s)
JOIN_SLACK_S = 0.3
TOKEN_SLACK_S = 0.15


@pytest.fixture(scope="module")
def chaos_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("chaos"), *SERVER_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chaos(chaos_server: ServerProcess) -> ChaosRun:
    run = run_chaos(chaos_server)
    print(f"\nchaos scenario: {run.wall_s:.0f} s; server log: {chaos_server.log_path}")
    for kill in kills_of(run):
        replaced = kill.replacement.seen_at - kill.at if kill.replacement else math.nan
        served = kill.served_at - kill.at if kill.served_at else math.nan
        print(f"  kill -9 {kill.role} worker: replaced after {replaced:.1f} s, "
              f"a new request served after {served:.1f} s")  # fmt: skip
    return run


def test_greedy_streams_finish_with_the_undisturbed_tokens(chaos: ChaosRun) -> None:
    assert len(chaos.phases) == 3
    for phase in chaos.phases:
        for stream in phase.streams:
            expected = chaos.baseline[stream.payload["prompt"]]
            assert len(expected) == MAX_TOKENS
            assert not stream.errors, (phase.name, stream.errors)
            assert stream.tokens == expected, (phase.name, stream.tokens, expected)
            assert stream.finish_reason == "length"


def test_in_flight_decode_streams_were_migrated(chaos: ChaosRun) -> None:
    text = chaos.final_metrics
    resumed = counter(text, "kvrelay_requests_migrated_total", outcome="resumed")
    decode_kills = sum(k.role == "decode" for p in chaos.phases for k in p.kills)
    # Every stream of PROMPTS was decoding (it had tokens) at each decode kill.
    assert resumed >= decode_kills * 3
    assert counter(text, "kvrelay_requests_migrated_total", outcome="failed") == 0


def test_the_prefill_kills_landed_mid_prefill(chaos: ChaosRun) -> None:
    # The long prompt had no token yet when its prefill worker was killed: it was retried.
    assert chaos.mid_prefill == {"prefill": True, "both": True}


def test_new_requests_succeed_within_30_s_of_each_kill(chaos: ChaosRun) -> None:
    for kill in kills_of(chaos):
        assert kill.served_at is not None, kill
        assert kill.served_at - kill.at <= NEW_REQUEST_DEADLINE_S, kill
        assert kill.replacement is not None and kill.replacement.pid != kill.pid


@pytest.mark.parametrize("service", ["http", *GRPC_SERVICES])
def test_health_tells_the_truth_at_every_probe(chaos: ChaosRun, service: str) -> None:
    assert chaos.probes is not None
    probes = chaos.probes.of(service)
    assert len(probes) > 100, "the prober hardly ran"
    lies = [f"{p}: no answer" for p in probes if p.ready is None]
    outages = decode_outages(chaos)
    lies += [f"{p}: not ready outside a decode outage" for p in probes if p.ready is False
             and not any(start <= p.end and p.start <= end for start, end in outages)]  # fmt: skip
    for kill in kills_of(chaos):
        if kill.role == "decode":
            lies += outage_lies(kill, probes)
    arrivals = sorted(t for p in chaos.phases for s in p.streams for t in s.arrivals)
    for a, b in itertools.pairwise(probes):
        if a.ready is False and b.ready is False:
            inside = [t for t in arrivals if a.end + TOKEN_SLACK_S < t < b.start - TOKEN_SLACK_S]
            lies += [f"a token arrived at {t:.2f} between not-ready {a} and {b}" for t in inside]
    assert not lies, "\n".join(lies[:20])


def test_no_blocks_leases_or_requests_left(chaos: ChaosRun) -> None:
    text = chaos.final_metrics
    assert gauges(text, "kvrelay_pool_workers") == {"prefill": 1, "decode": 1, "colocated": 0}
    for name in ("kvrelay_kv_cache_usage_ratio", "kvrelay_kv_leases",
                 "kvrelay_num_requests_running", "kvrelay_num_requests_waiting"):  # fmt: skip
        pools = gauges(text, name)
        assert set(pools) == {"prefill", "decode", "colocated"}, name
        assert all(v == 0 for v in pools.values()), (name, pools)


def test_clients_are_told_nothing_about_internals(chaos: ChaosRun) -> None:
    secrets = [w.engine_id for w in chaos.workers] + [str(w.pid) for w in chaos.workers]
    for text in chaos.client_errors:
        assert not INTERNALS.search(text), text
        assert not any(re.search(rf"\b{s}\b", text) for s in secrets), text


def kills_of(chaos: ChaosRun) -> list[Kill]:
    return [kill for phase in chaos.phases for kill in phase.kills]


def decode_outages(chaos: ChaosRun) -> list[tuple[float, float]]:
    """From each decode kill until its replacement's `joined` line was seen (plus slack)."""
    return [
        (kill.at, kill.replacement.seen_at + JOIN_SLACK_S)
        for kill in kills_of(chaos)
        if kill.role == "decode" and kill.replacement is not None
    ]


def outage_lies(kill: Kill, probes: list[Probe]) -> list[str]:
    """Health after one decode kill: not ready within DETECTION_S, ready again within 30 s."""
    assert kill.replacement is not None
    back = kill.replacement.seen_at
    during = [p for p in probes if kill.at <= p.start and p.end <= back]
    lies = []
    if back - kill.at > DETECTION_S + 1.0 and not any(p.ready is False for p in during):
        lies.append(f"never not ready while the decode worker {kill.pid} was dead")
    # The `joined` line is read every 0.1 s: a ready probe just before it was seen is true.
    late = [p for p in during if p.ready and kill.at + DETECTION_S < p.start < back - JOIN_SLACK_S]
    lies += [f"{p}: ready {p.start - kill.at:.2f} s after decode {kill.pid} died" for p in late]
    after = [p for p in probes if p.ready and p.start > back]
    if not after or after[0].start - kill.at > NEW_REQUEST_DEADLINE_S:
        lies.append(f"not ready again within 30 s of killing decode {kill.pid}")
    return lies


def test_a_migrated_stream_with_logprobs_keeps_its_tokens(
    chaos: ChaosRun, chaos_server: ServerProcess
) -> None:
    """Runs after the scenario (it needs `chaos` first): one greedy stream with logprobs, its
    decode worker killed mid-stream."""
    undisturbed, disturbed = logprobs_migration(chaos_server)
    assert len(undisturbed.tokens) == MAX_TOKENS and not undisturbed.errors
    assert not disturbed.errors
    assert disturbed.tokens == undisturbed.tokens
    assert disturbed.finish_reason == "length"
    # No duplicate and no gap: each token starts where the text before it ends.
    lengths = itertools.accumulate(len(t) for t in disturbed.tokens)
    assert disturbed.offsets == [0, *list(lengths)[:-1]]
