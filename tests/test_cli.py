"""The `kvrelay` command as a user runs it: help, generate, chat over stdin, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVRELAY = [sys.executable, "-m", "kvrelay.cli"]


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVRELAY, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False
    )


def test_help_explains_every_command() -> None:
    out = run(["--help"])
    assert out.returncode == 0
    for command in ("generate", "chat", "serve", "router", "worker", "operator", "model"):
        assert command in out.stdout
    gen = run(["generate", "--help"])
    assert "--max-num-batched-tokens" in gen.stdout and "token budget" in gen.stdout
    serve = run(["serve", "--help"])
    for flag in ("--colocated", "--num-prefill", "--http-port", "--grpc-port", "--ray-address"):
        assert flag in serve.stdout
    assert "kvrelay serve --colocated" in serve.stdout  # the examples


@pytest.mark.slow
def test_generate_prints_the_completion(default_model_dir: Path) -> None:
    out = run(
        [
            "generate",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "12",
            "--model",
            str(default_model_dir),
        ]
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "finish_reason=" in out.stdout


@pytest.mark.slow
def test_chat_streams_replies_and_exits_on_command(default_model_dir: Path) -> None:
    out = run(
        ["chat", "--max-tokens", "12", "--temperature", "0", "--model", str(default_model_dir)],
        stdin="What is the capital of France?\n/exit\n",
    )
    assert out.returncode == 0, out.stderr
    assert "assistant> " in out.stdout
    assert "Paris" in out.stdout


def test_bad_arguments_exit_with_a_clear_message(tmp_path: Path) -> None:
    out = run(["generate", "hi", "--temperature", "-1", "--model", str(tmp_path)])
    assert out.returncode == 2
    assert out.stderr == (
        "kvrelay generate: error: argument --temperature: must be >= 0, got -1 "
        "(see kvrelay generate --help)\n"
    )
    missing = run(["generate", "hi", "--model", str(tmp_path / "nope")])
    assert missing.returncode == 2
    assert "argument --model: model" in missing.stderr and "not found" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_serve_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrelay.cli import build_parser
    from kvrelay.cli_serve import _server_config

    parser = build_parser()
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    assert _server_config(parser.parse_args(["serve"])).api_key is None
    monkeypatch.setenv("KVRELAY_API_KEY", "from-env")
    assert _server_config(parser.parse_args(["serve"])).api_key == "from-env"
    flagged = parser.parse_args(["serve", "--api-key", "from-flag", "--http-port", "9000"])
    config = _server_config(flagged)
    assert (config.api_key, config.http_port, config.http_host) == ("from-flag", 9000, "127.0.0.1")


def test_router_flags_become_one_router_config() -> None:
    """The router's flags map once, at parse time, to RouterConfig's names (the object the
    relay gets): no flag means RouterConfig's own defaults; --migration-timeout keeps its
    spelling and sets migration_wait_s."""
    from kvrelay.cli import build_parser
    from kvrelay.cli_serve import _router_config
    from kvrelay.config import RouterConfig

    parser = build_parser()
    for command in (["serve"], ["router", "--ray-address", "auto"]):
        assert _router_config(parser.parse_args(command)) == RouterConfig()
    flags = ["--migration-timeout", "5", "--max-local-prefill-tokens", "0", "--max-n", "4"]
    flags += ["--max-in-flight", "8", "--max-queued", "2", "--routing-policy", "round_robin"]
    flags += ["--kv-transfer-failure", "fail", "--served-model-name", "m"]
    assert _router_config(parser.parse_args(["router", "--ray-address", "auto", *flags])) == (
        RouterConfig(
            max_local_prefill_tokens=0,
            kv_transfer_failure="fail",
            migration_wait_s=5.0,
            max_in_flight=8,
            max_queued=2,
            max_n=4,
            routing_policy="round_robin",
            served_model_name="m",
        )
    )
