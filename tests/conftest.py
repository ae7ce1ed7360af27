"""Session-wide fixtures: the real default model, pulled and converted once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (`make test` pulls it before pytest runs)."""
    from kvrelay.models.default_model import pull_default_model

    return pull_default_model(progress=False)
