"""`--model ORG/NAME[@REVISION]`: Hugging Face ids resolved from a Hub cache this test builds
(the HF_HUB_CACHE layout: models--ORG--NAME/snapshots/<commit>/, refs/main), offline, through
kvrelay.common.model_ref, `kvrelay generate` and a served `kvrelay serve` (issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.common.model_ref import (
    HubId,
    ModelNotFoundError,
    ResolvedModel,
    allow_patterns,
    hub_cache_dir,
    hub_offline,
    parse_model_ref,
    resolve_model_ref,
)
from kvrelay.engine.args import EngineArgs
from tests.servers import start_server

REPO = "kvrelay-test/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str, ref: str | None) -> Path:
    """`source`'s files as the snapshot `commit` of `repo_id` in the Hub cache `cache`, each a
    symlink as huggingface_hub makes them (to blobs; here to the source files), and `ref`
    (e.g. "main") pointing at it."""
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).symlink_to(file.resolve())
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    """What resolution looks at (it never loads): a config.json and a weights file."""
    folder = tmp_path / "tiny-source"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"not read by resolution")
    return folder


@pytest.fixture
def offline_cache(
    tmp_path: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, tiny_folder, COMMIT, "main")
    add_snapshot(cache, REPO, tiny_folder, OLD_COMMIT, None)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    yield cache


def test_an_id_and_its_revisions_resolve_to_the_cached_snapshot(offline_cache: Path) -> None:
    snapshots = offline_cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
    for model, commit in [
        (REPO, COMMIT),
        (f"{REPO}@main", COMMIT),
        (f"{REPO}@{COMMIT}", COMMIT),
        (f"{REPO}@{OLD_COMMIT}", OLD_COMMIT),  # a commit with no ref: the snapshot itself
    ]:
        resolved = resolve_model_ref(model)
        assert resolved == ResolvedModel(snapshots / commit, REPO, commit), model
        assert resolved.name == REPO and resolved.pinned == f"{REPO}@{commit}"
    # The pinned form resolves to the same files in any other process (router, workers).
    assert resolve_model_ref(resolve_model_ref(REPO).pinned).path == snapshots / COMMIT


def test_engine_args_resolve_an_id_and_pin_it_for_every_process(offline_cache: Path) -> None:
    args = EngineArgs(model=REPO, max_model_len=None)
    assert args.resolve_model_path().name == COMMIT
    assert args.resolve_model().name == REPO


def test_a_missing_id_offline_is_one_clear_line(offline_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_ref("kvrelay-test/not-cached@v2")
    message = str(info.value)
    assert "\n" not in message
    assert f"not in the Hugging Face cache at {offline_cache}" in message
    assert "HF_HUB_OFFLINE" in message
    assert "`hf download kvrelay-test/not-cached --revision v2`" in message
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model_ref(f"{REPO}@v9")  # a known repo, an unknown revision


def test_an_incomplete_snapshot_offline_names_what_is_missing(
    offline_cache: Path, tmp_path: Path
) -> None:
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    add_snapshot(offline_cache, "kvrelay-test/partial", config_only, COMMIT, "main")
    with pytest.raises(ModelNotFoundError, match=r"has no \*\.safetensors weights"):
        resolve_model_ref("kvrelay-test/partial")
    # With --quantization q8_0 the snapshot needs a GGUF instead.
    with pytest.raises(ModelNotFoundError, match=r"has no \*\.gguf weights"):
        resolve_model_ref(REPO, quantization="q8_0")


def test_a_local_folder_wins_over_an_id_of_the_same_spelling(
    offline_cache: Path, tiny_folder: Path, tmp_path: Path
) -> None:
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert parse_model_ref(REPO) == Path(REPO)  # cwd is tmp_path
    assert resolve_model_ref(REPO) == ResolvedModel(Path(REPO))
    assert resolve_model_ref(str(local)).name == local.name


@pytest.mark.parametrize(
    "model",
    ["./kvrelay-test/SmolLM2-135M-Instruct", "/kvrelay-test/x", "~/org/name", "a/b/c",
     "org\\name", "no-slash", "org/-name", "org/name.", "or..g/name", "org/na--me"],
)  # fmt: skip
def test_paths_and_malformed_ids_are_never_looked_up(offline_cache: Path, model: str) -> None:
    with pytest.raises(ModelNotFoundError, match="ORG/NAME"):
        parse_model_ref(model)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        resolve_model_ref(str(tmp_path))


def test_hub_ids_parse_with_and_without_revision() -> None:
    assert parse_model_ref("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B")
    assert parse_model_ref("Qwen/Qwen3-0.6B@refs/pr/1") == HubId("Qwen/Qwen3-0.6B", "refs/pr/1")
    assert str(HubId("a/b", "v1")) == "a/b@v1"


REPO_FILES = [
    "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pt", "weights.pth",
    "model-q4_1.gguf", "README.md", ".gitattributes", "onnx/model.onnx", "original/params.json",
]  # fmt: skip


@pytest.mark.parametrize(
    ("quantization", "weights"),
    [
        ("none", {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json"}),
        ("q4_1", {"model-q4_1.gguf"}),
        ("q8_0", {"model-q4_1.gguf"}),
        ("auto", {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json", "model-q4_1.gguf"}),
    ],
)  # fmt: skip
def test_a_download_fetches_only_what_kvrelay_loads(quantization: str, weights: set[str]) -> None:
    """huggingface_hub's own filter over a typical repo's files: no pickles, no ONNX, and a
    GGUF only for a quantization that reads it."""
    from huggingface_hub.utils import filter_repo_objects

    fetched = set(filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns(quantization)))
    common = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja"}  # fmt: skip
    assert fetched == common | weights


def test_the_cache_folder_and_offline_switch_are_read_now() -> None:
    home = str(Path.home())
    assert hub_cache_dir({}) == Path(home) / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}) == Path("/c")
    assert [hub_offline({"HF_HUB_OFFLINE": v}) for v in ("1", "true", "ON", "0", "")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert hub_offline({"TRANSFORMERS_OFFLINE": "1"})


def _kvrelay(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_online_an_unreachable_hub_is_one_line_and_the_cache_still_serves(
    tmp_path: Path, tiny_folder: Path
) -> None:
    """Not offline, but the Hub is a closed port: a cached id resolves without it (cache
    first), an uncached one fails with one line, exit 2."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, tiny_folder, COMMIT, "main")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    code = (
        f"from kvrelay.common.model_ref import resolve_model_ref as r; print(r('{REPO}').path.name)"
    )
    cached = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip
    assert cached.stdout.strip() == COMMIT, cached.stderr
    out = _kvrelay(["generate", "hi", "--model", "kvrelay-test/uncached"], env)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "kvrelay-test/uncached" in out.stderr and "cannot be reached" in out.stderr


