"""RDMA settings that take effect (issue 43): the privilege choice (no IPC_LOCK where it
cannot work), memlock, hugepages, /dev/shm, any UCX_* and extra env, one hostNetwork
worker per node, and UCX transports that cannot connect two pods refused. Every rendered
object is validated against Kubernetes' own schemas; the CRD's CEL rules and the parser
refuse the same specs."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from kvrelay_operator.desired import desired_objects
from kvrelay_operator.errors import SpecError
from kvrelay_operator.rdma import RESERVED_ENV, RESERVED_ENV_PREFIXES
from kvrelay_operator.schema_rdma import kv_transfer_schema
from tests.deploy.schemas import apply_defaults, validate_everywhere
from tests.operator.fake_schema import cel_failures
from tests.operator.services import service, service_body

NO_POOLS: dict[str, int | None] = {"prefill": None, "decode": None}
Obj = dict[str, Any]


def _cluster(kv: Obj, **spec: Any) -> Obj:
    objects = desired_objects(service({"kvTransfer": kv, **spec}), NO_POOLS)
    for obj in objects:
        validate_everywhere(obj)
    return next(o for o in objects if o["kind"] == "RayCluster")


def _group(kv: Obj, pool: str = "decode", **spec: Any) -> Obj:
    groups = _cluster(kv, **spec)["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == pool)


def _worker(kv: Obj, **spec: Any) -> tuple[Obj, Obj]:
    """(pod spec, worker container) of the decode group."""
    pod = _group(kv, **spec)["template"]["spec"]
    return pod, pod["containers"][0]


def _env(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


RDMA_DEVICES = {"resources": {"rdma/hca": 1}}


def test_unprivileged_adds_no_capability_that_would_not_take_effect() -> None:
    """The defect: IPC_LOCK on uid 1000 without ambient capabilities does nothing."""
    pod, container = _worker({"rdma": RDMA_DEVICES})
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsUser"] == 1000
    assert container["resources"]["limits"]["rdma/hca"] == 1


def test_root_runs_only_the_worker_container_as_root_with_ipc_lock() -> None:
    model = {"source": "hub", "hub": {"id": "Org/Model"}}  # gives the pod an init container
    pod, container = _worker({"rdma": {**RDMA_DEVICES, "privilege": "Root"}}, model=model)
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert (security["runAsUser"], security["runAsNonRoot"]) == (0, False)
    # The pod and its init containers stay uid 1000 and non-root.
    assert pod["securityContext"]["runAsUser"] == 1000
    for init in pod["initContainers"]:
        assert init["securityContext"]["runAsNonRoot"] is True
        assert "add" not in init["securityContext"]["capabilities"]


def test_file_capabilities_keep_uid_1000_and_allow_the_exec_to_gain_them() -> None:
    _, container = _worker({"rdma": {**RDMA_DEVICES, "privilege": "FileCapabilities"}})
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert security["runAsNonRoot"] is True and "runAsUser" not in security
    # no_new_privs would drop the python binary's file capability at exec.
    assert security["allowPrivilegeEscalation"] is True


def test_memlock_unlimited_wraps_kuberays_start_command_as_root() -> None:
    group = _group({"rdma": {"privilege": "Root", "memlock": "Unlimited"}})
    container = group["template"]["spec"]["containers"][0]
    assert group["template"]["metadata"]["annotations"] == {
        "ray.io/overwrite-container-cmd": "true"
    }
    assert container["command"] == ["/bin/bash", "-c", "--"]
    (args,) = container["args"]
    assert "ulimit -l unlimited" in args and "ulimit -n 65536" in args
    assert args.endswith('exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"')
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK", "SYS_RESOURCE"]
    # The default leaves KubeRay's own command alone.
    plain = _group({})
    assert "annotations" not in plain["template"]["metadata"]
    assert "command" not in plain["template"]["spec"]["containers"][0]


def test_hugepages_are_requested_and_mounted() -> None:
    pod, container = _worker({"rdma": {"hugepages": {"size": "2Gi"}}})
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["hugepages-2Mi"] == "2Gi"
    assert {"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}} in pod["volumes"]
    assert {"name": "hugepages", "mountPath": "/dev/hugepages"} in container["volumeMounts"]
    pod, container = _worker({"rdma": {"hugepages": {"size": "4Gi", "pageSize": "1Gi"}}})
    assert container["resources"]["limits"]["hugepages-1Gi"] == "4Gi"
    assert {"name": "hugepages", "emptyDir": {"medium": "HugePages-1Gi"}} in pod["volumes"]


def test_dev_shm_is_a_memory_volume_sized_by_the_spec() -> None:
    pod, container = _worker({})
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    pod, _ = _worker({"shm": {"sizeLimit": "8Gi"}})
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "8Gi"


def test_any_ucx_variable_and_extra_env_reach_the_workers_only() -> None:
    kv = {
        "ucx": {"tls": "rc,cuda_copy", "env": {"UCX_IB_GID_INDEX": "3", "UCX_RNDV_THRESH": "8k"}},
        "workerEnv": {"NCCL_DEBUG": "INFO", "NIXL_LOG_LEVEL": "debug"},
    }
    cluster = _cluster(kv)
    for group in cluster["spec"]["workerGroupSpecs"]:
        env = _env(group["template"]["spec"]["containers"][0])
        assert env["UCX_TLS"] == "rc,cuda_copy"
        assert env["UCX_IB_GID_INDEX"] == "3" and env["UCX_RNDV_THRESH"] == "8k"
        assert env["NCCL_DEBUG"] == "INFO" and env["NIXL_LOG_LEVEL"] == "debug"
    head = _env(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    assert "UCX_IB_GID_INDEX" not in head and "NCCL_DEBUG" not in head


def test_host_network_workers_never_share_a_node() -> None:
    """Two hostNetwork workers on one node would bind the same Ray and KV ports."""
    own = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "podAffinityTerm": {
                        "topologyKey": "zone",
                        "labelSelector": {"matchLabels": {"team": "x"}},
                    },
                }
            ]
        }
    }
    pod, _ = _worker({"hostNetwork": True}, decode={"affinity": own})
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    anti = pod["affinity"]["podAntiAffinity"]
    assert (
        anti["preferredDuringSchedulingIgnoredDuringExecution"]
        == (own["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"])
    )
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    selector = term["labelSelector"]
    assert selector["matchLabels"] == {"app.kubernetes.io/name": "kvrelay"}
    assert selector["matchExpressions"][0]["values"] == ["prefill", "decode"]
    # Both pools carry the labels the term selects on.
    for group in _cluster({"hostNetwork": True})["spec"]["workerGroupSpecs"]:
        labels = group["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvrelay"
        assert labels["app.kubernetes.io/component"] in ("prefill", "decode")
    pod, _ = _worker({})
    assert "affinity" not in pod and "hostNetwork" not in pod


# Specs the parser and the CRD's CEL rules must both refuse, with what the message says.
REFUSED = [
    ({"ucx": {"tls": "cuda_ipc"}}, "same-host"),
    ({"ucx": {"tls": "sm,cuda_ipc"}}, "same-host"),
    ({"ucx": {"tls": " shm , cuda_copy ,self"}}, "same-host"),
    ({"ucx": {"env": {"UCX_TLS": "rc"}}}, "UCX_TLS"),
    ({"rdma": {"ipcLock": True}}, "ipcLock"),
    ({"rdma": {"memlock": "Unlimited", "privilege": "FileCapabilities"}}, "Root"),
]
# Refused by the parser only: a map key has no maxLength, so a CEL regex over the keys would
# cost too much for the API server (schema_rdma.py); the operator reports InvalidSpec.
PARSER_ONLY = [({"ucx": {"env": {"NCCL_DEBUG": "INFO"}}}, "UCX_")]
ACCEPTED = [
    {"ucx": {"tls": "rc,cuda_copy"}},
    {"ucx": {"tls": "tcp"}},
    {"ucx": {"tls": "rc,sm,cuda_ipc"}},  # same-host ones beside a network one: harmless
    {"ucx": {"tls": "^sm"}},  # an exclusion list keeps the network transports
    {"rdma": {"ipcLock": True, "privilege": "FileCapabilities"}},
    {"rdma": {"memlock": "Unlimited", "privilege": "Root"}},
]


@pytest.mark.parametrize(("kv", "message"), REFUSED + PARSER_ONLY)
def test_the_parser_refuses_transports_and_privileges_that_cannot_work(
    kv: Obj, message: str
) -> None:
    body = {"metadata": {"name": "demo", "namespace": "llm"}, "spec": {"kvTransfer": kv}}
    from kvrelay_operator.spec import parse_service

    with pytest.raises(SpecError, match=message):
        parse_service(body, "img:1")


def _cel_failures(kv: Obj) -> list[str]:
    """The kvTransfer CEL rules `kv` breaks, after the server's defaulting (evaluated as
    the fake API server does: cel-python)."""
    schema = kv_transfer_schema()
    return cel_failures(schema, apply_defaults(schema, kv), None)


@pytest.mark.parametrize(("kv", "message"), REFUSED)
def test_the_crd_cel_rules_refuse_the_same(kv: Obj, message: str) -> None:
    assert _cel_failures(kv), kv


def test_every_string_a_cel_rule_reads_is_bounded() -> None:
    """The API server refuses a CRD whose rules it cannot cost: a regex over an unbounded
    string is one."""
    ucx = kv_transfer_schema()["properties"]["ucx"]
    assert "tls" in ucx["x-kubernetes-validations"][0]["rule"]
    assert ucx["properties"]["tls"]["maxLength"] <= 1024
    for name in ("env",):
        assert "x-kubernetes-validations" not in ucx["properties"][name]


@pytest.mark.parametrize("kv", ACCEPTED)
def test_working_settings_pass_both(kv: Obj) -> None:
    assert _cel_failures(kv) == []
    service_body({"kvTransfer": kv})  # the CRD's structural schema
    _cluster(kv)


@pytest.mark.parametrize(
    "name", [*RESERVED_ENV, *(p + "X" for p in RESERVED_ENV_PREFIXES), "1BAD", "A-B"]
)
def test_worker_env_refuses_names_the_operator_sets_or_kubernetes_refuses(name: str) -> None:
    with pytest.raises(SpecError, match="workerEnv"):
        service({"kvTransfer": {"workerEnv": {name: "1"}}})


def test_reserved_names_cover_every_variable_the_operator_puts_on_a_worker() -> None:
    """A workerEnv entry may never shadow the operator's own (Kubernetes keeps the last)."""
    _, container = _worker({"rdma": {"privilege": "Root", "memlock": "Unlimited"}})
    for name in _env(container):
        assert name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES), name


def test_the_structural_schema_refuses_bad_quantities_and_choices() -> None:
    for kv in (
        {"shm": {"sizeLimit": "lots"}},
        {"rdma": {"hugepages": {"size": "2Gi", "pageSize": "4Ki"}}},
        {"rdma": {"hugepages": {"pageSize": "2Mi"}}},  # size is required
        {"rdma": {"privilege": "Admin"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            service_body({"kvTransfer": kv})
