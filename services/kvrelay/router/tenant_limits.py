"""Tenants and their limits, from the file `--tenant-limits` names (JSON, or YAML by suffix),
re-read when it changes: who a request's API key belongs to, each tenant's weight in the fair
queue, and its requests per minute, tokens per minute and concurrent sequences.

The per-minute windows are counted here (`TenantBook.check` / `record` / `count_tokens`);
concurrent sequences are counted by admission.py, which holds them. A tenant is named by the
file; metrics carry that name, never a key. Tenants the file does not list (no key, an
unlisted --tenant-header value) get the file's `default` limits, each in its own windows.

    {"default": {"requests_per_minute": 600},
     "tenants": [{"name": "team-a", "key": "sk-a", "weight": 2, "tokens_per_minute": 100000},
                 {"name": "batch", "key_env": "BATCH_KEY", "max_concurrent_sequences": 8}]}
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.metrics import TenantMetrics
from kvrelay.router.request_errors import OverloadedError

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
WINDOW_S = 60.0
RELOAD_POLL_S = 1.0  # how often the file's mtime is looked at (on requests, not a thread)
MAX_TENANT_NAME = 64
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_sequences")


class TenantLimitError(OverloadedError):
    """A tenant's own limit refused the request (429 with the time until it frees)."""

    def __init__(self, message: str, retry_after_s: float, tenant: str, limit: str) -> None:
        super().__init__(message, retry_after_s)
        self.tenant = tenant
        self.limit = limit  # one of _LIMIT_FIELDS


@dataclass(frozen=True)
class Limits:
    """One tenant's limits (None: unlimited) and its weight in the fair queue."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_sequences: int | None = None
    weight: float = 1.0


@dataclass(frozen=True)
class TenantTable:
    """The file, parsed: limits by tenant name, and tenant names by key."""

    default: Limits = Limits()
    tenants: dict[str, Limits] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)

    def limits(self, tenant: str) -> Limits:
        return self.tenants.get(tenant, self.default)

    def label(self, tenant: str) -> str:
        """The metrics label: the configured name, or "default" for an unlisted tenant."""
        return tenant if tenant in self.tenants else DEFAULT_TENANT


def load_table(path: str) -> TenantTable:
    """Parse `path`; ValueError naming the file and the entry at fault."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as exc:  # the parsers' errors differ; each says where
        raise ValueError(
            f"{path} is not valid {'YAML' if 'yaml' in path else 'JSON'}: {exc}"
        ) from None
    try:
        return parse_table(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def parse_table(raw: Any) -> TenantTable:
    if not isinstance(raw, dict) or set(raw) - {"default", "tenants"}:
        raise ValueError('expected an object with "default" and/or "tenants" only')
    default = _limits({} if raw.get("default") is None else raw["default"], "default", set())
    tenants: dict[str, Limits] = {}
    keys: dict[str, str] = {}
    entries = raw.get("tenants")
    entries = [] if entries is None else entries  # YAML's "tenants:" with nothing under it
    if not isinstance(entries, list):
        raise ValueError('"tenants" must be a list of objects')
    for index, entry in enumerate(entries):
        where = f"tenants[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        name = _name(entry.get("name"), where)
        if name in tenants:
            raise ValueError(f"{where}: the name {name!r} is listed twice")
        tenants[name] = _limits(entry, where, allow={"name", "key", "key_env"})
        key = _key(entry, where)
        if key is not None:
            if key in keys:
                raise ValueError(f"{where}: its key is also {keys[key]!r}'s")
            keys[key] = name
    return TenantTable(default, tenants, keys)


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_NAME or not name.isprintable():
        raise ValueError(f"{where}.name must be a printable string of 1-{MAX_TENANT_NAME} chars")
    if name == DEFAULT_TENANT:
        raise ValueError(f'{where}.name: "{DEFAULT_TENANT}" is the unlisted tenants\' name')
    return name


def _key(entry: dict[str, Any], where: str) -> str | None:
    if "key" in entry and "key_env" in entry:
        raise ValueError(f"{where}: give key or key_env, not both")
    if "key_env" in entry:
        from_env = os.environ.get(str(entry["key_env"]), "")
        if not from_env:
            raise ValueError(f"{where}.key_env: the variable {entry['key_env']!r} is unset/empty")
        return from_env
    key: Any = entry.get("key")
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}.key must be a non-empty string")
    return key


