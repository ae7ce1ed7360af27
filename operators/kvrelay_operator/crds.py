"""The KVRelayService and KVRelayPool CustomResourceDefinitions (and kopf's peering CRDs),
built as data.

This is the one source of the CRDs: the chart's `crds/*.yaml` are written from it
(`python -m kvrelay_operator.crds deploy/helm/kvrelay/crds`) and a test checks they are
current. Helm installs `crds/` on the first install only and never upgrades it, so a new
field would never reach the cluster (the API server would prune it from every object): the
chart's pre-upgrade hook Job runs `python -m kvrelay_operator.crds --apply` with the new
image, which server-side applies these same CRDs. The operator itself never reads them at run
time; the API server applies the defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvrelay_operator.kube import Kube
from kvrelay_operator.names import GROUP, POOL_KIND, POOL_PLURAL, SERVICE_KIND, SERVICE_PLURAL
from kvrelay_operator.names import VERSION as API_VERSION
from kvrelay_operator.schema_parts import Schema, int32, resource_schema, string
from kvrelay_operator.service_schema import service_schema


def pool_schema() -> Schema:
    """The openAPIV3Schema of KVRelayPool, the scalable handle of one pool."""
    spec = {
        "type": "object",
        "required": ["service", "pool"],
        "properties": {
            "service": string("The owning KVRelayService.", minLength=1),
            "pool": string("Which pool.", enum=["prefill", "decode"]),
            "replicas": int32("Workers wanted.", minimum=0, maximum=1000, default=1),
        },
        "x-kubernetes-validations": [
            {"rule": "self.pool == oldSelf.pool", "message": "pool is immutable"},
            {"rule": "self.service == oldSelf.service", "message": "service is immutable"},
        ],
    }
    status = {
        "type": "object",
        "properties": {
            "replicas": int32("Worker pods that exist."),
            "readyReplicas": int32("Worker pods that are ready."),
            "selector": string("Label selector of the pool's pods, for HPA."),
        },
    }
    return resource_schema(spec, status)


def _crd(kind: str, plural: str, short: list[str], schema: Schema, **version: Any) -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/part-of": "kvrelay"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["kvrelay"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    **version,
                }
            ],
        },
    }


def _column(name: str, path: str, type_: str = "string", priority: int = 0) -> Schema:
    column: Schema = {"name": name, "type": type_, "jsonPath": path}
    if priority:
        column["priority"] = priority
    return column


def service_crd() -> Schema:
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return _crd(
        SERVICE_KIND,
        SERVICE_PLURAL,
        ["kvrs"],
        service_schema(),
        subresources={"status": {}},
        additionalPrinterColumns=[
            _column("Ready", ready),
            _column("Prefill", ".status.prefill.readyReplicas", "integer"),
            _column("Decode", ".status.decode.readyReplicas", "integer"),
            _column("Router", ".status.router.readyReplicas", "integer"),
            _column("Endpoint", ".status.endpoint"),
            _column("Transfer", ".spec.kvTransfer.backend", priority=1),
            _column("Reason", '.status.conditions[?(@.type=="Ready")].reason', priority=1),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def pool_crd() -> Schema:
    return _crd(
        POOL_KIND,
        POOL_PLURAL,
        ["kvrp"],
        pool_schema(),
        subresources={
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        additionalPrinterColumns=[
            _column("Service", ".spec.service"),
            _column("Pool", ".spec.pool"),
            _column("Desired", ".spec.replicas", "integer"),
            _column("Current", ".status.replicas", "integer"),
            _column("Ready", ".status.readyReplicas", "integer"),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


def kopf_peering_crd(cluster: bool) -> Schema:
    """kopf's peering CRD: the operator replicas announce themselves in a peering object's
    status, and only the one with the highest priority acts (the others stand by)."""
    kind = "ClusterKopfPeering" if cluster else "KopfPeering"
    plural = f"{kind.lower()}s"
    status = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": "Cluster" if cluster else "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


CRD_FILES = {
    "kvrelayservices.yaml": service_crd,
    "kvrelaypools.yaml": pool_crd,
    "clusterkopfpeerings.yaml": lambda: kopf_peering_crd(cluster=True),
    "kopfpeerings.yaml": lambda: kopf_peering_crd(cluster=False),
}

_HEADER = "# Generated by `python -m kvrelay_operator.crds`; do not edit.\n"


def render_yaml(crd: Schema) -> str:
    import yaml

    return _HEADER + yaml.safe_dump(crd, sort_keys=False, width=100)


def apply_all(kube: Kube) -> list[str]:
    """Server-side apply every CRD (the chart's upgrade hook); returns their names."""
    names = []
    for build in CRD_FILES.values():
        crd = build()
        kube.apply_cluster(crd, "apiextensions.k8s.io/v1", "customresourcedefinitions")
        names.append(str(crd["metadata"]["name"]))
    return names


def _apply_in_cluster() -> int:
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    for name in apply_all(Kube(kubernetes.client.ApiClient())):
        print(f"applied {name}")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--apply"]:
        return _apply_in_cluster()
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m kvrelay_operator.crds OUT_DIR   write the chart's crds/*.yaml\n"
            "       python -m kvrelay_operator.crds --apply   apply them to the cluster",
            file=sys.stderr,
        )
        return 2
    out = Path(argv[0])
    for filename, build in CRD_FILES.items():
        (out / filename).write_text(render_yaml(build()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
