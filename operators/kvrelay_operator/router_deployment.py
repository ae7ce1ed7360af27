"""The router's Deployment and Service: the pods clients talk to, which drive the Ray pools.

The router is stateless between requests, so it is an ordinary Deployment; it reaches the
Ray cluster through KubeRay's head Service and manages the worker actors itself.
"""

from __future__ import annotations

from kvrelay_operator import podparts
from kvrelay_operator.api_key import api_key_ref
from kvrelay_operator.env import API_KEY_ENV
from kvrelay_operator.names import (
    GRPC_PORT,
    HTTP_PORT,
    RAY_CLIENT_PORT,
    REVISION_LABEL,
    labels,
    ray_head_service,
    router_name,
    selector_labels,
)
from kvrelay_operator.podparts import Obj
from kvrelay_operator.ray_access import ray_auth_env
from kvrelay_operator.spec import ServiceSpec


def router_command(spec: ServiceSpec, revision: str) -> list[str]:
    """The router's command line (the `kvrelay router` contract), against the Ray cluster of
    `revision`."""
    command = [
        "kvrelay",
        "router",
        "--ray-address",
        f"ray://{ray_head_service(spec.name, revision)}:{RAY_CLIENT_PORT}",
        "--model",
        podparts.model_arg(spec),
        "--http-host",
        "0.0.0.0",  # inside a pod: the Service and probes reach it on the pod IP
        "--http-port",
        str(HTTP_PORT),
        "--grpc-host",
        "0.0.0.0",
        "--grpc-port",
        str(GRPC_PORT),
        "--manage-workers",
        "--transfer-backend",
        spec.transfer_backend,
        # Always a key (api_key.py): the service's Secret, or the one the operator made.
        "--api-key-env",
        API_KEY_ENV,
    ]
    return command + list(spec.engine_args)


def _router_env(spec: ServiceSpec, revision: str) -> list[Obj]:
    # The KV secret: the workers this router starts get it from the router. The Ray token:
    # its Ray client must show it to the head (ray_access.py). The API key: a required
    # secretKeyRef, so a router never starts without it (api_key.py).
    env = podparts.base_env(spec, "router", revision) + podparts.kv_env(spec) + ray_auth_env(spec)
    name, key = api_key_ref(spec)
    env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return env


def desired_router_deployment(spec: ServiceSpec, revision: str) -> Obj:
    """The router pods of `revision`: a new revision changes the template (Ray address,
    KVRELAY_GENERATION, its label), so the Deployment rolls to the new RayCluster."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": router_name(spec.name),
            "namespace": spec.namespace,
            "labels": labels(spec.name, "router"),
        },
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector_labels(spec.name, "router")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {"labels": {**labels(spec.name, "router"), REVISION_LABEL: revision}},
                "spec": _router_pod_spec(spec, revision),
            },
        },
    }


def _router_pod_spec(spec: ServiceSpec, revision: str) -> Obj:
    resources = podparts.resources(spec.router.placement)
    pod_spec = podparts.place(
        {
            "securityContext": podparts.pod_security(),
            "containers": [_router_container(spec, revision, resources)],
            "volumes": podparts.volumes(spec, kv=True),
        },
        spec.router.placement,
        spec,
    )
    init = podparts.init_containers(spec, resources)
    if init:
        pod_spec["initContainers"] = init
    return pod_spec


def _router_container(spec: ServiceSpec, revision: str, resources: Obj) -> Obj:
    container: Obj = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": router_command(spec, revision),
        "env": _router_env(spec, revision),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        ],
        # /health is 503 while no worker is up: that takes the pod out of the Service but must
        # not restart it, so liveness only checks that the process answers at all.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "startupProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 60,
        },
        "volumeMounts": podparts.volume_mounts(spec, kv=True),
        "securityContext": podparts.container_security(),
    }
    if resources:
        container["resources"] = resources
    return container


def desired_router_service(spec: ServiceSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": router_name(spec.name),
            "namespace": spec.namespace,
            "labels": labels(spec.name, "router"),
        },
        "spec": {
            "type": spec.router.service_type,
            "selector": selector_labels(spec.name, "router"),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
            ],
        },
    }


def endpoint(spec: ServiceSpec, load_balancer_host: str = "") -> str:
    """The OpenAI base URL: the load balancer's when it has one, else the in-cluster name."""
    host = load_balancer_host or f"{router_name(spec.name)}.{spec.namespace}.svc"
    return f"http://{host}:{HTTP_PORT}/v1"
