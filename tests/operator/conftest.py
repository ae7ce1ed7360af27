"""Fixtures of the operator tests: the in-process fake API server with a Kube client on it,
and a router stub answering the operator's admin calls."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrelay_operator.kube import Kube
from tests.operator.fake_api import FakeApi, fake_api
from tests.operator.router_stub import RouterStub, router_stub


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, Kube]]:
    with fake_api() as pair:
        yield pair


@pytest.fixture
def router() -> Iterator[RouterStub]:
    with router_stub() as stub:
        yield stub
