"""NetworkPolicies: `<name>-backends` (on by default) lets only this pool's engine pods reach its
managed Redis and MinIO; `<name>-engines` (opt-in) lets only the listed peers reach the engines'
OpenAI port. Both need a CNI that enforces NetworkPolicy; without one they are inert."""

from __future__ import annotations

import copy
from typing import Any

from kvpool_operator.render.common import HTTP_PORT, MINIO_PORT, POOL_LABEL, REDIS_PORT, Pool


def _policy(pool: Pool, name: str, component: str, selector: dict[str, Any],
            ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": pool.meta(name, component),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _backends(pool: Pool) -> list[dict[str, Any]]:
    components, ports = [], []
    if pool.managed_redis:
        components.append("redis")
        ports.append({"protocol": "TCP", "port": REDIS_PORT})
    if pool.managed_s3:
        components.append("minio")
        ports.append({"protocol": "TCP", "port": MINIO_PORT})
    if not pool.spec.network_policy.enabled or not components:
        return []
    selector = {
        "matchLabels": {POOL_LABEL: pool.name},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": components}],
    }
    ingress = [{"from": [{"podSelector": {"matchLabels": pool.selector("engine")}}], "ports": ports}]
    return [_policy(pool, pool.network_policy, "backends", selector, ingress)]


def _engines(pool: Pool) -> list[dict[str, Any]]:
    api = pool.spec.network_policy.api_ingress
    if not api.enabled:
        return []
    peers = copy.deepcopy(api.from_) or [{"podSelector": {}}]  # {} here: every pod of this namespace
    ingress = [{"from": peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}]
    return [_policy(pool, pool.engine_network_policy, "engine", {"matchLabels": pool.selector("engine")}, ingress)]


def render_networkpolicy(pool: Pool) -> list[dict[str, Any]]:
    return _backends(pool) + _engines(pool)
