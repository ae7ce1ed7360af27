#!/usr/bin/env python
"""One client's latency while another hogs the server (issue 41), against a real local
`kvrelay serve` (real workers, the default model) started here with three tenants' keys.

The victim streams a chat reply of --victim-tokens tokens (EOS ignored). Measured, each
--repeats times (medians reported): the victim alone; beside a chat request with `n = 128` and
no max_tokens from the hog's key (it should be refused with a 4xx naming `n`, or, when
admitted, is left running while the victim is measured); beside a burst tenant that opened
--burst streams at once just before. Each figure is printed beside the issue's target: TTFT
<= max(0.5 s, 3x alone) and total <= 2x alone (or the hog refused with a clear 4xx).

    .venv/bin/python benchmarks/tenant_fairness.py --markdown /tmp/fairness.md
    .venv/bin/python benchmarks/tenant_fairness.py --max-in-flight 8 --repeats 1
    .venv/bin/python benchmarks/tenant_fairness.py --max-num-seqs 8 --only burst

With `--max-num-seqs` low and `--max-in-flight` high (its default), the router admits every
stream and the engine's batch is what is full: the engine's scheduler decides who runs. The
burst row also reports the burst tenant's own time (all its streams, first sent to last done)
and its tokens per second, what fairness costs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serving.servers import RunningServer, kvrelay_spec

KEYS = {"victim": "sk-victim", "hog": "sk-hog", "burst": "sk-burst"}
CHAT = [{"role": "user", "content": "Tell me about the history of lighthouses."}]


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class Row:
    scenario: str
    victim: Timing
    alone: Timing
    hog: str  # what happened to the hog's request(s)

    @property
    def ttft_target_s(self) -> float:
        return max(0.5, 3 * self.alone.ttft_s)

    @property
    def total_target_s(self) -> float:
        return 2 * self.alone.total_s

    @property
    def refused(self) -> bool:
        return self.hog.startswith("refused 4")

    @property
    def verdict(self) -> str:
        if self.refused:
            return "met (hog refused)"
        ok = self.victim.ttft_s <= self.ttft_target_s and self.victim.total_s <= self.total_target_s
        return "met" if ok else "missed"


def sse_text_events(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON events of an OpenAI SSE stream's `data:` lines, up to `[DONE]`."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line.removeprefix("data: ").strip()
        if payload == "[DONE]":
            break
        events.append(json.loads(payload))
    return events


async def stream_chat(http: httpx.AsyncClient, key: str, body: dict[str, Any]) -> Timing:
    """Stream one chat request: seconds to the first content token and to the end."""
    started = time.monotonic()
    first: float | None = None
    headers = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            for event in sse_text_events([line]):
                content = [c["delta"].get("content") for c in event.get("choices", [])]
                if first is None and any(content):
                    first = time.monotonic()
    end = time.monotonic()
    return Timing((first or end) - started, end - started)


def victim_body(tokens: int) -> dict[str, Any]:
    return {
        "messages": CHAT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


async def median_of(repeats: int, measure: Callable[[], Awaitable[Timing]]) -> Timing:
    runs = [await measure() for _ in range(repeats)]
    return Timing(
        statistics.median(r.ttft_s for r in runs), statistics.median(r.total_s for r in runs)
    )


async def with_hog(http: httpx.AsyncClient, args: argparse.Namespace) -> tuple[Timing, str]:
    """The victim beside a chat request of n = 128 without max_tokens."""
    hog_body = {"messages": CHAT, "n": 128, "temperature": 1.0}
    headers = {"Authorization": f"Bearer {KEYS['hog']}"}
    hog = asyncio.create_task(http.post("/v1/chat/completions", json=hog_body, headers=headers))
    await asyncio.sleep(0.5)  # admitted (or refused) and running before the victim comes
    if hog.done():
        reply = hog.result()
        error = reply.json().get("error", {}) if reply.status_code != 200 else {}
        what = f"refused {reply.status_code}, param {error.get('param')!r}: {error.get('message')}"
        victim = await median_of(args.repeats, lambda: stream_chat(http, KEYS["victim"], vb(args)))
        return victim, what if reply.status_code >= 400 else "finished within 0.5 s"
    victim = await median_of(args.repeats, lambda: stream_chat(http, KEYS["victim"], vb(args)))
    hog.cancel()  # a client that leaves: the server aborts its 128 sequences
    return victim, "admitted; still running when the victim finished (then cancelled)"


async def with_burst(http: httpx.AsyncClient, args: argparse.Namespace) -> tuple[Timing, str]:
    """The victim beside --burst streams opened at once by another tenant, each time."""

    async def one() -> Timing:
        burst_body = victim_body(args.burst_tokens)
        started = time.monotonic()
        streams = [
            asyncio.create_task(stream_chat(http, KEYS["burst"], burst_body))
            for _ in range(args.burst)
        ]
        await asyncio.sleep(0.3)  # the burst is in before the victim
        victim = await stream_chat(http, KEYS["victim"], vb(args))
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
        burst_s.append(time.monotonic() - started)
        refused.append(sum(isinstance(o, RuntimeError) and "429" in str(o) for o in outcomes))
        failed = [o for o in outcomes if isinstance(o, BaseException) and "429" not in str(o)]
        if failed:
            raise failed[0]
        return victim

    refused: list[int] = []
    burst_s: list[float] = []
    victim = await median_of(args.repeats, one)
    served = f"{args.burst - max(refused)}-{args.burst - min(refused)} served"
    if not max(refused):
        served = "all served"
        seconds = statistics.median(burst_s)
        served += f" in {seconds:.1f} s ({args.burst * args.burst_tokens / seconds:.0f} tok/s)"
    limit = f", its limit {args.burst_limit} sequences" if args.burst_limit else ""
    return victim, f"{args.burst} streams of {args.burst_tokens} tokens{limit}: {served}"


def vb(args: argparse.Namespace) -> dict[str, Any]:
    return victim_body(args.victim_tokens)


async def measure(base_url: str, args: argparse.Namespace) -> list[Row]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await stream_chat(http, KEYS["victim"], vb(args))  # warm-up
        alone = await median_of(args.repeats, lambda: stream_chat(http, KEYS["victim"], vb(args)))
        rows = [Row("alone", alone, alone, "-")]
        if args.only in (None, "hog"):
            hog_victim, hog = await with_hog(http, args)
            rows.append(Row("n = 128, no max_tokens", hog_victim, alone, hog))
        if args.only in (None, "burst"):
            burst_victim, burst = await with_burst(http, args)
            rows.append(Row(f"tenant with {args.burst} streams", burst_victim, alone, burst))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| scenario | victim TTFT s | target TTFT s | victim total s | target total s | "
        "verdict | the other request(s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.victim.ttft_s:.2f} | {r.ttft_target_s:.2f} | "
            f"{r.victim.total_s:.2f} | {r.total_target_s:.2f} | {r.verdict} | {r.hog} |"
        )
    return "\n".join(lines)


def tenants_file(folder: Path, burst_limit: int | None = None) -> Path:
    """The three tenants by key; the burst tenant's max_concurrent_sequences if given."""
    tenants: list[dict[str, Any]] = [{"name": n, "key": k} for n, k in KEYS.items()]
    if burst_limit is not None:
        tenants[2]["max_concurrent_sequences"] = burst_limit
    path = folder / "tenants.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--kvrelay-bin", default=str(Path(sys.executable).parent / "kvrelay"))
    add("--model", default=None, help="kvrelay serve --model (default: its default model)")
    add("--colocated", action="store_true", help="one worker doing both (default: P/D)")
    add("--max-in-flight", type=int, default=None, help="kvrelay serve --max-in-flight")
    add(
        "--max-num-seqs",
        type=int,
        default=None,
        help="kvrelay serve --max-num-seqs: the engines' batch (default: serve's, 128)",
    )
    add(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for kvrelay serve, as given (repeat it: "
        "--serve-arg=--max-num-batched-tokens --serve-arg=256)",
    )
    add("--only", choices=("hog", "burst"), default=None,
        help="measure the victim alone and beside this one hog only (default: both)")  # fmt: skip
    add("--victim-tokens", type=int, default=50)
    add("--burst", type=int, default=16, help="streams the burst tenant opens at once")
    add("--burst-tokens", type=int, default=100)
    add("--burst-limit", type=int, default=None,
        help="the burst tenant's max_concurrent_sequences (default: none); its streams over "
        "it get 429 and are counted")  # fmt: skip
    add("--repeats", type=int, default=3, help="victim runs per scenario (median)")
    add("--ready-timeout", type=float, default=600.0)
    add("--markdown", type=Path, default=None, help="also write the table here")
    return parser.parse_args(argv)


def serve_args(args: argparse.Namespace, limits: Path) -> tuple[str, ...]:
    """`kvrelay serve`'s arguments beyond the defaults, from this script's flags."""
    extra: tuple[str, ...] = ("--tenant-limits", str(limits))
    if args.max_in_flight is not None:
        extra += ("--max-in-flight", str(args.max_in_flight))
    if args.max_num_seqs is not None:
        extra += ("--max-num-seqs", str(args.max_num_seqs))
    return extra + tuple(args.serve_arg)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tenant-fairness-") as tmp:
        extra = serve_args(args, tenants_file(Path(tmp), args.burst_limit))
        spec = kvrelay_spec("kvrelay", args.kvrelay_bin, args.colocated, args.model, extra)
        with RunningServer(spec, Path(tmp), args.ready_timeout):
            rows = asyncio.run(measure(spec.base_url, args))
    table = markdown(rows)
    print(f"command: {' '.join(spec.command)}\n\n{table}")
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
