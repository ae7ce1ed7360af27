"""A tiny in-memory Kubernetes API server on loopback, enough for the operator's calls.

It stores objects by REST path and records every request, so tests can check what the
operator sent (server-side apply, its field manager, the content types) and what it did
with the answers. Apply merges into the stored object, which is all the operator relies on.
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

    def put(self, path: str, obj: dict[str, Any]) -> None:
        self.objects[path] = copy.deepcopy(obj)

    def applied(self) -> list[Request]:
        return [r for r in self.requests if r.content_type == "application/apply-patch+yaml"]


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
            api.requests.append(Request(method, url.path, parse_qs(url.query), ctype, body))
            for (m, prefix), status in api.failures.items():
                if m == method and url.path.startswith(prefix):
                    return self._send(status, {"kind": "Status", "message": "injected"})
            path = url.path
            if method == "GET":
                if path in api.objects:
                    return self._send(200, api.objects[path])
                items = [
                    o
                    for p, o in api.objects.items()
                    if p.rsplit("/", 1)[0] == path
                    and _matches(o, parse_qs(url.query).get("labelSelector", [""])[0])
                ]
                if items or path.endswith("s"):
                    return self._send(200, {"items": items})
                return self._send(404, {})
            if method == "POST":
                target = f"{path}/{body['metadata']['name']}"
                if target in api.objects:
                    return self._send(409, {"message": "exists"})
                api.objects[target] = body
                return self._send(201, body)
            if method == "PATCH":
                sub = path.rsplit("/", 1)[-1]
                if sub in ("status", "scale"):
                    base = path.rsplit("/", 1)[0]
                    if base not in api.objects:
                        return self._send(404, {})
                    _merge(api.objects[base], body)
                    return self._send(200, api.objects[base])
                obj = api.objects.setdefault(path, {})
                _merge(obj, body)
                return self._send(200, obj)
            if method == "DELETE":
                if api.objects.pop(path, None) is None:
                    return self._send(404, {})
                return self._send(200, {})
            return self._send(405, {})

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