def _limits(entry: Any, where: str, allow: set[str]) -> Limits:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = set(entry) - allow - {*_LIMIT_FIELDS, "weight"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {_LIMIT_FIELDS}")
    values: dict[str, Any] = {}
    for name in _LIMIT_FIELDS:
        value = entry.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{where}.{name} must be an integer >= 1, got {value!r}")
        values[name] = value
    weight = entry.get("weight", 1.0)
    if type(weight) not in (int, float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}.weight must be a number > 0, got {weight!r}")
    return Limits(**values, weight=float(weight))


@dataclass
class _Window:
    """One tenant's last minute: request times, and (time, tokens) with their sum."""

    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    def add_tokens(self, now: float, count: int) -> None:
        self.tokens.append((now, count))
        self.token_sum += count

    def requests_free_in(self, limit: int, now: float) -> float | None:
        """Seconds until a request fits under `limit` (None: it fits now)."""
        if len(self.requests) < limit:
            return None
        return self.requests[len(self.requests) - limit] + WINDOW_S - now

    def tokens_free_in(self, limit: int, now: float) -> float | None:
        """Seconds until the tokens of the window drop under `limit` (None: they are)."""
        excess = self.token_sum - limit
        if excess < 0:
            return None
        for at, count in self.tokens:  # oldest first: when enough have left the window
            excess -= count
            if excess < 0:
                return at + WINDOW_S - now
        return WINDOW_S  # unreachable: the sum is of these entries


class TenantBook:
    """The table in force (re-read when its file changes) and every tenant's windows."""

    def __init__(
        self,
        path: str | None = None,
        metrics: TenantMetrics | None = None,
        tenant_header: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.metrics = metrics
        self.tenant_header = tenant_header.lower() if tenant_header else None
        self._clock = clock
        self.table = load_table(path) if path is not None else TenantTable()
        self._stamp = _stamp(path)
        self._polled = clock()
        self._windows: dict[str, _Window] = {}

    @property
    def keys(self) -> dict[str, str]:
        self._poll()
        return self.table.keys

    def limits(self, tenant: str) -> Limits:
        self._poll()
        return self.table.limits(tenant)

    def label(self, tenant: str) -> str:
        return self.table.label(tenant)

    def check(self, tenant: str) -> None:
        """Raise TenantLimitError when `tenant` is over its requests or tokens per minute."""
        limits, now = self.limits(tenant), self._clock()
        window = self._windows.get(tenant)
        if window is None:
            return
        window.expire(now)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm is not None and (wait := window.requests_free_in(rpm, now)) is not None:
            raise self._refusal(tenant, "requests_per_minute", rpm, wait)
        if tpm is not None and (wait := window.tokens_free_in(tpm, now)) is not None:
            raise self._refusal(tenant, "tokens_per_minute", tpm, wait)

    def record(self, tenant: str, prompt_tokens: int) -> None:
        """An admitted request: one request and its prompt's tokens now."""
        window = self._windows.setdefault(tenant, _Window())
        now = self._clock()
        window.requests.append(now)
        window.add_tokens(now, prompt_tokens)
        if self.metrics is not None:
            label = self.label(tenant)
            self.metrics.requests.labels(label, "admitted").inc()
            self.metrics.tokens.labels(label, "prompt").inc(prompt_tokens)

    def count_tokens(self, tenant: str, generated: int) -> None:
        """Generated tokens, as they stream."""
        if generated <= 0:
            return
        self._windows.setdefault(tenant, _Window()).add_tokens(self._clock(), generated)
        if self.metrics is not None:
            self.metrics.tokens.labels(self.label(tenant), "generated").inc(generated)

    def limited(self, exc: TenantLimitError) -> None:
        """Count a refusal by one of the tenant's limits."""
        if self.metrics is not None:
            label = self.label(exc.tenant)
            self.metrics.requests.labels(label, "limited").inc()
            self.metrics.limited.labels(label, exc.limit).inc()

    def _refusal(self, tenant: str, limit: str, value: int, wait_s: float) -> TenantLimitError:
        wait_s = max(wait_s, 0.001)
        return TenantLimitError(
            f"tenant {self.label(tenant)!r} is over its {limit} ({value}); "
            f"retry after {math.ceil(wait_s)} s",
            wait_s,
            tenant,
            limit,
        )

    def _poll(self) -> None:
        """Re-read the file when its mtime or size changed (at most every RELOAD_POLL_S); a
        file that no longer parses leaves the table in force, with a warning, and so does one
        that lists no key where the table in force does: the keys may be all that guards
        `/v1` (the server counted them as its authentication when it started), so an edit
        never opens the API; a restart can."""
        now = self._clock()
        if self.path is None or now - self._polled < RELOAD_POLL_S:
            return
        self._polled = now
        self._prune(now)
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            table = load_table(self.path)
        except ValueError as exc:
            logger.warning("--tenant-limits not reloaded, the previous limits stay: %s", exc)
            return
        if self.table.keys and not table.keys:
            logger.warning(
                "--tenant-limits not reloaded, the previous limits stay: %s lists no API key "
                "any more, which would open /v1 to anyone; keep at least one key, or restart "
                "the server to run without them",
                self.path,
            )
            return
        self.table = table
        logger.info("--tenant-limits reloaded: %d tenants", len(self.table.tenants))

    def _prune(self, now: float) -> None:
        """Forget windows that emptied, so unlisted tenants do not accumulate."""
        for tenant in list(self._windows):
            window = self._windows[tenant]
            window.expire(now)
            if not window.requests and not window.tokens:
                del self._windows[tenant]


def _stamp(path: str | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def tenant_of_key(keys: dict[str, str], given: str) -> str | None:
    """The tenant whose key `given` is, compared with every key in constant time (None: no
    listed key)."""
    found = None
    for key, name in keys.items():
        if hmac.compare_digest(given.encode(), key.encode()):
            found = name
    return found


__all__ = ["Limits", "TenantBook", "TenantLimitError", "TenantTable"]
