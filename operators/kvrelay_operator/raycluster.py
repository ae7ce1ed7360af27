"""The KubeRay RayCluster of a service: a head that runs no engine, and one worker group
per pool whose pods each offer one unit of the pool's Ray custom resource.

The router keeps one worker actor per unit of `kvrelay_prefill` / `kvrelay_decode`, so a
worker group's replica count is the pool's size. KubeRay's own autoscaler stays off: pool
sizes are set through the KVRelayPool objects, and a shrink names the pods to remove
(`scaleStrategy.workersToDelete`) once the router has drained them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvrelay_operator import podparts
from kvrelay_operator.env import ENGINE_ARGS_ENV
from kvrelay_operator.names import (
    RAY_CLIENT_PORT,
    RAY_GCS_PORT,
    REVISION_LABEL,
    labels,
    raycluster_name,
)
from kvrelay_operator.podparts import Obj
from kvrelay_operator.ray_access import RAY_HEAD_COMPONENT, ray_auth_env
from kvrelay_operator.spec import PoolSpec, ServiceSpec

GPU_RESOURCE = "nvidia.com/gpu"


def ray_resource(pool: str) -> str:
    """The Ray custom resource that marks a node as a worker of `pool`."""
    return f"kvrelay_{pool}"


def ray_resources_param(pool: str) -> str:
    """`rayStartParams.resources`: KubeRay passes it to `ray start --resources` verbatim, so
    the JSON is itself quoted for the shell."""
    return json.dumps(json.dumps({ray_resource(pool): 1}))


def _ray_container(
    spec: ServiceSpec, name: str, resources: Obj, env: list[Obj], kv: bool = False
) -> Obj:
    container: Obj = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # Every Ray process asks callers for the service's token (ray_access.py).
        "env": env + ray_auth_env(spec),
        "volumeMounts": podparts.volume_mounts(spec, kv=kv),
        "securityContext": podparts.container_security(ipc_lock=kv and spec.kv.ipc_lock),
    }
    if resources:
        container["resources"] = resources
    return container


def _template_labels(spec: ServiceSpec, component: str, revision: str) -> Obj:
    return {**labels(spec.name, component), REVISION_LABEL: revision}


def _head_group(spec: ServiceSpec, revision: str) -> Obj:
    resources = podparts.resources(spec.ray_head)
    env = podparts.base_env(spec, RAY_HEAD_COMPONENT, revision)
    container = _ray_container(spec, RAY_HEAD_COMPONENT, resources, env)
    container["ports"] = [
        {"name": "gcs", "containerPort": RAY_GCS_PORT, "protocol": "TCP"},
        {"name": "client", "containerPort": RAY_CLIENT_PORT, "protocol": "TCP"},
    ]
    pod_spec = podparts.place(
        {
            "securityContext": podparts.pod_security(),
            "containers": [container],
            "volumes": podparts.volumes(spec),
        },
        spec.ray_head,
        spec,
    )
    return {
        # num-cpus 0: the scheduler never places an engine actor on the head. The dashboard
        # listens on loopback only: it can run jobs and must not be reachable. KubeRay's
        # probes run wget inside the pod against it (8265) and the dashboard agent (52365),
        # so the image must have ray[default] (the Dockerfile installs .[cluster]).
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
        "serviceType": "ClusterIP",
        "template": {
            "metadata": {"labels": _template_labels(spec, RAY_HEAD_COMPONENT, revision)},
            "spec": pod_spec,
        },
    }


def gpus(placement_resources: Mapping[str, Any]) -> int:
    """GPUs a worker container asks for (`nvidia.com/gpu` in limits, else requests)."""
    for kind in ("limits", "requests"):
        value = (placement_resources.get(kind) or {}).get(GPU_RESOURCE)
        if value is not None:
            return int(value)
    return 0


def _worker_pod_spec(spec: ServiceSpec, pool: PoolSpec, revision: str) -> Obj:
    resources = podparts.resources(pool.placement, dict(spec.kv.rdma_resources))
    env = podparts.base_env(spec, pool.name, revision) + podparts.worker_env(spec)
    # Read by the engine actors this pod hosts (Ray workers inherit the raylet's env).
    env.append({"name": ENGINE_ARGS_ENV, "value": " ".join(pool.engine_args)})
    container = _ray_container(spec, "ray-worker", resources, env, kv=True)
    pod_spec = podparts.place(
        {
            "securityContext": podparts.pod_security(),
            "initContainers": podparts.init_containers(spec, podparts.resources(pool.placement)),
            "containers": [container],
            "volumes": podparts.volumes(spec, kv=True),
        },
        pool.placement,
        spec,
    )
    if not pod_spec["initContainers"]:
        del pod_spec["initContainers"]
    return pod_spec


def _worker_group(
    spec: ServiceSpec, pool: PoolSpec, revision: str, replicas: int, delete: Sequence[str]
) -> Obj:
    upper = max(replicas, pool.autoscaling.max_replicas if pool.autoscaling.enabled else 0)
    params = {"num-cpus": str(pool.cpus_per_worker), "resources": ray_resources_param(pool.name)}
    count = gpus(pool.placement.resources)
    if count:
        params["num-gpus"] = str(count)
    group: Obj = {
        "groupName": pool.name,
        "replicas": replicas,
        # KubeRay clamps replicas into [min, max]; these bounds never bind, the pool does.
        "minReplicas": 0,
        "maxReplicas": upper,
        "rayStartParams": params,
        # The KV transport's pod settings (RDMA privilege, memlock, /dev/shm, hostNetwork).
        "template": podparts.worker_transport(
            {
                "metadata": {"labels": _template_labels(spec, pool.name, revision)},
                "spec": _worker_pod_spec(spec, pool, revision),
            },
            spec,
        ),
    }
    if delete:
        # The drained pods go, not KubeRay's random pick (see drain.py).
        group["scaleStrategy"] = {"workersToDelete": list(delete)}
    return group


def desired_raycluster(
    spec: ServiceSpec,
    revision: str,
    pool_replicas: Mapping[str, int],
    workers_to_delete: Mapping[str, Sequence[str]] | None = None,
) -> Obj:
    """The RayCluster of `spec`'s `revision`, each worker group at `pool_replicas[pool]`
    workers; `workers_to_delete[pool]`: the pods a shrink removes (already drained)."""
    delete = workers_to_delete or {}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": raycluster_name(spec.name, revision),
            "namespace": spec.namespace,
            "labels": {**labels(spec.name, "ray"), REVISION_LABEL: revision},
        },
        "spec": {
            "rayVersion": spec.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head_group(spec, revision),
            "workerGroupSpecs": [
                _worker_group(
                    spec, pool, revision, pool_replicas[pool.name], delete.get(pool.name, ())
                )
                for pool in (spec.prefill, spec.decode)
            ],
        },
    }
