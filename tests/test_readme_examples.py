"""The documentation's Python examples run as written (README.md and docs/*.md): each block is
executed in a fresh interpreter and its printed result checked against what the text says it
prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_block(marker: str) -> str:
    """The documentation's one Python block that contains `marker`."""
    blocks = [
        block for doc in DOCUMENTS for block in BLOCK.findall(doc.read_text()) if marker in block
    ]
    assert len(blocks) == 1, f"expected one documented block with {marker!r}, found {len(blocks)}"
    return str(blocks[0])


def run_block(marker: str) -> tuple[str, str]:
    """Run the documented block with `marker` in a fresh interpreter: (the last line it
    printed, the line its `print(...)  # ...` comment promises)."""
    code = python_block(marker)
    promised = re.search(r"^print\(.*\)  # (.*)$", code, re.MULTILINE)
    assert promised is not None, "the example should say what it prints"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()[-1], promised.group(1)


@pytest.mark.slow
@pytest.mark.e2e
def test_disaggregation_example_runs(default_model_dir: Path) -> None:
    printed, promised = run_block("local_router(")
    assert printed == promised


@pytest.mark.slow
def test_structured_outputs_example_runs(default_model_dir: Path) -> None:
    last, promised = run_block("StructuredOutputs.json_schema(")
    printed = json.loads(last)
    # The schema holds whatever the CPU: these keys, strings within their bounds, nothing else.
    assert set(printed) == {"city", "country", "landmark"}
    assert all(isinstance(v, str) and len(v) <= 32 for v in printed.values())
    # (Not the greedy text itself: a CPU with other rounding may pick another landmark.)
    assert set(json.loads(promised)) == set(printed)
