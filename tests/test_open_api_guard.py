"""`kvrelay serve` / `kvrelay router` refuse to serve off loopback without authentication
(cli_flags.check_open_api), at parse time, in one line naming the flag and the three ways
out; loopback without a key, a key, client certificates, keys in --tenant-limits and
--allow-unauthenticated are accepted, the last with one WARNING line from the real server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvrelay.api.server import ApiServer, ServerConfig
from kvrelay.cli import build_parser, main
from kvrelay.cli_flags import is_loopback, open_api_error
from kvrelay.cli_serve import _server_config
from kvrelay.router.router import ModelCard, Router
from kvrelay.router.workers import WorkerRegistry
from tests.test_cli_flags import PROBE

COMMANDS = {"serve": ["serve"], "router": ["router", "--ray-address", "auto"]}
WAYS_OUT = ("KVRELAY_API_KEY", "--api-key-env", "--ssl-ca-certs", "--allow-unauthenticated")
OPEN = [
    ("--http-host", "0.0.0.0"),
    ("--grpc-host", "0.0.0.0"),
    ("--grpc-host", "::"),
    ("--http-host", "[::]"),
    ("--http-host", "10.1.2.3"),
    ("--http-host", "::ffff:10.1.2.3"),
    ("--http-host", "kvrelay.example"),  # a name may resolve to anything
    ("--http-host", "localhost.example"),
]
LOOPBACK = ["127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost", "LOCALHOST", "localhost."]


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRELAY_API_KEY", raising=False)
    monkeypatch.delenv("OTHER_KEY", raising=False)


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    assert out == "" and err.count("\n") == 1, err
    return err.rstrip("\n")


def _config(argv: list[str]) -> ServerConfig:
    """The flags parsed and checked as `main` does; the server's configuration."""
    ns = build_parser().parse_args(argv)
    ns.check_flags(ns)
    config: ServerConfig = _server_config(ns)
    return config


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("flag", "host"), OPEN)
def test_an_open_address_without_a_key_is_one_line_naming_the_flag_and_the_ways_out(
    capsys: pytest.CaptureFixture[str], command: str, flag: str, host: str
) -> None:
    line = _error_line(capsys, [*COMMANDS[command], flag, host])
    assert line.startswith(f"kvrelay {command}: error: argument {flag}: {host} is not a "), line
    assert all(way in line for way in WAYS_OUT), line
    assert line.endswith(f"(see kvrelay {command} --help)"), line


