"""argparse `type=` checks for the `kvrelay` commands' serving, sampling and chat flags (the
engine's are in engine/args.py), and the one-line error for rules between flags.

Every value is checked while the command line is parsed, so a bad one is argparse's
`error: argument --FLAG: ...` with exit code 2, before Ray, a model or a server starts.
Nothing here imports torch or starts anything.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from kvrelay.engine.args import parse_bytes

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _typed(convert: Callable[[str], Any], check: Callable[[Any], str | None]) -> Any:
    """A `type=`: `convert(text)` (argparse's "invalid int value" when it fails), then
    `check(value)`, which returns what is wrong (None: nothing)."""

    def parse(text: str) -> Any:
        value = convert(text)
        problem = check(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def int_at_least(low: int) -> Any:
    return _typed(int, lambda v: None if v >= low else f"must be >= {low}")


def seconds(*, zero: bool) -> Any:
    """A duration in seconds: > 0, or >= 0 where `zero` means something (e.g. "no wait")."""

    def check(value: float) -> str | None:
        if value != value or value == float("inf"):
            return "must be a finite number of seconds"
        if value < 0 or (value == 0 and not zero):
            return "must be >= 0 seconds" if zero else "must be > 0 seconds"
        return None

    return _typed(float, check)


def port(text: str) -> int:
    """A TCP port, 0 (the system picks a free one) to 65535."""
    return _typed(int, lambda v: None if 0 <= v <= 65535 else "must be a port in [0, 65535]")(text)


def size(text: str) -> int:
    """A size in bytes: 4194304, 4MiB or 4MB."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a size such as 4194304, 4MiB or 4MB, got {text}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def readable_file(path: str) -> str:
    """A file this process can read (a PEM, a secret), checked before anything starts."""
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {path}: no such readable file")
    return path


def http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text}")
    return text


def log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(LOG_LEVELS)} (any case), got {text}"
        )
    return logging.getLevelName(logging.getLevelName(text.upper()))


def sampling(field: str, convert: Callable[[str], Any]) -> Any:
    """A sampling flag checked by SamplingParams' own rule for `field` (the rules between
    fields, min_tokens <= max_tokens, are checked once all flags are read)."""
    from kvrelay.common.sampling_params import SamplingParams

    def check(value: Any) -> str | None:
        try:
            SamplingParams(**{"max_tokens": None, field: value})
        except ValueError as exc:
            return str(exc).removeprefix(f"{field} ").rsplit(", got ", 1)[0]
        return None

    return _typed(convert, check)


def flag_error(
    parser: argparse.ArgumentParser, exc: ValueError, flags: Mapping[str, str]
) -> NoReturn:
    """Exit as argparse does (code 2, one line) for a rule between values, naming the flag
    (`naming_the_flag`)."""
    parser.error(naming_the_flag(str(exc), flags))


def naming_the_flag(message: str, flags: Mapping[str, str]) -> str:
    """`message` about a field (it starts `field ...` or `field=...`) as argparse says it of
    the flag: `argument --flag: ...`; other messages as they are."""
    for field, flag in flags.items():
        if message.startswith((f"{field} ", f"{field}=")):
            return f"argument {flag}: {message.removeprefix(field).lstrip(' =')}"
    return message


def tenant_limits_file(path: str) -> str:
    """--tenant-limits: a file that parses now (the server would refuse it at start)."""
    from kvrelay.router.tenant_limits import load_table

    try:
        load_table(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def header_name(text: str) -> str:
    """An HTTP header name (RFC 9110 token), not one the server reads for itself."""
    if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", text):
        raise argparse.ArgumentTypeError(f"must be an HTTP header name, got {text!r}")
    if text.lower() in ("authorization", "content-type", "content-length", "host"):
        raise argparse.ArgumentTypeError(f"{text} is read by the server itself; name another")
    return text


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches this machine only: 127.0.0.0/8, ::1 or `localhost`.
    Any other name counts as open, since it may resolve to any address."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def open_api_error(hosts: Mapping[str, str], authenticated: bool, key_env: str) -> str | None:
    """What is wrong with serving on `hosts` (flag -> address), or None: an address that is
    not loopback while nothing authenticates a caller (no API key, no tenant key, no client
    certificates). The rule: nothing we listen on serves data without authentication."""
    if authenticated:
        return None
    for flag, host in hosts.items():
        if not is_loopback(host):
            return (
                f"argument {flag}: {host} is not a loopback address and the API has no "
                f"authentication, so anyone who can reach it could use it: set {key_env} "
                "(--api-key-env names the variable), require client certificates with "
                "--ssl-ca-certs, or pass --allow-unauthenticated to accept the risk"
            )
    return None


def check_open_api(ns: argparse.Namespace, api_key: str | None) -> bool:
    """Whether the APIs serve off loopback without authentication, which only
    --allow-unauthenticated accepts (else ValueError: open_api_error's line). Keys listed in
    --tenant-limits authenticate too: with any listed, every /v1 call needs one."""
    keys: dict[str, str] = {}
    if ns.tenant_limits:
        from kvrelay.router.tenant_limits import load_table

        keys = load_table(ns.tenant_limits).keys
    authenticated = bool(api_key or ns.ssl_ca_certs or keys)
    hosts = {"--http-host": ns.http_host, "--grpc-host": ns.grpc_host}
    problem = open_api_error(hosts, authenticated, ns.api_key_env)
    if problem is not None and not ns.allow_unauthenticated:
        raise ValueError(problem)
    return problem is not None
