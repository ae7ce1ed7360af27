"""The KubeRay RayCluster of a service: a head that runs no engine, and one worker group
per pool whose pods each offer one unit of the pool's Ray custom resource.

The router keeps one worker actor per unit of `kvrelay_prefill` / `kvrelay_decode`, so a
worker group's replica count is the pool's size. KubeRay's own autoscaler stays off: pool
sizes are set through the KVRelayPool objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvrelay_operator import podparts
from kvrelay_operator.names import (
    RAY_CLIENT_PORT,
    RAY_GCS_PORT,
    labels,
    raycluster_name,
)
from kvrelay_operator.podparts import Obj
from kvrelay_operator.spec import PoolSpec, ServiceSpec


def ray_resource(pool: str) -> str:
    """The Ray custom resource that marks a node as a worker of `pool`."""
    return f"kvrelay_{pool}"


def ray_resources_param(pool: str) -> str:
    """`rayStartParams.resources`: KubeRay passes it to `ray start --resources` verbatim, so
    the JSON is itself quoted for the shell."""
    return json.dumps(json.dumps({ray_resource(pool): 1}))


def _ray_container(spec: ServiceSpec, name: str, resources: Obj, env: list[Obj]) -> Obj:
    container: Obj = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "env": env,
        "volumeMounts": podparts.volume_mounts(spec),
        "securityContext": podparts.container_security(),
    }
    if resources:
        container["resources"] = resources
    return container


def _head_group(spec: ServiceSpec) -> Obj:
    resources = podparts.resources(spec.ray_head)
    container = _ray_container(spec, "ray-head", resources, podparts.base_env(spec, "ray-head"))
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
    )
    return {
        # num-cpus 0: the scheduler never places an engine actor on the head. The dashboard
        # listens on loopback only: it can run jobs and must not be reachable.
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
        "serviceType": "ClusterIP",
        "template": {
            "metadata": {"labels": labels(spec.name, "ray-head")},
            "spec": pod_spec,
        },
    }


def _worker_group(spec: ServiceSpec, pool: PoolSpec, replicas: int) -> Obj:
    resources = podparts.resources(pool.placement)
    env = podparts.base_env(spec, pool.name)
    # Read by the engine actors this pod hosts (Ray workers inherit the raylet's env).
    env.append({"name": "KVRELAY_ENGINE_ARGS", "value": " ".join(pool.engine_args)})
    container = _ray_container(spec, "ray-worker", resources, env)
    pod_spec = podparts.place(
        {
            "securityContext": podparts.pod_security(),
            "initContainers": podparts.init_containers(spec, resources),
            "containers": [container],
            "volumes": podparts.volumes(spec),
        },
        pool.placement,
    )
    if not pod_spec["initContainers"]:
        del pod_spec["initContainers"]
    upper = max(replicas, pool.autoscaling.max_replicas if pool.autoscaling.enabled else 0)
    return {
        "groupName": pool.name,
        "replicas": replicas,
        # KubeRay clamps replicas into [min, max]; these bounds never bind, the pool does.
        "minReplicas": 0,
        "maxReplicas": upper,
        "rayStartParams": {
            "num-cpus": str(pool.cpus_per_worker),
            "resources": ray_resources_param(pool.name),
        },
        "template": {
            "metadata": {"labels": labels(spec.name, pool.name)},
            "spec": pod_spec,
        },
    }


def desired_raycluster(spec: ServiceSpec, pool_replicas: Mapping[str, int]) -> Obj:
    """The RayCluster for `spec`, each worker group at `pool_replicas[pool]` workers."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": raycluster_name(spec.name),
            "namespace": spec.namespace,
            "labels": labels(spec.name, "ray"),
        },
        "spec": {
            "rayVersion": spec.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head_group(spec),
            "workerGroupSpecs": [
                _worker_group(spec, spec.prefill, pool_replicas["prefill"]),
                _worker_group(spec, spec.decode, pool_replicas["decode"]),
            ],
        },
    }
