"""An API server for the operator's integration tests: the in-process fake by default, or
the real one `$KVRELAY_TEST_KUBECONFIG` names (kind, k3d, any cluster; docs/deploy.md).

Against a real server each test gets its own namespace; kvrelay's CRDs are applied (the
chart's upgrade hook's code), KubeRay's RayCluster CRD is installed from KubeRay's published
YAML when the cluster lacks it, and the operator's client authenticates as the chart's
ServiceAccount (a TokenRequest token, the chart's Role bound to it), so RBAC is enforced.
`admin` is the kubeconfig's own identity: a person, an HPA.
"""

from __future__ import annotations

import secrets
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import kubernetes
import yaml

from kvrelay.common.env import TEST_KUBECONFIG
from kvrelay_operator.kube import Kube
from tests.operator.fake_api import FakeApi, fake_api

Obj = dict[str, Any]
FAKE_NAMESPACE = "llm"
# KubeRay's RayCluster CRD as KubeRay publishes it (the version its Helm chart 1.4 installs).
KUBERAY_CRD_URL = (
    "https://raw.githubusercontent.com/ray-project/kuberay/v1.4.2/"
    "ray-operator/config/crd/bases/ray.io_rayclusters.yaml"
)
CRD_ROOT = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@dataclass
class Cluster:
    """One test's API server: `kube` is the operator's client, `admin` everyone else's."""

    kube: Kube
    admin: Kube
    namespace: str
    fake: FakeApi | None = None

    @property
    def real(self) -> bool:
        return self.fake is None

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Obj]:
        """One request as admin; (status, body) whatever the status."""
        api = self.admin._api
        request = api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = api.call_api(*request, _request_timeout=30)
        response.read()
        data = yaml.safe_load(response.data) if response.data else {}
        return response.status, data or {}


@contextmanager
def cluster() -> Iterator[Cluster]:
    """The fake API server, or a namespace on the real one (see the module docstring)."""
    kubeconfig = TEST_KUBECONFIG.get()
    if not kubeconfig:
        with fake_api() as (fake, kube):
            yield Cluster(kube=kube, admin=kube, namespace=FAKE_NAMESPACE, fake=fake)
        return
    admin_client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    admin = Kube(admin_client)
    _install_crds(admin)
    namespace = f"kvrelay-test-{secrets.token_hex(4)}"
    admin.apply_cluster(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        "v1",
        "namespaces",
    )
    try:
        token = _operator_account(admin, namespace)
        yield Cluster(
            kube=Kube(_token_client(admin_client, token)), admin=admin, namespace=namespace
        )
    finally:
        admin._call("DELETE", f"/api/v1/namespaces/{namespace}")
        _delete_cluster_rbac(admin, namespace)


def _install_crds(admin: Kube) -> None:
    """kvrelay's CRDs (always, so they are this checkout's) and KubeRay's (when missing)."""
    from kvrelay_operator.crds import apply_all

    names = apply_all(admin)
    if admin._call("GET", f"{CRD_ROOT}/rayclusters.ray.io") is None:
        with urllib.request.urlopen(KUBERAY_CRD_URL, timeout=60) as answer:
            crd = yaml.safe_load(answer.read())
        admin.apply_cluster(crd, "apiextensions.k8s.io/v1", "customresourcedefinitions")
        names.append("rayclusters.ray.io")
    for name in names:
        _wait_established(admin, name)


def _wait_established(admin: Kube, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        crd = admin._call("GET", f"{CRD_ROOT}/{name}") or {}
        conditions = (crd.get("status") or {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        time.sleep(0.5)
    raise TimeoutError(f"CRD {name} not Established after {timeout_s} s")


def chart_rbac(namespace: str) -> list[Obj]:
    """The chart's ServiceAccount and RBAC for an operator watching `namespace` only."""
    import helm_python as helm

    from tests.deploy.schemas import CHART

    values = {"operator": {"watchNamespaces": [namespace]}, "fullnameOverride": namespace}
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="t", namespace=namespace, is_install=True)
    kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml") and "crd-upgrade" not in path:
            out += [d for d in yaml.safe_load_all(text) if d and d["kind"] in kinds]
    return out


def _operator_account(admin: Kube, namespace: str) -> str:
    """Apply the chart's RBAC; a token of its ServiceAccount."""
    account = ""
    for obj in chart_rbac(namespace):
        group, _, _ = obj["apiVersion"].rpartition("/")
        plural = obj["kind"].lower() + "s"
        root = f"/apis/{group}/v1" if group else "/api/v1"
        ns = obj["metadata"].get("namespace")
        where = f"{root}/namespaces/{ns}/{plural}" if ns else f"{root}/{plural}"
        query = [("fieldManager", "kvrelay-tests"), ("force", "true")]
        path = f"{where}/{obj['metadata']['name']}"
        admin._call("PATCH", path, obj, query, "application/apply-patch+yaml")
        if obj["kind"] == "ServiceAccount":
            account = obj["metadata"]["name"]
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    answer = admin._call("POST", path, request) or {}
    return str(answer["status"]["token"])


def _token_client(admin_client: Any, token: str) -> Any:
    """A client of the same server that authenticates with `token` only (no client
    certificate: the server would take that identity first)."""
    source = admin_client.configuration
    config = kubernetes.client.Configuration()
    config.host = source.host
    config.ssl_ca_cert = source.ssl_ca_cert
    config.verify_ssl = source.verify_ssl
    config.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(config)


def _delete_cluster_rbac(admin: Kube, namespace: str) -> None:
    for obj in chart_rbac(namespace):
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            plural = obj["kind"].lower() + "s"
            path = f"/apis/rbac.authorization.k8s.io/v1/{plural}/{obj['metadata']['name']}"
            admin._call("DELETE", path)