def test_the_message_names_the_variable_api_key_env_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _error_line(capsys, ["serve", "--http-host", "0.0.0.0", "--api-key-env", "OTHER_KEY"])
    assert "set OTHER_KEY (--api-key-env names the variable)" in line, line


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_without_a_key_is_accepted(host: str) -> None:
    config = _config(["serve", "--http-host", host, "--grpc-host", host])
    assert (config.api_key, config.open_api) == (None, False)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_key_from_the_environment_or_the_flag_is_accepted(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    wide = [*COMMANDS[command], "--http-host", "0.0.0.0", "--grpc-host", "::"]
    assert _config([*wide, "--api-key", "flag-key"]).api_key == "flag-key"
    monkeypatch.setenv("KVRELAY_API_KEY", "env-key")
    assert _config(wide).open_api is False
    monkeypatch.setenv("KVRELAY_API_KEY", "")  # empty means no key: refused again
    with pytest.raises(ValueError, match=r"--http-host: 0\.0\.0\.0"):
        _config(wide)
    monkeypatch.setenv("OTHER_KEY", "other")
    assert _config([*wide, "--api-key-env", "OTHER_KEY"]).api_key == "other"


def test_client_certificates_are_authentication(tmp_path: Path) -> None:
    # Parse time only checks the files are readable; the server reads them at start.
    pem = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in pem.values():
        path.write_text("not read at parse time")
    tls = ["--ssl-certfile", str(pem["cert"]), "--ssl-keyfile", str(pem["key"])]
    with pytest.raises(ValueError, match="--http-host"):  # TLS alone authenticates nobody
        _config(["serve", "--http-host", "0.0.0.0", *tls])
    config = _config(["serve", "--http-host", "0.0.0.0", *tls, "--ssl-ca-certs", str(pem["ca"])])
    assert config.mtls and not config.open_api


def test_keys_in_tenant_limits_are_authentication_and_limits_alone_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed, unkeyed, from_env = (tmp_path / f"{n}.json" for n in ("keyed", "unkeyed", "env"))
    keyed.write_text(json.dumps({"tenants": [{"name": "a", "key": "sk-a"}]}))
    unkeyed.write_text(json.dumps({"tenants": [{"name": "a", "requests_per_minute": 5}]}))
    from_env.write_text(json.dumps({"tenants": [{"name": "a", "key_env": "TEAM_A_KEY"}]}))
    monkeypatch.setenv("TEAM_A_KEY", "sk-from-env")
    wide = ["serve", "--http-host", "0.0.0.0"]
    assert _config([*wide, "--tenant-limits", str(keyed)]).open_api is False
    assert _config([*wide, "--tenant-limits", str(from_env)]).open_api is False
    with pytest.raises(ValueError, match="--http-host"):
        _config([*wide, "--tenant-limits", str(unkeyed)])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_allow_unauthenticated_accepts_the_risk_and_marks_the_config(command: str) -> None:
    wide = [*COMMANDS[command], "--http-host", "0.0.0.0", "--allow-unauthenticated"]
    assert _config(wide).open_api is True
    # Nothing open, nothing to warn about: with a key, or on loopback.
    assert _config([*wide, "--api-key", "k"]).open_api is False
    local = [*COMMANDS[command], "--allow-unauthenticated"]
    assert _config(local).open_api is False


def test_is_loopback_and_open_api_error_directly() -> None:
    assert all(is_loopback(host) for host in LOOPBACK)
    assert not any(is_loopback(host) for _, host in OPEN)
    hosts = {"--http-host": "127.0.0.1", "--grpc-host": "0.0.0.0"}
    assert open_api_error(hosts, authenticated=True, key_env="K") is None
    problem = open_api_error(hosts, authenticated=False, key_env="K")
    assert problem is not None and problem.startswith("argument --grpc-host: 0.0.0.0 ")


def test_a_real_process_refuses_before_ray_or_a_model() -> None:
    """Exit 2, one line, neither Ray nor torch imported, before anything starts."""
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_API_KEY"}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "serve", "--http-host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    code, parse_s, loaded = out.stdout.split(" ", 2)
    assert code == "2", out.stderr
    assert loaded.strip() == "[]", f"the refusal imported {loaded}"  # no Ray, torch or HF
    assert out.stderr.count("\n") == 1 and "--allow-unauthenticated" in out.stderr, out.stderr
    assert float(parse_s) < 5.0 and time.perf_counter() - started < 60, parse_s


@pytest.fixture
def router() -> Iterator[Router]:
    """A router with no workers: /v1/models answers from its model card."""
    yield Router.create(WorkerRegistry(), None, ModelCard("open-model", 64, 0))


async def _serve_and_get(router: Router, config: ServerConfig, headers: dict[str, str]) -> int:
    server = ApiServer(router, config)
    await server.start()
    try:
        url = f"http://127.0.0.1:{server.http_port}/v1/models"
        async with httpx.AsyncClient(timeout=10) as client:
            return (await client.get(url, headers=headers)).status_code
    finally:
        server.request_stop()
        await server.drain_and_stop()


async def test_an_accepted_open_server_serves_on_every_address_and_warns_once(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig("0.0.0.0", 0, "0.0.0.0", 0, drain_timeout_s=0, open_api=True)
    with caplog.at_level(logging.WARNING, logger="kvrelay.api.server"):
        assert await _serve_and_get(router, config, {}) == 200
    warned = [r for r in caplog.records if "--allow-unauthenticated" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "0.0.0.0" in warned[0].getMessage()


async def test_a_keyed_server_on_every_address_warns_nothing_and_wants_the_key(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig("0.0.0.0", 0, "0.0.0.0", 0, api_key="k", drain_timeout_s=0)
    with caplog.at_level(logging.WARNING, logger="kvrelay.api.server"):
        assert await _serve_and_get(router, config, {}) == 401
    assert not [r for r in caplog.records if "--allow-unauthenticated" in r.getMessage()]
    config = ServerConfig("0.0.0.0", 0, "0.0.0.0", 0, api_key="k", drain_timeout_s=0)
    assert await _serve_and_get(router, config, {"Authorization": "Bearer k"}) == 200
