"""A Hugging Face Hub on loopback, for the download path of `--model ORG/NAME`: the few HTTP
routes huggingface_hub's snapshot_download calls (repo info, the file tree, each file's HEAD
and GET), serving one repository from a folder at one commit, and recording what was
fetched. Plain http.server; no network beyond 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class FakeHub:
    repo_id: str
    folder: Path
    commit: str
    url: str = ""
    gated: bool = False  # True: every request without a Bearer token gets 401 GatedRepo
    fetched: list[str] = field(default_factory=list)  # files whose bodies were sent
    requests: list[str] = field(default_factory=list)  # every request, "METHOD path"
    tokens: set[str] = field(default_factory=set)  # Authorization headers received

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())

    def tree(self) -> list[dict[str, object]]:
        return [
            {"type": "file", "path": str(p.relative_to(self.folder)), "size": p.stat().st_size,
             "oid": _etag(p)}
            for p in self.files()
        ]  # fmt: skip


def _etag(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api = f"/api/models/{hub.repo_id}/"
    resolve = f"/{hub.repo_id}/resolve/"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _refuse(self, status: int, code: str) -> None:
            """As the Hub answers: huggingface_hub reads the error's kind from X-Error-Code."""
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _refused(self) -> bool:
            """Record the request; True when it was answered with an error."""
            hub.requests.append(f"{self.command} {self.path}")
            hub.tokens.add(self.headers.get("Authorization", ""))
            path = unquote(urlparse(self.path).path)
            if not path.startswith((api, resolve)):
                self._refuse(404, "RepoNotFound")
                return True
            if hub.gated and not self.headers.get("Authorization", "").startswith("Bearer "):
                self._refuse(401, "GatedRepo")
                return True
            revision = path.removeprefix(api + "revision/").removeprefix(resolve).split("/")[0]
            if revision not in ("main", hub.commit) and path.startswith(
                (api + "revision/", resolve)
            ):
                self._refuse(404, "RevisionNotFound")
                return True
            return False

        def _json(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, send_body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            revision_and_name = path.removeprefix(resolve)
            name = revision_and_name.split("/", 1)[1]
            file = hub.folder / name
            if not path.startswith(resolve) or not file.is_file():
                self.send_error(404)
                return
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("ETag", f'"{_etag(file)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if send_body:
                hub.fetched.append(name)
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            if not self._refused():
                self._file(send_body=False)

        def do_GET(self) -> None:
            if self._refused():
                return
            path = urlparse(self.path).path
            if path.startswith(api + "revision/"):
                siblings = [{"rfilename": t["path"]} for t in hub.tree()]
                self._json({"id": hub.repo_id, "sha": hub.commit, "siblings": siblings})
            elif path.startswith(api + "tree/"):
                self._json(hub.tree())
            else:
                self._file(send_body=True)

    return Handler


@contextmanager
def serve_hub(repo_id: str, folder: Path, commit: str, gated: bool = False) -> Iterator[FakeHub]:
    """The hub at `hub.url` (set HF_ENDPOINT to it) until the block ends."""
    hub = FakeHub(repo_id, folder, commit, gated=gated)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
