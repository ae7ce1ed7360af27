"""kvrelay's Kubernetes operator: KVRelayService -> a KubeRay RayCluster, the router and
their policies, with a planner that sizes the prefill and decode pools.

Pure functions hold the logic (`desired`, `status`, `planner`, `signals`); `handlers` is the
thin kopf layer. `kvrelay operator` runs it through `add_operator_arguments` / `run_operator`.
"""

from __future__ import annotations

from kvrelay_operator.app import add_operator_arguments, run_operator

__all__ = ["add_operator_arguments", "run_operator"]
