"""The download path of `--model ORG/NAME`, against a Hub on loopback (tests/fake_hub.py):
only what kvrelay loads is fetched, with huggingface_hub's progress bar and HF_TOKEN, into
the Hugging Face cache; a cached snapshot is used without asking the Hub again; the Hub's
refusals (unknown repo or revision, gated) are one line each, exit 2 (issue 40)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub, serve_hub

REPO = "kvrelay-test/tiny"
COMMIT = "5" * 40
TOKEN = "hf_kvrelayTestToken123"  # a fake; the test checks it is never printed
REPO_FILES = {
    "config.json": '{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": "weights",
    # Distinct contents: files with the same bytes share one blob, fetched once.
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 128}',
    "generation_config.json": '{"do_sample": false}',
    "pytorch_model.bin": "a pickle kvrelay never loads",
    "model-q8_0.gguf": "gguf",
    "README.md": "# tiny",
    "onnx/model.onnx": "onnx",
}
LOADED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "generation_config.json"}  # fmt: skip


@pytest.fixture
def repo_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "repo"
    for name, text in REPO_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.fixture
def hub(repo_folder: Path) -> Iterator[FakeHub]:
    with serve_hub(REPO, repo_folder, COMMIT) as hub:
        yield hub


def pull(
    hub: FakeHub, cache: Path, *args: str, token: bool = True
) -> subprocess.CompletedProcess[str]:
    """`kvrelay model pull ARGS` against `hub` (HF_ENDPOINT is read at huggingface_hub's
    import, so a process of its own), not offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache)}
    if token:
        env["HF_TOKEN"] = TOKEN
    return subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "model", "pull", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_download_fetches_what_kvrelay_loads_with_a_progress_bar(
    hub: FakeHub, tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    out = pull(hub, cache, REPO)
    assert out.returncode == 0, out.stderr
    snapshot = cache / "models--kvrelay-test--tiny" / "snapshots" / COMMIT
    assert out.stdout == f"{REPO}@{COMMIT} ready: {snapshot}\n"
    assert set(hub.fetched) == LOADED  # no pickle, no GGUF, no README or ONNX
    assert {p.name for p in snapshot.iterdir()} == LOADED
    assert (snapshot / "config.json").read_text() == REPO_FILES["config.json"]
    assert f"Fetching {len(LOADED)} files" in out.stderr  # huggingface_hub's progress bar
    assert f"Bearer {TOKEN}" in hub.tokens  # HF_TOKEN went to the Hub...
    assert TOKEN not in out.stdout + out.stderr  # ...and nowhere else


def test_a_cached_snapshot_is_used_without_asking_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    assert pull(hub, cache, REPO).returncode == 0
    asked = len(hub.requests)
    again = pull(hub, cache, f"{REPO}@main")
    assert again.returncode == 0, again.stderr
    assert len(hub.requests) == asked  # cache first: not one request
    pinned = pull(hub, cache, f"{REPO}@{COMMIT}")
    assert pinned.stdout == again.stdout and len(hub.requests) == asked


def test_a_quantization_adds_the_gguf_to_the_snapshot(hub: FakeHub, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    assert pull(hub, cache, REPO).returncode == 0
    hub.fetched.clear()
    out = pull(hub, cache, REPO, "--quantization", "q8_0")
    assert out.returncode == 0, out.stderr
    # The cached snapshot lacked the GGUF: only the files it did not have are fetched.
    assert hub.fetched == ["model-q8_0.gguf"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("kvrelay-test/elsewhere", "does not exist on the Hub, or is private (set HF_TOKEN"),
        (f"{REPO}@v9", "has no revision 'v9'"),
    ],
)
def test_the_hubs_refusals_are_one_line(
    hub: FakeHub, tmp_path: Path, model: str, message: str
) -> None:
    out = pull(hub, tmp_path / "hub", model)
    assert out.returncode == 2
    assert out.stderr == f"kvrelay: error: the Hugging Face model {model} {message}" + (
        "\n" if message.endswith("'v9'") else " to one that reads it)\n"
    )


def test_a_gated_model_without_a_token_says_how_to_get_in(
    repo_folder: Path, tmp_path: Path
) -> None:
    with serve_hub(REPO, repo_folder, COMMIT, gated=True) as hub:
        refused = pull(hub, tmp_path / "hub", REPO, token=False)
        assert refused.returncode == 2
        assert refused.stderr == (
            f"kvrelay: error: the Hugging Face model {REPO} is gated: accept its terms on "
            "huggingface.co and set HF_TOKEN\n"
        )
        allowed = pull(hub, tmp_path / "hub", REPO)
        assert allowed.returncode == 0, allowed.stderr
