"""The backoff policy, the deadline and the status -> exception mapping; no server."""

from __future__ import annotations

import random

import grpc
import pytest

from kvrelay.client import errors
from kvrelay.client.options import API_KEY_ENV, resolve_api_key
from kvrelay.client.retry import Deadline, RetryPolicy


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    policy = RetryPolicy(initial_backoff=0.1, multiplier=2.0, max_backoff=1.0, jitter=0.2)
    rng = random.Random(0)
    for attempt, base in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)]:
        delays = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0.8 * base <= d <= base for d in delays)
        assert max(delays) - min(delays) > 0.05 * base  # jitter actually spreads them


def test_no_jitter_is_exact() -> None:
    policy = RetryPolicy(initial_backoff=0.5, multiplier=3.0, jitter=0.0)
    assert policy.backoff(2) == pytest.approx(4.5)


UNAVAILABLE = errors.UnavailableError("down", grpc.StatusCode.UNAVAILABLE)


def test_only_unavailable_and_overload_are_retried() -> None:
    policy = RetryPolicy(max_retries=3)
    assert policy.delay_before_retry(0, UNAVAILABLE, None) is not None
    overloaded = errors.OverloadedError("full")
    assert policy.delay_before_retry(0, overloaded, None) is not None
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.NOT_FOUND,
    ):
        assert policy.delay_before_retry(0, errors.error_from_status(code, "x"), None) is None


def test_retries_are_bounded_by_count_and_deadline() -> None:
    policy = RetryPolicy(max_retries=2, initial_backoff=0.1, jitter=0.0)
    assert policy.delay_before_retry(1, UNAVAILABLE, None) == pytest.approx(0.2)
    assert policy.delay_before_retry(2, UNAVAILABLE, None) is None  # retries spent
    assert policy.delay_before_retry(0, UNAVAILABLE, 0.05) is None  # would outlast the deadline
    assert RetryPolicy(max_retries=0).delay_before_retry(0, UNAVAILABLE, None) is None


def test_retry_after_is_honoured_as_a_floor() -> None:
    policy = RetryPolicy(initial_backoff=0.1, jitter=0.0)
    hinted = errors.OverloadedError("full", retry_after=2.5)
    assert policy.delay_before_retry(0, hinted, None) == pytest.approx(2.5)
    assert policy.delay_before_retry(0, hinted, 2.0) is None  # hint beyond the deadline
    small_hint = errors.OverloadedError("full", retry_after=0.01)
    assert policy.delay_before_retry(0, small_hint, None) == pytest.approx(0.1)


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=1.5)


def test_deadline_counts_down() -> None:
    now = [100.0]
    deadline = Deadline(2.0, clock=lambda: now[0])
    assert deadline.remaining() == pytest.approx(2.0) and not deadline.expired
    now[0] = 102.5
    assert deadline.expired and deadline.remaining() == pytest.approx(-0.5)
    assert Deadline(None).remaining() is None and not Deadline(None).expired


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.OverloadedError),
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
        (grpc.StatusCode.UNAUTHENTICATED, errors.AuthenticationError),
        (grpc.StatusCode.PERMISSION_DENIED, errors.AuthenticationError),
        (grpc.StatusCode.CANCELLED, errors.RequestCancelledError),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.ABORTED, errors.KVRelayError),
    ],
)
def test_status_codes_map_to_typed_errors(code: grpc.StatusCode, cls: type) -> None:
    error = errors.error_from_status(code, "temperature must be >= 0")
    assert type(error) is cls and error.code is code
    assert error.details == "temperature must be >= 0" and "temperature" in str(error)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((("retry-after", "1.5"),), 1.5),
        ((("Retry-After", b"2"),), 2.0),
        ((("other", "1"),), None),
        ((("retry-after", "soon"),), None),
        ((("retry-after", "-1"),), None),
        ((("retry-after", "inf"),), None),
        (None, None),
    ],
)
def test_retry_after_parsing(metadata: object, expected: float | None) -> None:
    assert errors.parse_retry_after(metadata) == expected


def test_api_key_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("explicit") == "explicit"
    assert resolve_api_key("") is None  # an explicit empty key opts out of the environment's
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(None) is None
