"""The two kinds of failure a reconcile can meet, and how an API error maps to one.

A retryable error (conflict, throttling, a server or network hiccup, a missing KubeRay CRD
that may yet be installed) is retried with a delay; a permanent one (an invalid spec, an
object the API server rejects as invalid, a forbidden call) is reported in the status and
not retried until the spec changes.
"""

from __future__ import annotations


class SpecError(ValueError):
    """The KVRelayService's spec is inconsistent: fixing it needs a person, not a retry."""


class RetryableError(RuntimeError):
    """A failure that may pass: retry after `delay` seconds. `status` is the HTTP status of
    an API error, None for anything else."""

    def __init__(self, message: str, delay: float = 10.0, status: int | None = None) -> None:
        super().__init__(message)
        self.delay = delay
        self.status = status


class PermanentError(RuntimeError):
    """A failure that retrying the same spec will not fix."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# 404 is retryable because it usually means a CRD (KubeRay's, prometheus-operator's) is not
# installed yet; 409 is a write conflict that resolves on re-read.
_RETRYABLE_STATUS = frozenset({404, 408, 409, 425, 429, 500, 502, 503, 504})


def classify_api_error(status: int | None, reason: str) -> RetryableError | PermanentError:
    """Map a Kubernetes API error (HTTP status, or None for a network error) to its kind."""
    if status is None or status in _RETRYABLE_STATUS:
        delay = 30.0 if status == 404 else 5.0
        return RetryableError(f"API error {status}: {reason}", delay=delay, status=status)
    return PermanentError(f"API error {status}: {reason}", status=status)
