"""The CRD schema of `spec.model.cache`: the default model kept once per service in a claim
that one Job fills (model_cache.py). Pure data; the parser applies the same rules.
"""

from __future__ import annotations

from kvrelay_operator.model_cache import ACCESS_MODES
from kvrelay_operator.schema_parts import Schema, object_name, string
from kvrelay_operator.schema_rdma import QUANTITY


def model_cache_schema() -> Schema:
    return {
        "type": "object",
        "description": "Keep the default model once per service: a PersistentVolumeClaim "
        "that one Job fills (download and conversion), mounted read-only by every router and "
        "worker pod, which wait for it instead of converting the model themselves.",
        "properties": {
            "shared": {
                "type": "boolean",
                "default": False,
                "description": "Use the shared cache (source default only).",
            },
            "claimName": object_name(
                "An existing claim to use (e.g. pre-filled for an air-gapped cluster: the "
                "Job's pull is then a no-op); empty: the operator creates <name>-model-cache."
            ),
            "size": string("The created claim's size.", pattern=QUANTITY, default="4Gi"),
            "storageClassName": string("The created claim's storage class; empty: default."),
            "accessMode": string(
                "ReadWriteMany lets pods on every node mount it (NFS, CephFS, EFS, Filestore); "
                "ReadWriteOnce ties every pod of the service to one node (single-node clusters).",
                enum=list(ACCESS_MODES),
                default="ReadWriteMany",
            ),
        },
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.claimName) || self.claimName == '' || self.shared",
                "message": "claimName needs shared: true",
            }
        ],
    }


def model_cache_rule() -> Schema:
    """The model-level rule: only the default model uses the cache."""
    return {
        "rule": "self.source == 'default' || !has(self.cache) || !self.cache.shared",
        "message": "cache.shared is for source default: pvc and image models are shared "
        "already, hub models are pulled by each pod",
    }
