"""The local Ray settings without starting Ray: the one-machine switch is set for the start
and restored after (env and the value Ray already read), loopback is recognised in each form
Ray's listeners show, and each way Ray could end up exposed is logged with what to do."""

from __future__ import annotations

import logging

import pytest
from ray._private import ray_constants

from kvrelay.worker.ray_options import (
    RAY_AUTH_MODE_ENV,
    RAY_ONE_MACHINE_ENV,
    is_loopback,
    one_machine_ray,
    warn_if_auth_disabled,
    warn_unless_loopback,
)


def test_one_machine_ray_is_set_within_and_restored_after() -> None:
    environ: dict[str, str] = {}
    before = ray_constants.ENABLE_RAY_CLUSTER
    with one_machine_ray(environ):
        assert environ[RAY_ONE_MACHINE_ENV] == "0"  # for the processes Ray starts
        assert ray_constants.ENABLE_RAY_CLUSTER is False  # for this one, imported already
        import ray
        from ray._private.services import get_node_ip_address

        if not ray.is_initialized():  # else it is the running node's address
            assert get_node_ip_address() == "127.0.0.1"  # what ray.init resolves 127.0.0.1 to
    assert environ == {}
    assert ray_constants.ENABLE_RAY_CLUSTER is before


def test_one_machine_ray_restores_a_value_the_environment_had() -> None:
    environ = {RAY_ONE_MACHINE_ENV: "1"}
    with one_machine_ray(environ):
        assert environ[RAY_ONE_MACHINE_ENV] == "0"
    assert environ == {RAY_ONE_MACHINE_ENV: "1"}


def test_one_machine_ray_is_restored_when_the_start_fails() -> None:
    environ: dict[str, str] = {}
    before = ray_constants.ENABLE_RAY_CLUSTER
    with pytest.raises(RuntimeError, match="no GCS"), one_machine_ray(environ):
        raise RuntimeError("no GCS")
    assert environ == {}
    assert ray_constants.ENABLE_RAY_CLUSTER is before


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),  # an IPv6 socket bound to IPv4 loopback (Ray's gRPC)
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.2", False),
        ("::ffff:192.0.2.2", False),
        ("localhost", False),  # a name, not an address: nothing here resolves it
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_node_off_loopback_is_logged_with_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrelay.worker.ray_options"):
        assert warn_unless_loopback("127.0.0.1") is True
        assert not caplog.records
        assert warn_unless_loopback("192.0.2.2") is False
    (record,) = caplog.records
    assert "192.0.2.2" in record.getMessage()
    assert "--ray-address" in record.getMessage()
    assert "docs/operations.md" in record.getMessage()


@pytest.mark.parametrize("mode", [None, "token", "TOKEN", " token "])
def test_auth_left_on_is_not_logged(mode: str | None, caplog: pytest.LogCaptureFixture) -> None:
    environ = {} if mode is None else {RAY_AUTH_MODE_ENV: mode}
    with caplog.at_level(logging.WARNING, logger="kvrelay.worker.ray_options"):
        assert warn_if_auth_disabled(environ) is True
    assert not caplog.records
    # Unset stays unset: Ray turns token auth on by itself only when the variable is unset.
    assert environ == ({} if mode is None else {RAY_AUTH_MODE_ENV: mode})


@pytest.mark.parametrize("mode", ["disabled", "", "k8s"])
def test_auth_turned_off_is_logged(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrelay.worker.ray_options"):
        assert warn_if_auth_disabled({RAY_AUTH_MODE_ENV: mode}) is False
    (record,) = caplog.records
    assert f"{RAY_AUTH_MODE_ENV}={mode}" in record.getMessage()
    assert "unset it" in record.getMessage()
