"""The router's admin API as the operator uses it: list the workers, drain some pods'.

`GET /admin/v1/workers` and `POST /admin/v1/workers/drain` on the router Service's HTTP
port, with the router's API key when it has one. The drain flag lives in the worker actors,
so any router replica answers for all. Failures are logged and reported as None / False: a
shrink then waits for its drain timeout instead of failing the reconcile.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvrelay_operator.drain import WorkerInfo, parse_workers
from kvrelay_operator.names import HTTP_PORT, router_name
from kvrelay_operator.spec import ServiceSpec

log = logging.getLogger(__name__)

WORKERS_PATH = "/admin/v1/workers"
DRAIN_PATH = "/admin/v1/workers/drain"


def admin_url(spec: ServiceSpec) -> str:
    """The router Service's base URL inside the cluster."""
    return f"http://{router_name(spec.name)}.{spec.namespace}.svc:{HTTP_PORT}"


class RouterAdmin:
    def __init__(self, base_url: str, api_key: str = "", timeout: float = 5.0) -> None:
        self._base = base_url.rstrip("/")
        self._api_key = api_key
        self._timeout = timeout

    def _request(self, path: str, body: Any = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self._base + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self._timeout) as response:
            return json.loads(response.read() or b"{}")

    def workers(self) -> list[WorkerInfo] | None:
        """Every worker the router knows, None when it cannot be asked."""
        try:
            return parse_workers(self._request(WORKERS_PATH))
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
            log.warning("router %s: listing workers failed: %s", self._base, exc)
            return None

    def drain(self, pods: Sequence[str]) -> bool:
        """Ask the routers to stop sending new requests to the workers on `pods`."""
        try:
            answer = self._request(DRAIN_PATH, {"pods": list(pods)})
        except (OSError, ValueError) as exc:
            log.warning("router %s: draining %s failed: %s", self._base, list(pods), exc)
            return False
        log.info("router %s: draining %s", self._base, answer.get("draining"))
        return True
