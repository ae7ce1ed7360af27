"""The router's admin API as the cross-team contract defines it, served on loopback: the
other side of the operator's drain calls (the real router implements the same endpoints).

`GET /admin/v1/workers` lists `workers`; `POST /admin/v1/workers/drain` marks the workers of
the named pods draining and answers 202. Requests are recorded with their auth header.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class RouterStub:
    workers: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str, Any, str]] = field(
        default_factory=list
    )  # method, path, body, auth
    api_key: str = ""
    url: str = ""

    def add(self, pod: str, role: str = "decode", in_flight: int = 0) -> None:
        self.workers.append(
            {
                "name": f"kvrelay-{role}-{pod}",
                "role": role,
                "pod": pod,
                "node": "node-1",
                "generation": "",
                "state": "serving",
                "in_flight": in_flight,
            }
        )

    def set_in_flight(self, pod: str, in_flight: int) -> None:
        for worker in self.workers:
            if worker["pod"] == pod:
                worker["in_flight"] = in_flight

    def drains(self) -> list[list[str]]:
        return [body["pods"] for method, _, body, _ in self.requests if method == "POST"]


def _handler(stub: RouterStub) -> type[BaseHTTPRequestHandler]:
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

        def _authorized(self) -> bool:
            auth = self.headers.get("Authorization", "")
            return not stub.api_key or auth == f"Bearer {stub.api_key}"

        def do_GET(self) -> None:
            stub.requests.append(("GET", self.path, None, self.headers.get("Authorization", "")))
            if not self._authorized():
                return self._send(401, {"error": {"message": "bad key", "type": "auth"}})
            if self.path != "/admin/v1/workers":
                return self._send(404, {"error": {"message": "no such path"}})
            return self._send(200, {"workers": stub.workers})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            auth = self.headers.get("Authorization", "")
            stub.requests.append(("POST", self.path, body, auth))
            if not self._authorized():
                return self._send(401, {"error": {"message": "bad key", "type": "auth"}})
            names = []
            for worker in stub.workers:
                if worker["pod"] in body.get("pods", ()):
                    worker["state"] = "draining"
                    names.append(worker["name"])
            return self._send(202, {"draining": names})

    return Handler


@contextmanager
def router_stub() -> Iterator[RouterStub]:
    stub = RouterStub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
    stub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
