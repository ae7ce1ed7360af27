"""A worker's Engine: its EngineArgs with the pool's $KVRELAY_ENGINE_ARGS on top, built without
a tokenizer (workers send token ids; the router detokenizes)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine

ENGINE_ARGS_ENV = "KVRELAY_ENGINE_ARGS"


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


def build_worker_engine(args: EngineArgs) -> Engine:
    """The engine a worker runs: `args` plus the pool's environment overrides, no tokenizer."""
    return apply_env_overrides(args).create_engine(with_tokenizer=False)
