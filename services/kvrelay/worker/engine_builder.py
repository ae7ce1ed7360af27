"""Build a worker's Engine from EngineArgs; a model folder without tokenizer files is served
on token ids alone (tokenizer None), as the tests' tiny random models are."""

from __future__ import annotations

from pathlib import Path

import torch

from kvrelay.engine.args import EngineArgs
from kvrelay.engine.engine import Engine

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


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
