"""Fixtures shared by the API tests: the real `openai` client on the session's P/D server
(tests/conftest.py's kvrelay_server) and the default model's tokenizer. A module that needs
another server defines its own `client`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.servers import ServerProcess


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def client(kvrelay_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{kvrelay_server.http_url}/v1", api_key="unused", max_retries=0)
