"""Build a worker's Engine from EngineArgs; a model folder without tokenizer files is served
on token ids alone (tokenizer None), as the tests' tiny random models are."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from pathlib import Path

import torch

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


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


def build_engine(args: EngineArgs) -> Engine:
    """As `EngineArgs.create_engine`, but the tokenizer is optional."""
    if not has_tokenizer(args.resolve_model_path()):
        return _build_without_tokenizer(args)
    return args.create_engine()


def _build_without_tokenizer(args: EngineArgs) -> Engine:
    from kvrelay.models.loader import load_model
    from kvrelay_kernels import select_backend

    path = args.resolve_model_path()
    config = args.create_engine_config(path)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model, _ = load_model(
        path,
        select_backend(config.attention_backend),
        dtype=getattr(torch, config.dtype),
        max_positions=config.max_model_len,
    )
    model.prepack()
    return Engine(config, model, tokenizer=None)
