"""The one list of API permissions the operator uses (Kubernetes PolicyRule shape).

The Helm chart's ClusterRole/Role and its tests derive from `RBAC_RULES`; tests here check that
every kind the operator renders, reads or watches is covered, so code and RBAC cannot drift.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator import models

CHILD_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]

RBAC_RULES: list[dict[str, Any]] = [
    # The pools themselves; status through the status subresource.
    {"apiGroups": [models.GROUP], "resources": [models.PLURAL], "verbs": ["get", "list", "watch", "patch", "update"]},
    {"apiGroups": [models.GROUP], "resources": [f"{models.PLURAL}/status"], "verbs": ["get", "patch", "update"]},
    # Children: server-side applied, pruned, and (workloads) watched for status.
    {"apiGroups": [""], "resources": ["configmaps", "secrets", "services"], "verbs": CHILD_VERBS},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"], "verbs": CHILD_VERBS},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": CHILD_VERBS},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": CHILD_VERBS},
    # Kubernetes Events about pools (kopf posts them through core/v1 events).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # kopf: resource discovery, namespace scanning (globs), peering between operator replicas.
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings", "kopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
]

# Cluster-scoped resources: a namespaced install still needs a ClusterRole for these.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces"),
                  ("kopf.dev", "clusterkopfpeerings")}


def allows(api_group: str, resource: str, verb: str) -> bool:
    return any(
        api_group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in RBAC_RULES
    )
