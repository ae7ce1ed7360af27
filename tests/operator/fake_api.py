"""A tiny in-memory Kubernetes API server on loopback, enough for the operator's calls.

It stores objects by REST path and records every request, so tests can check what the
operator sent (server-side apply, its field manager, the content types) and what it did
with the answers. It refuses what a real server refuses that the operator's tests depend on:
custom resources that break their CRD's structural schema or CEL rules (fake_schema.py:
defaulted, unknown fields pruned, or refused under fieldValidation=Strict), and an apply
that changes a field another manager owns, unless forced (fake_ownership.py, shown as
metadata.managedFields); a field an apply stops sending goes unless another manager owns
it. RBAC is not checked here: tests/operator/cluster.py runs the same tests
against a real API server for that.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes

from kvrelay_operator.kube import Kube
from tests.operator.fake_ownership import Ownership, remove
from tests.operator.fake_schema import Refused, admit

APPLY = "application/apply-patch+yaml"
# The manager an update without ?fieldManager gets: the Python client's user agent.
DEFAULT_MANAGER = "OpenAPI-Generator"
Answer = tuple[int, Any]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any


@dataclass
class FakeApi:
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    # (method, path prefix) -> HTTP status to answer instead.
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    ownership: Ownership = field(default_factory=Ownership)

    def put(self, path: str, obj: dict[str, Any]) -> None:
        """Seed an object as stored (no checks, no owner: what a test starts from)."""
        self.objects[path] = copy.deepcopy(obj)

    def applied(self) -> list[Request]:
        return [r for r in self.requests if r.content_type == APPLY]

    def owners(self, path: str) -> list[dict[str, Any]]:
        """The stored object's managedFields."""
        return list(self.objects.get(path, {}).get("metadata", {}).get("managedFields") or [])

    def _store(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        api_version = str(obj.get("apiVersion", ""))
        obj.setdefault("metadata", {})["managedFields"] = self.ownership.managed_fields(
            path, api_version
        )
        self.objects[path] = obj
        return obj

    def create(self, path: str, body: Any, query: dict[str, list[str]]) -> Answer:
        target = f"{path}/{body['metadata']['name']}"
        if target in self.objects:
            return 409, {"kind": "Status", "reason": "AlreadyExists", "message": "exists"}
        obj = admit(target, body, None, _strict(query))
        self.ownership.update(target, body, _manager(query))
        return 201, self._store(target, obj)

    def patch(self, path: str, body: Any, query: dict[str, list[str]], ctype: str) -> Answer:
        sub = path.rsplit("/", 1)[-1]
        if sub in ("status", "scale"):
            return self._patch_subresource(path.rsplit("/", 1)[0], sub, body, query)
        if ctype == APPLY:
            return self._apply(path, body, query)
        if path not in self.objects:
            return 404, {"kind": "Status", "reason": "NotFound"}
        current = self.objects[path]
        obj = admit(path, _merge(copy.deepcopy(current), body), current, _strict(query))
        self.ownership.update(path, body, _manager(query))
        return 200, self._store(path, obj)

    def _apply(self, path: str, body: Any, query: dict[str, list[str]]) -> Answer:
        manager = (query.get("fieldManager") or [""])[0]
        if not manager:
            raise Refused(400, "BadRequest", "fieldManager is required for apply requests")
        if (body.get("metadata") or {}).get("managedFields"):
            raise Refused(400, "BadRequest", "metadata.managedFields must be nil")
        current = self.objects.get(path)
        force = (query.get("force") or [""])[0] == "true"
        released = self.ownership.apply(path, current, body, manager, force)  # 409 first
        merged = _merge(copy.deepcopy(current or {}), body)
        for leaf in released:  # sent before, not now, owned by no one else: removed
            remove(merged, leaf)
        obj = admit(path, merged, current, _strict(query))
        return (200 if current else 201), self._store(path, obj)

    def _patch_subresource(
        self, base: str, sub: str, body: Any, query: dict[str, list[str]]
    ) -> Answer:
        if base not in self.objects:
            return 404, {"kind": "Status", "reason": "NotFound"}
        current = self.objects[base]
        obj = admit(base, _merge(copy.deepcopy(current), body), current, _strict(query))
        self.ownership.update(base, body, _manager(query), subresource=sub)
        return 200, self._store(base, obj)

    def delete(self, path: str) -> Answer:
        if self.objects.pop(path, None) is None:
            return 404, {"kind": "Status", "reason": "NotFound"}
        self.ownership.forget(path)
        return 200, {}

    def get(self, path: str, query: dict[str, list[str]]) -> Answer:
        if path in self.objects:
            return 200, self.objects[path]
        selector = query.get("labelSelector", [""])[0]
        items = [
            o
            for p, o in self.objects.items()
            if path in (_collection(p), _all_namespaces(p)) and _matches(o, selector)
        ]
        if items or path.endswith("s"):
            return 200, {"items": items}
        return 404, {}


def _collection(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _all_namespaces(path: str) -> str:
    """An object's collection across namespaces (/apis/g/v/namespaces/ns/kind/x -> .../kind)."""
    parts = _collection(path).split("/")
    if "namespaces" in parts[:-1]:
        at = parts.index("namespaces")
        return "/".join(parts[:at] + parts[at + 2 :])
    return ""


def _strict(query: dict[str, list[str]]) -> bool:
    return (query.get("fieldValidation") or [""])[0] == "Strict"


def _manager(query: dict[str, list[str]]) -> str:
    return (query.get("fieldManager") or [DEFAULT_MANAGER])[0]


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if isinstance(value, dict):
            # JSON merge patch: nulls inside a new object are dropped as well (RFC 7386).
            into[key] = _merge(into[key] if isinstance(into.get(key), dict) else {}, value)
        elif value is None:
            into.pop(key, None)
        else:
            into[key] = copy.deepcopy(value)
    return into


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    pairs = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(k) == v for k, v in pairs)


def _dispatch(
    api: FakeApi, method: str, path: str, query: dict[str, list[str]], ctype: str, body: Any
) -> Answer:
    if method == "GET":
        return api.get(path, query)
    if method == "POST":
        return api.create(path, body, query)
    if method == "PATCH":
        return api.patch(path, body, query, ctype)
    if method == "DELETE":
        return api.delete(path)
    return 405, {}


def _handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            ctype = self.headers.get("Content-Type", "")
            query = parse_qs(url.query)
            api.requests.append(Request(method, url.path, query, ctype, body))
            for (m, prefix), status in api.failures.items():
                if m == method and url.path.startswith(prefix):
                    return self._send(status, {"kind": "Status", "message": "injected"})
            try:
                status, answer = _dispatch(api, method, url.path, query, ctype, body)
            except Refused as exc:
                status, answer = exc.status, exc.body()
            return self._send(status, answer)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PATCH(self) -> None:
            self._handle("PATCH")

        def do_DELETE(self) -> None:
            self._handle("DELETE")

    return Handler


@contextmanager
def fake_api() -> Iterator[tuple[FakeApi, Kube]]:
    api = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = kubernetes.client.Configuration()
        config.host = f"http://127.0.0.1:{server.server_address[1]}"
        yield api, Kube(kubernetes.client.ApiClient(config))
    finally:
        server.shutdown()
        server.server_close()
