"""NetworkPolicy `<name>-backends`: only this pool's engine pods reach its managed Redis and MinIO."""

from __future__ import annotations

from typing import Any

from kvpool_operator.render.common import MINIO_PORT, POOL_LABEL, REDIS_PORT, Pool


def render_networkpolicy(pool: Pool) -> list[dict[str, Any]]:
    components, ports = [], []
    if pool.managed_redis:
        components.append("redis")
        ports.append({"protocol": "TCP", "port": REDIS_PORT})
    if pool.managed_s3:
        components.append("minio")
        ports.append({"protocol": "TCP", "port": MINIO_PORT})
    if not pool.spec.network_policy.enabled or not components:
        return []
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": pool.meta(pool.network_policy, "backends"),
            "spec": {
                "podSelector": {
                    "matchLabels": {POOL_LABEL: pool.name},
                    "matchExpressions": [
                        {"key": "app.kubernetes.io/component", "operator": "In", "values": components}
                    ],
                },
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": pool.selector("engine")}}], "ports": ports}],
            },
        }
    ]
