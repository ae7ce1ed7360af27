"""The admin API on the router's HTTP port, for the operator: list the workers, drain the ones
on pods about to go away. Same API key as /v1; errors in OpenAI's shape (http_errors.py).

`POST /admin/v1/workers/drain {"pods": [...]}` sets each worker's own drain flag, so every
router replica stops sending it new requests when it next polls; a worker is drained when its
state is "draining" and `in_flight` is 0. Only then (or after its drain timeout) should the
operator delete the pod: KubeRay's `scaleStrategy.workersToDelete`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvrelay.common.messages import DrainState
from kvrelay.router.workers import WorkerRegistry, WorkerState

WORKERS_PATH = "/admin/v1/workers"
DRAIN_PATH = "/admin/v1/workers/drain"


class DrainRequest(BaseModel):
    """The pods whose workers to drain (unknown fields are refused: a typo must not pass)."""

    model_config = ConfigDict(extra="forbid")

    pods: list[str] = Field(min_length=1, max_length=1024)


def worker_entry(worker: WorkerState) -> dict[str, Any]:
    """One worker as the admin API lists it."""
    info = worker.info
    state = DrainState.DRAINING if worker.draining else DrainState.SERVING
    return {
        "name": info.name or info.engine_id,
        "engine_id": info.engine_id,
        "role": info.role.value,
        "pod": info.pod,
        "node": info.node,
        "generation": worker.revision,  # the deployment revision; the key stays
        "state": state.value,
        "healthy": worker.healthy,
        "in_flight": worker.requests_in_flight,
    }


def add_admin_routes(app: FastAPI, registry: WorkerRegistry, dependencies: list[Any]) -> None:
    """Mount the admin routes on `app`, behind `dependencies` (the API-key check)."""

    @app.get(WORKERS_PATH, dependencies=dependencies)
    async def workers() -> dict[str, Any]:
        listed = sorted(registry.workers.values(), key=lambda w: (w.role, w.info.pod))
        return {
            "workers": [worker_entry(w) for w in listed],
            # Which revision this router prefers, and which one its new requests go to now
            # (another while its own has no decode worker; null: none can decode). The keys
            # say "generation": the operator and scripts read them.
            "router_generation": registry.revision,
            "serving_generation": registry.serving_revision(),
        }

    @app.post(DRAIN_PATH, dependencies=dependencies, status_code=202)
    async def drain(body: DrainRequest) -> JSONResponse:
        drained = await registry.drain(set(body.pods))
        known = {w.info.pod for w in registry.workers.values()}
        content = {
            "draining": sorted(w.info.name or w.worker_id for w in drained),
            # Pods with no worker here: nothing to wait for (gone already, or never joined).
            "unknown_pods": sorted(set(body.pods) - known),
        }
        return JSONResponse(content, status_code=202)
