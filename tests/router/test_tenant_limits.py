"""Tenants' limits alone (router/tenant_limits.py): the file's rules (each mistake named), the
per-minute windows and the wait until they free, reloading a changed file (a broken one keeps
the limits in force), metrics under the configured name, and keys matched to tenants."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvrelay.metrics import TenantMetrics
from kvrelay.router.tenant_limits import (
    RELOAD_POLL_S,
    Limits,
    TenantBook,
    TenantLimitError,
    load_table,
    parse_table,
    tenant_of_key,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, table: dict[str, Any], mtime_ns: int | None = None) -> str:
    path.write_text(json.dumps(table))
    if mtime_ns is not None:  # a distinct mtime even within the file system's resolution
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return str(path)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_file_is_parsed_with_defaults_keys_and_weights(tmp_path: Path) -> None:
    os.environ["KVRELAY_TEST_TENANT_KEY"] = "sk-env"
    table = load_table(
        write(
            tmp_path / "t.json",
            {
                "default": {"requests_per_minute": 10},
                "tenants": [
                    {"name": "a", "key": "sk-a", "weight": 2, "tokens_per_minute": 500},
                    {"name": "b", "key_env": "KVRELAY_TEST_TENANT_KEY"},
                    {"name": "c", "max_concurrent_sequences": 4},
                ],
            },
        )
    )
    assert table.default == Limits(requests_per_minute=10)
    assert table.limits("a") == Limits(tokens_per_minute=500, weight=2.0)
    assert table.limits("c").max_concurrent_sequences == 4
    assert table.limits("someone-else") == table.default
    assert table.keys == {"sk-a": "a", "sk-env": "b"}
    assert (table.label("a"), table.label("someone-else")) == ("a", "default")
    assert tenant_of_key(table.keys, "sk-env") == "b"
    assert tenant_of_key(table.keys, "sk-nope") is None


def test_yaml_by_its_suffix(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("tenants:\n  - name: a\n    key: sk-a\n    requests_per_minute: 3\n")
    table = load_table(str(path))
    assert table.limits("a").requests_per_minute == 3 and table.keys == {"sk-a": "a"}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([], "an object"),
        ({"limits": {}}, "an object"),
        ({"tenants": {}}, "a list"),
        ({"tenants": [{"key": "k"}]}, "tenants[0].name"),
        ({"tenants": [{"name": "default"}]}, "unlisted"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "listed twice"),
        ({"tenants": [{"name": "a", "key": "k"}, {"name": "b", "key": "k"}]}, "also 'a'"),
        ({"tenants": [{"name": "a", "key": ""}]}, "tenants[0].key"),
        ({"tenants": [{"name": "a", "key": "k", "key_env": "X"}]}, "not both"),
        ({"tenants": [{"name": "a", "key_env": "KVRELAY_TEST_UNSET_VAR"}]}, "unset"),
        ({"tenants": [{"name": "a", "rpm": 3}]}, "unknown field(s) ['rpm']"),
        ({"default": {"requests_per_minute": 0}}, "default.requests_per_minute"),
        ({"default": {"tokens_per_minute": 1.5}}, "default.tokens_per_minute"),
        ({"default": {"max_concurrent_sequences": True}}, "max_concurrent_sequences"),
        ({"tenants": [{"name": "a", "weight": 0}]}, "tenants[0].weight"),
        ({"default": {"name": "x"}}, "unknown field(s) ['name']"),
    ],
)
def test_each_mistake_is_named(raw: Any, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_table(raw)
    assert says in str(refused.value)


def test_an_unreadable_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_table(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json is not valid JSON"):
        load_table(str(broken))
    with pytest.raises(ValueError, match=r"t\.json: tenants\[0\].name"):
        load_table(write(tmp_path / "t.json", {"tenants": [{}]}))


def test_requests_per_minute_with_the_wait_until_the_window_frees(tmp_path: Path) -> None:
    clock = Clock()
    path = write(tmp_path / "t.json", {"tenants": [{"name": "a", "requests_per_minute": 2}]})
    book = TenantBook(path, clock=clock)
    for _ in range(2):
        book.check("a")
        book.record("a", 5)
        clock.now += 10
    with pytest.raises(TenantLimitError) as refused:
        book.check("a")
    assert refused.value.limit == "requests_per_minute" and refused.value.tenant == "a"
    assert refused.value.retry_after_s == pytest.approx(40)  # the first leaves at +60
    assert "'a' is over its requests_per_minute (2)" in refused.value.message
    book.check("unlisted")  # the default has no limit; each tenant its own window
    clock.now += 40
    book.check("a")  # the first request has left the window


def test_tokens_per_minute_count_prompt_and_generated_tokens(tmp_path: Path) -> None:
    clock = Clock()
    path = write(tmp_path / "t.json", {"default": {"tokens_per_minute": 100}})
    book = TenantBook(path, clock=clock)
    book.record("x", 30)
    clock.now += 5
    book.count_tokens("x", 50)
    book.check("x")  # 80 < 100
    clock.now += 5
    book.count_tokens("x", 20)
    with pytest.raises(TenantLimitError) as refused:
        book.check("x")
    assert refused.value.limit == "tokens_per_minute"
    # 100 tokens: under the limit once the 30 prompt tokens (at t=0) leave, at t=60.
    assert refused.value.retry_after_s == pytest.approx(50)
    clock.now += 50
    book.check("x")


def test_a_changed_file_is_reloaded_and_a_broken_one_keeps_the_limits(tmp_path: Path) -> None:
    clock = Clock()
    target = tmp_path / "t.json"
    path = write(target, {"default": {"requests_per_minute": 1}}, mtime_ns=10**18)
    book = TenantBook(path, clock=clock)
    book.record("a", 1)
    with pytest.raises(TenantLimitError):
        book.check("a")
    write(target, {"default": {"requests_per_minute": 5}}, mtime_ns=2 * 10**18)
    with pytest.raises(TenantLimitError):
        book.check("a")  # not yet looked at: the mtime is polled every RELOAD_POLL_S
    clock.now += RELOAD_POLL_S
    book.check("a")
    assert book.limits("a").requests_per_minute == 5
    target.write_text("{not json")
    os.utime(target, ns=(3 * 10**18, 3 * 10**18))
    clock.now += RELOAD_POLL_S
    assert book.limits("a").requests_per_minute == 5  # the previous table stays
    write(target, {"tenants": [{"name": "a", "key": "sk-new"}]}, mtime_ns=4 * 10**18)
    clock.now += RELOAD_POLL_S
    assert book.keys == {"sk-new": "a"}  # a key added without a restart


def test_a_reload_that_drops_every_key_keeps_the_keys_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The keys may be all that guards /v1: an edit that lists none would open the API
    without a restart, so it is refused with a warning; one key left is a normal reload."""
    clock = Clock()
    target = tmp_path / "t.json"
    two_keys = {"tenants": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}]}
    book = TenantBook(write(target, two_keys, mtime_ns=10**18), clock=clock)
    write(target, {"default": {"requests_per_minute": 5}}, mtime_ns=2 * 10**18)
    clock.now += RELOAD_POLL_S
    assert book.keys == {"sk-a": "a", "sk-b": "b"}
    assert "lists no API key any more" in caplog.text
    write(target, {"tenants": [{"name": "b", "key": "sk-b"}]}, mtime_ns=3 * 10**18)
    clock.now += RELOAD_POLL_S
    assert book.keys == {"sk-b": "b"}


