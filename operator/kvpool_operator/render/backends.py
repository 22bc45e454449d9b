"""Shared pieces of the managed backend StatefulSets (Redis, MinIO)."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import Pool

RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod_security(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def backend_service(pool: Pool, name: str, component: str, port_name: str, port: int) -> dict[str, Any]:
    """ClusterIP Service in front of a backend StatefulSet."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pool.meta(name, component),
        "spec": {
            "selector": pool.selector(component),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }


def backend_statefulset(pool: Pool, name: str, component: str, pod_spec: dict[str, Any],
                        **extra: Any) -> dict[str, Any]:
    """One-replica StatefulSet of a backend; `extra` adds spec fields (volumeClaimTemplates...)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": pool.meta(name, component),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": pool.selector(component)},
            **extra,
            "template": {"metadata": {"labels": pool.labels(component)}, "spec": pod_spec},
        },
    }