@pytest.fixture(scope="module")
def smollm_hub_cache(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """The default model as a Hub id in a cache of its own; the environment that reads it
    offline."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    add_snapshot(cache, REPO, default_model_dir, COMMIT, "main")
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_generate_with_a_hub_id_offline_gives_the_folders_tokens(
    smollm_hub_cache: dict[str, str], default_model_dir: Path
) -> None:
    flags = ["generate", "The capital of France is", "--max-tokens", "8", "--max-model-len", "256"]
    by_id = _kvrelay([*flags, "--model", REPO], smollm_hub_cache)
    assert by_id.returncode == 0, by_id.stderr
    assert "finish_reason=length tokens=8" in by_id.stdout
    by_folder = _kvrelay([*flags, "--model", str(default_model_dir)], {})
    assert by_id.stdout == by_folder.stdout


@pytest.mark.slow
def test_a_too_long_max_model_len_for_a_hub_model_is_one_line(
    smollm_hub_cache: dict[str, str],
) -> None:
    out = _kvrelay(["serve", "--model", REPO, "--max-model-len", "99999999"], smollm_hub_cache)
    assert out.returncode == 2
    assert out.stderr == (
        "kvrelay: error: argument --max-model-len: 99999999 is longer than the model's 8192 "
        "positions\n"
    )
    assert out.stderr.count("\n") == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_a_hub_id_from_the_local_cache_serves_offline(
    smollm_hub_cache: dict[str, str], tmp_path: Path
) -> None:
    """The issue's "done when": `kvrelay serve --model ORG/NAME` with HF_HUB_OFFLINE=1, the
    router and both workers (prefill, decode) on the one snapshot, answering a completion
    under the Hub id."""
    server = start_server(
        tmp_path, "--model", REPO, "--kv-cache-memory", "128MiB", "--max-local-prefill-tokens",
        "0", env=smollm_hub_cache,
    )  # fmt: skip
    try:
        with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=30) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == [REPO]
        body = {"model": REPO, "prompt": "The capital of France is", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"{server.http_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["model"] == REPO
        assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["text"]
    finally:
        assert server.stop() == 0, server.log()
    assert "1 prefill + 1 decode worker(s)" in server.log()


def test_model_pull_takes_a_cached_id_without_the_hub(tmp_path: Path, tiny_folder: Path) -> None:
    """What the operator's init containers run: a seeded cache serves even with the Hub
    unreachable (cache first), and a local folder is refused as nothing to pull."""
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, REPO, tiny_folder, COMMIT, "main")
    env = {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}
    out = _kvrelay(["model", "pull", REPO], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{REPO}@{COMMIT} ready: {snapshot}\n"
    folder = _kvrelay(["model", "pull", str(tiny_folder)], env)
    assert folder.returncode == 2 and "not a Hugging Face id: nothing to pull" in folder.stderr
    gguf = _kvrelay(["model", "pull", REPO, "--quantization", "q4_1"], env)
    # The cached snapshot has no GGUF and the Hub cannot complete it: said in one line.
    assert gguf.returncode == 2 and gguf.stderr.count("\n") == 1
    assert r"has no *.gguf weights" in gguf.stderr


PROBE = """
import sys
from kvrelay.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
ray = sys.modules.get("ray")  # imported by the router's modules, but not started
print(code, "torch" in sys.modules, ray is not None and ray.is_initialized())
"""


@pytest.mark.parametrize(
    "command",
    [["serve"], ["router", "--ray-address", "auto"], ["worker", "--role", "decode"],
     ["generate", "hi"]],
    ids=lambda command: command[0],
)  # fmt: skip
def test_an_id_not_in_the_cache_stops_every_command_before_ray_or_torch(
    command: list[str], tmp_path: Path
) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *command, "--model", "kvrelay-test/absent"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    # Exit 2, no torch imported (no model load began), no Ray started.
    assert out.stdout.strip() == "2 False False", out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "not in the Hugging Face cache" in out.stderr