def test_metrics_carry_the_configured_name_never_the_key(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    clock = Clock()
    path = write(
        tmp_path / "t.json",
        {"tenants": [{"name": "team-a", "key": "sk-secret", "requests_per_minute": 1}]},
    )
    book = TenantBook(path, TenantMetrics(registry), clock=clock)
    book.record("team-a", 7)
    book.count_tokens("team-a", 3)
    book.count_tokens("team-a", 0)
    book.record("someone", 2)
    try:
        book.check("team-a")
    except TenantLimitError as exc:
        book.limited(exc)
    name = "kvrelay_tenant_requests_total"
    assert sample(registry, name, tenant="team-a", outcome="admitted") == 1
    assert sample(registry, name, tenant="team-a", outcome="limited") == 1
    assert sample(registry, name, tenant="default", outcome="admitted") == 1
    tokens = "kvrelay_tenant_tokens_total"
    assert sample(registry, tokens, tenant="team-a", kind="prompt") == 7
    assert sample(registry, tokens, tenant="team-a", kind="generated") == 3
    limited = "kvrelay_tenant_limited_total"
    assert sample(registry, limited, tenant="team-a", limit="requests_per_minute") == 1
    exported = "\n".join(str(m) for m in registry.collect())
    assert "sk-secret" not in exported


def test_idle_windows_are_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    book = TenantBook(write(tmp_path / "t.json", {}), clock=clock)
    for i in range(100):
        book.record(f"header-tenant-{i}", 1)
    assert len(book._windows) == 100
    clock.now += 61
    book.limits("anyone")  # the poll prunes
    assert not book._windows
