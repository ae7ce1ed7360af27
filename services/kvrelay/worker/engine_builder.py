"""A worker's Engine: its EngineArgs with the pool's $KVRELAY_ENGINE_ARGS on top, built without
a tokenizer (workers send token ids; the router detokenizes), in a process whose oneDNN caches
are bounded."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shlex
import threading
from collections.abc import Callable, MutableMapping
from typing import TypeVar

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine

T = TypeVar("T")
ENGINE_ARGS_ENV = "KVRELAY_ENGINE_ARGS"
# oneDNN's primitive cache and ideep's (torch's oneDNN wrapper) keep one entry per matmul shape,
# 1024 each by default, about 0.3 MiB per entry for the packed linears (models/layers.py). A
# prefill worker sees a new row count with nearly every prompt length, so both filled up: its
# RSS grew ~2 MiB per new length, to ~450 MiB more plus glibc's fragmentation around them
# (issue 13's soak; benchmarks/memory_soak.py). 64 entries keep 16 row counts of the 4 linears
# of a layer: a step reuses its own across all layers, and a miss costs ~1 ms per linear.
BOUNDED_CACHE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def apply_env_overrides(args: EngineArgs, environ: dict[str, str] | None = None) -> EngineArgs:
    """`args` with the engine flags in $KVRELAY_ENGINE_ARGS applied on top (e.g.
    "--max-num-seqs 64 --kv-cache-memory 2GiB"). On Kubernetes the operator sets it per pool on
    the Ray worker pods, and the actors a pod hosts inherit its environment, so each pool can
    tune its engines although one router starts them all."""
    flags = (os.environ if environ is None else environ).get(ENGINE_ARGS_ENV, "").strip()
    if not flags:
        return args
    parser = argparse.ArgumentParser(prog=ENGINE_ARGS_ENV, argument_default=argparse.SUPPRESS)
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # only the flags given override
    try:
        given = vars(parser.parse_args(shlex.split(flags)))
    except SystemExit as exc:
        raise ValueError(
            f"${ENGINE_ARGS_ENV} has an unknown or bad engine flag: {flags!r}"
        ) from exc
    return dataclasses.replace(args, **given)


def bound_onednn_caches(environ: MutableMapping[str, str] | None = None) -> None:
    """Cap oneDNN's shape-keyed caches (BOUNDED_CACHE_ENV) unless the environment sets them.
    Read once per process at oneDNN's first matmul: call it before the engine is built."""
    environ = os.environ if environ is None else environ
    for name, value in BOUNDED_CACHE_ENV.items():
        environ.setdefault(name, value)


def build_worker_engine(args: EngineArgs) -> Engine:
    """The engine a worker runs: `args` plus the pool's environment overrides, no tokenizer;
    built on a thread of its own (`in_passing_thread`)."""
    bound_onednn_caches()
    return in_passing_thread(lambda: apply_env_overrides(args).create_engine(with_tokenizer=False))


def freeze_start_up_objects() -> None:
    """Move every object alive after start-up (the model, torch's and Ray's modules) out of
    the garbage collector's sight, as vLLM does: CPython's full collections walk every tracked
    object, and in a worker those are mostly start-up objects that live as long as it does.
    Measured on the 2-core CI machine, 256 running requests, the engine's step loop without
    the model: a full collection every ~100 steps stalled one step for 189 ms (mean step 3.5
    ms); frozen, the longest step was 4.2 ms (mean 2.8). Objects created later are collected
    as before. For a process that serves until it ends (a worker), never for a caller's own
    process: an object frozen here is never collected, even once unreachable in a cycle."""
    gc.collect()
    gc.freeze()


def in_passing_thread(build: Callable[[], T]) -> T:
    """`build()` run on a new thread that ends when it returns; its result, or its exception.

    OpenMP (torch's libgomp) gives every thread that runs a parallel op a team of its own,
    kept until that thread ends, and once it manages more threads than the process has CPUs,
    a thread that waits for work spins 100 times (not ~300,000) before it sleeps. Building
    the engine (weight packing, warm-up matmuls) on the actor's thread left a second team
    alive beside the engine loop's, so with two threads on two cores every step's ~1,000
    parallel ops each woke a sleeping thread (a halted vCPU): a served 1-stream decode step
    took 42-44 ms where the offline engine takes 23-27. Built here, the team ends with the
    thread: 25-28 ms served (worker/engine_loop.py runs every step on its one thread)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(build())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="engine-build")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
