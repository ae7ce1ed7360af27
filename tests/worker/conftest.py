"""Worker fixtures: the tiny random Llama of the engine tests, and a Ray cluster (the one the
transfer tests started, when it is up)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.conftest import make_engine, tiny_llama_dir

__all__ = ["make_engine", "tiny_llama_dir"]

# The engine knobs of tests/engine/conftest.py's `make_engine`, as EngineArgs fields.
TINY_ENGINE_KWARGS: dict[str, Any] = {
    "num_blocks": 64,
    "block_size": 4,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 16,
    "max_model_len": 256,
    "attention_backend": "torch",
}


@pytest.fixture(scope="session")
def worker_ray(ray_session: None) -> None:
    """The session's Ray cluster (tests/conftest.py)."""
